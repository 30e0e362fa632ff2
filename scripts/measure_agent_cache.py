"""The prompt cache on agents' real first turns: time to first token cold, warm from the RAM tier, warm from the
slot's live context and warm from disk after a restart, for each recorded default request in tests/agent_requests/.

    python scripts/measure_agent_cache.py [--requests claude-code-2.1.197-turn.json codex-0.171.0-turn.json]
        [--max-tokens 8] [--n-ctx 32768] [--out DIR]

The server is docs/SERVER.md's agent recipe on the embedded pair (the target copied with the Hermes tool template,
as scripts/agent_turn.py and tests/test_agents.py serve it): `dflash-serve --n-ctx 32768 --cache-dir DIR` with its
default RAM tier. Each recorded request (the exact body and headers the client sent, streamed as it was) is sent
with its reply cut to --max-tokens (the body's `max_tokens` / `max_output_tokens`), in four rounds:

- cold: each request once, in order (a full prefill; its prompt + reply is stored in RAM and on disk);
- ram: each again, in the same order: with two requests or more the slot holds the previous one's context,
  so each prompt is restored from the RAM tier;
- live: the last request once more: its prompt is still in the slot's context;
- disk: the server is stopped (SIGTERM) and started again on the same --cache-dir, and each request is sent
  once more: restored from disk.

For each send it prints the client's time to the first generated event (a text, reasoning or arguments delta;
a withheld tool call comes at the end), the whole request's time, and what the server's own figures say:
`timings` (prompt_n, cache_n, prompt_ms) and `dflash.prompt_cache` (tier, n_restored, restore_ms). The load
average is printed before and after (the machine is shared). Everything goes to DIR/summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

from agent_turn import KEY, ROOT, free_port, start_server, stop_server, tool_target  # noqa: E402  (the recipe's server)

RECORDED = ROOT / "tests" / "agent_requests"
DEFAULT_REQUESTS = ["claude-code-2.1.197-turn.json", "codex-0.171.0-turn.json"]
HEADERS_SENT_BY_HTTPX = {"host", "content-length", "connection", "accept-encoding"}
KEY_HEADERS = {"authorization": f"Bearer {KEY}", "x-api-key": KEY}
OUTPUT_EVENTS = {"content_block_delta"}  # and every Responses event whose type ends in ".delta"


def request_parts(name: str, max_tokens: int) -> tuple[str, dict[str, str], dict[str, Any]]:
    """The recorded request's path, headers (its key replaced by the server's) and body, its reply cut short."""
    rec = json.loads((RECORDED / name).read_text())
    headers = {k: (KEY_HEADERS[k.lower()] if k.lower() in KEY_HEADERS else v) for k, v in rec["headers"].items()
               if k.lower() not in HEADERS_SENT_BY_HTTPX}
    body = dict(rec["body"])
    body["max_output_tokens" if rec["path"].startswith("/v1/responses") else "max_tokens"] = max_tokens
    return rec["path"], headers, body


def send(url: str, path: str, headers: dict[str, str], body: dict[str, Any]) -> dict[str, Any]:
    """One streamed request: the client's times (headers, first generated event, end) and the server's figures."""
    t0 = time.monotonic()
    out: dict[str, Any] = {"status": None, "first_output_s": None}
    with httpx.Client(timeout=httpx.Timeout(7200.0)) as c, c.stream("POST", url + path, json=body, headers=headers) as r:
        out["status"] = r.status_code
        out["headers_s"] = round(time.monotonic() - t0, 3)
        if r.status_code != 200:
            out["error"] = r.read().decode()[:2000]
            return out
        for line in r.iter_lines():
            if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                continue
            data = json.loads(line[5:])
            kind = data.get("type", "")
            if out["first_output_s"] is None and (kind in OUTPUT_EVENTS or kind.endswith(".delta")):
                out["first_output_s"] = round(time.monotonic() - t0, 3)
            if kind == "error" or kind == "response.failed":
                out["error"] = data
            for holder in (data, data.get("response") or {}):
                if isinstance(holder, dict) and holder.get("timings"):
                    t, d = holder["timings"], holder.get("dflash") or {}
                    out["server"] = {"prompt_n": t["prompt_n"], "cache_n": t["cache_n"],
                                     "prompt_ms": round(t["prompt_ms"], 1), "predicted_n": t["predicted_n"],
                                     "prompt_cache": d.get("prompt_cache"), "queue_ms": d.get("queue_ms")}
    out["total_s"] = round(time.monotonic() - t0, 3)
    if out["first_output_s"] is None:
        out["first_output_s"] = out["total_s"]
    return out


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--requests", nargs="+", default=DEFAULT_REQUESTS, help="files in tests/agent_requests/")
    p.add_argument("--max-tokens", type=int, default=8, help="each reply's length (default 8)")
    p.add_argument("--n-ctx", type=int, default=32768, help="the recipe's context (default 32768)")
    p.add_argument("--out", type=Path, help="the cache directory, server logs and summary.json (default: a temp dir)")
    args = p.parse_args()
    missing = [n for n in args.requests if not (RECORDED / n).is_file()]
    if missing:
        raise SystemExit(f"measure_agent_cache.py: no such recorded request in {RECORDED}: {', '.join(missing)}")
    if args.max_tokens < 1:
        raise SystemExit("measure_agent_cache.py: --max-tokens must be at least 1")
    out = args.out or Path(tempfile.mkdtemp(prefix="agent-cache-"))
    cache = out / "cache"
    if cache.exists():
        raise SystemExit(f"measure_agent_cache.py: {out} holds an earlier run (cache/): give another --out")
    cache.mkdir(parents=True)
    parts = {n: request_parts(n, args.max_tokens) for n in args.requests}
    target = tool_target(ROOT / ".cache" / "agents")
    extra = ["--cache-dir", str(cache)]
    summary: dict[str, Any] = {"requests": args.requests, "max_tokens": args.max_tokens, "load_before": load(),
                               "rounds": []}
    port = free_port()
    url = f"http://127.0.0.1:{port}"

    def round_(name: str, names: list[str]) -> None:
        for n in names:
            r = send(url, *parts[n])
            r.update(round=name, request=n, load=load())
            summary["rounds"].append(r)
            print(json.dumps(r), flush=True)

    server, cmd = start_server(target, args.n_ctx, port, out / "serve-1.log", extra)
    summary["server"] = " ".join(cmd)
    try:
        round_("cold", args.requests)
        round_("ram", args.requests)
        round_("live", args.requests[-1:])
    finally:
        stop_server(server)
    server, _ = start_server(target, args.n_ctx, port, out / "serve-2.log", extra)
    try:
        round_("disk", args.requests)
    finally:
        stop_server(server)
    summary["load_after"] = load()
    summary["server_start_line"] = next((line for line in (out / "serve-1.log").read_text().splitlines()
                                         if "prompt cache" in line), None)
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(f"\nload average before {summary['load_before']}, after {summary['load_after']}; {summary['server']}")
    print(f"{'round':5} {'request':32} {'first out':>10} {'total':>9} {'prompt_n':>8} {'cache_n':>7} {'tier':>5} "
          f"{'restored':>8} {'restore':>9}")
    for r in summary["rounds"]:
        s = r.get("server") or {}
        pc = s.get("prompt_cache") or {}
        restore = f"{pc['restore_ms']:.0f} ms" if pc.get("restore_ms") is not None else "-"
        print(f"{r['round']:5} {r['request']:32} {r['first_output_s']:>9.1f}s {r.get('total_s', 0):>8.1f}s "
              f"{s.get('prompt_n', '-'):>8} {s.get('cache_n', '-'):>7} {str(pc.get('tier')):>5} "
              f"{pc.get('n_restored', '-'):>8} {restore:>9}" + (f"  ERROR {r['error']}" if r.get("error") else ""))
    print(f"measure_agent_cache.py: logs and summary.json in {out}")


if __name__ == "__main__":
    main()
