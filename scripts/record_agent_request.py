"""Record the first request an agent program sends to a model API, for tests/agent_requests/.

    python scripts/record_agent_request.py OUT.json --note "what sent it, how" [--port 8765] [--path /v1/chat/completions]
        [--with tools]

Listens on 127.0.0.1:PORT; point the agent's base URL there. The first POST to --path (with --with KEY: the
first whose body has KEY; the others are answered 503) is written to OUT.json
(`recorded`, `method`, `path`, `headers`, `body`, with the key in `authorization` / `x-api-key` replaced by
`<key>`) and answered 503, then the recorder exits; any other request is answered 404. The agent then fails
its turn: the recording is what it sent, which tests/test_agent_door.py replays without a prefill.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

SECRET_HEADERS = {"authorization", "x-api-key"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path)
    p.add_argument("--note", required=True, help="the `recorded` field: the program, its version and how it ran")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--path", default="/v1/chat/completions", help="the route whose first POST is recorded")
    p.add_argument("--with", dest="with_key", metavar="KEY",
                   help="record the first such POST whose body has this key (`tools`: the agent's turn, not its title)")
    args = p.parse_args()
    done = False

    class Recorder(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._answer(404, {"error": {"message": "recorder: not here", "type": "not_found"}})

        def do_POST(self) -> None:
            nonlocal done
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            if self.path.split("?")[0] != args.path or done:
                self._answer(404, {"error": {"message": "recorder: not here", "type": "not_found"}})
                return
            if args.with_key and args.with_key not in json.loads(body):
                self._answer(503, {"error": {"message": "recorder: not recorded", "type": "unavailable"}})
                return
            headers = {k: ("<key>" if k.lower() in SECRET_HEADERS else v) for k, v in self.headers.items()}
            record = {"recorded": args.note, "method": "POST", "path": args.path, "headers": headers,
                      "body": json.loads(body)}
            fd, tmp = tempfile.mkstemp(dir=args.out.parent, prefix=args.out.name + ".")
            with os.fdopen(fd, "w") as f:
                json.dump(record, f, indent=1, ensure_ascii=False)
                f.write("\n")
            os.replace(tmp, args.out)
            done = True
            self._answer(503, {"error": {"message": "recorder: recorded, not served", "type": "unavailable"}})

        def _answer(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, fmt: str, *a: object) -> None:
            print("recorder:", fmt % a, flush=True)

    server = HTTPServer(("127.0.0.1", args.port), Recorder)
    print(f"recorder: listening on http://127.0.0.1:{args.port}, recording the first POST {args.path}", flush=True)
    while not done:
        server.handle_request()
    print(f"recorder: wrote {args.out}", flush=True)


if __name__ == "__main__":
    main()
