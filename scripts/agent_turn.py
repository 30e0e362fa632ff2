"""One turn of a real agent program, with its DEFAULT tools and settings, against dflash-serve started as
docs/SERVER.md's agent recipe starts it; prints what it took.

    python scripts/agent_turn.py claude|codex|opencode [--prompt TEXT] [--n-ctx 32768] [--out DIR]
        [--env NAME=VALUE ...]

The server is the recipe's (`dflash-serve --target T --drafter D --n-ctx 32768 --api-key KEY`) on the embedded
pair, whose target is copied with a Hermes tool template (the embedded SmolLM2's own template takes no tools:
the copy is what tests/test_agents.py serves). Each client runs as a new user runs it, in a home of its own and
a scratch git project holding one file, configured only with what points it at the server (and what --env adds:
the client's own settings from this shell's environment are not passed, so a run is what a new user gets):

- Claude Code: `claude -p PROMPT --output-format stream-json --verbose` (ANTHROPIC_BASE_URL, ANTHROPIC_API_KEY);
- Codex: a provider in ~/.codex/config.toml, `codex exec --json PROMPT`;
- OpenCode: a provider in opencode.json, `opencode run --format json PROMPT`.

Printed (and written to DIR/summary.json): the turn's wall time and exit status, the load average before and
after (the machine is shared), every request the server answered by route and status (/metrics), the prompt,
cached and completion tokens, time to first token, and whether a tool result went back (the client's own
transcript shows a tool run, and a request after it carried its result: the server's per-request log lines).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from dflash_gguf import defaults

ROOT = Path(__file__).resolve().parents[1]
NPM_BIN = ROOT / "tests" / "agents" / "node_modules" / ".bin"
HERMES = ROOT / "tests" / "tool_templates" / "hermes.jinja"
KEY = "sk-agent-turn"
PROMPT = "Read hello.py and tell me what it prints."
FILE = "print('hello from dflash')\n"


def tool_target(cache: Path) -> Path:
    """The embedded target with the Hermes tool template (gguf's own gguf_new_metadata), built once."""
    out = cache / "smollm2-hermes.gguf"
    if not out.exists():
        cache.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".tmp-{os.getpid()}")
        subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--chat-template-file", str(HERMES),
                        str(defaults.embedded_target()), str(tmp)], check=True, capture_output=True)
        tmp.rename(out)
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(target: Path, n_ctx: int, port: int, log: Path,
                 extra: list[str] | None = None) -> tuple[subprocess.Popen, list[str]]:
    """The recipe's server (`extra`: more dflash-serve flags), once /health answers; its output goes to `log`."""
    cmd = ["dflash-serve", "--target", str(target), "--drafter", str(defaults.embedded_drafter()),
           "--n-ctx", str(n_ctx), "--api-key", KEY, "--port", str(port), *(extra or [])]
    out = open(log, "w")
    proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "DFLASH_API_KEY": ""})
    deadline = time.monotonic() + 300
    while True:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"agent_turn.py: dflash-serve did not come up:\n{log.read_text()[-3000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc, cmd
        except httpx.TransportError:
            time.sleep(0.5)


def stop_server(server: subprocess.Popen, grace_s: float = 120) -> None:
    """SIGTERM (the server finishes its streams and closes its cache), then a kill after grace_s."""
    server.send_signal(signal.SIGTERM)
    try:
        server.wait(grace_s)
    except subprocess.TimeoutExpired:
        server.kill()
        server.wait()


def client_command(client: str, url: str, prompt: str, work: Path, home: Path) -> tuple[list[str], dict[str, str]]:
    """The client's command line and environment: only what points it at the server (and no telemetry)."""
    env = {"PWD": str(work), "HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "XDG_DATA_HOME": str(home / ".local/share"),
           "XDG_CACHE_HOME": str(home / ".cache"), "XDG_STATE_HOME": str(home / ".local/state")}
    if client == "claude":
        env.update({"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": KEY, "DISABLE_TELEMETRY": "1",
                    "DISABLE_AUTOUPDATER": "1", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"})
        return [str(NPM_BIN / "claude"), "-p", prompt, "--output-format", "stream-json", "--verbose"], env
    if client == "codex":
        (home / ".codex").mkdir(parents=True)
        (home / ".codex" / "config.toml").write_text(
            'model = "dflash"\nmodel_provider = "dflash"\n\n[model_providers.dflash]\nname = "dflash"\n'
            f'base_url = "{url}/v1"\nwire_api = "responses"\nenv_key = "DFLASH_KEY"\n')
        env["DFLASH_KEY"] = KEY
        return [str(NPM_BIN / "codex"), "exec", "--json", prompt], env
    if client == "opencode":
        (work / "opencode.json").write_text(json.dumps(opencode_config(url), indent=2) + "\n")
        env.update({"DFLASH_KEY": KEY, "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_SHARE": "1"})
        return [str(NPM_BIN / "opencode"), "run", "--format", "json", prompt], env
    raise SystemExit(f"agent_turn.py: unknown client {client!r}")


def opencode_config(url: str) -> dict:
    """docs/SERVER.md's OpenCode provider: @ai-sdk/openai-compatible on /v1, for its small model (titles) too."""
    return {"$schema": "https://opencode.ai/config.json", "model": "dflash/dflash", "small_model": "dflash/dflash",
            "provider": {"dflash": {"npm": "@ai-sdk/openai-compatible", "name": "dflash-serve",
                                    "options": {"baseURL": f"{url}/v1", "apiKey": "{env:DFLASH_KEY}"},
                                    "models": {"dflash": {"name": "dflash"}}}}}


def run_client(cmd: list[str], cwd: Path, env: dict[str, str], timeout: float, t0: float) -> list:
    """Run the client; its stdout lines, each as [seconds since t0, line], then its exit status ("timeout" when
    it ran past `timeout` and was killed). stderr's tail is kept as a last line, marked "stderr"."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            stdin=subprocess.DEVNULL)
    killer = threading.Timer(timeout, proc.kill)
    killer.start()
    err: list[str] = []
    reader = threading.Thread(target=lambda: err.extend(proc.stderr), daemon=True)
    reader.start()
    out: list = [[round(time.monotonic() - t0, 1), line.rstrip("\n")] for line in proc.stdout]
    proc.wait()
    timed_out = not killer.is_alive() and proc.returncode < 0
    killer.cancel()
    reader.join(10)
    out.append([round(time.monotonic() - t0, 1), "stderr: " + "".join(err)[-4000:]])
    out.append("timeout" if timed_out else proc.returncode)
    return out


def metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("client", choices=["claude", "codex", "opencode"])
    p.add_argument("--prompt", default=PROMPT)
    p.add_argument("--n-ctx", type=int, default=32768, help="the recipe's context (default 32768)")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the turn may take (default 3600)")
    p.add_argument("--out", type=Path, help="where the server log, transcript and summary go (default: a temp dir)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE",
                   help="a variable for the client's environment, e.g. CLAUDE_STREAM_IDLE_TIMEOUT_MS=3600000 (repeatable)")
    args = p.parse_args()
    extra_env = dict(e.split("=", 1) for e in args.env if "=" in e and e.split("=", 1)[0])
    if len(extra_env) != len(args.env):
        raise SystemExit(f"agent_turn.py: --env takes NAME=VALUE, got {[e for e in args.env if '=' not in e or e.startswith('=')]}")
    if not (NPM_BIN / args.client).is_file():
        raise SystemExit(f"agent_turn.py: {NPM_BIN / args.client} is not installed: bash scripts/install_agents.sh")
    out = args.out or Path(tempfile.mkdtemp(prefix=f"agent-turn-{args.client}-"))
    out.mkdir(parents=True, exist_ok=True)
    work, home = out / "project", out / "home"
    if work.exists() or home.exists():
        raise SystemExit(f"agent_turn.py: {out} holds an earlier run (project/, home/): give another --out")
    work.mkdir()
    home.mkdir()
    (work / "hello.py").write_text(FILE)
    subprocess.run(["git", "init", "-q", str(work)], check=True)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    t_start = time.monotonic()
    server, server_cmd = start_server(tool_target(ROOT / ".cache" / "agents"), args.n_ctx, port, out / "serve.log")
    summary: dict = {"client": args.client, "server": " ".join(server_cmd), "server_start_s": time.monotonic() - t_start}
    try:
        cmd, env = client_command(args.client, url, args.prompt, work, home)
        base = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "OPENAI_", "CODEX_", "OPENCODE",
                                                                         "CLAUDE_"))}
        summary.update(command=" ".join(cmd), env=extra_env, load_before=os.getloadavg())
        t0 = time.monotonic()
        lines = run_client(cmd, work, {**base, **env, **extra_env}, args.timeout, t0)
        summary.update(exit=lines.pop(), transcript=lines)
        summary.update(wall_s=round(time.monotonic() - t0, 1), load_after=os.getloadavg())
        m = metrics(url)
        summary["requests"] = {k: v for k, v in m.items() if k.startswith("dflash_requests_total") and "/metrics" not in k}
        summary["figures"] = {k: v for k, v in m.items() if k.startswith((
            "dflash_prompt_tokens", "dflash_completion_tokens", "dflash_generation_seconds", "dflash_requests_cancelled",
            "dflash_time_to_first_token_seconds_sum", "dflash_time_to_first_token_seconds_count", "dflash_prompt_cache_lookups", "dflash_prompt_cache_restore", "dflash_requests_rejected", "dflash_queue_seconds"))}
    finally:
        stop_server(server)
    (out / "transcript.json").write_text(json.dumps(summary.pop("transcript", []), indent=0) + "\n")
    log = (out / "serve.log").read_text()
    summary["server_log_tracebacks"] = log.count("Traceback")
    summary["server_log_refused"] = [line for line in log.splitlines() if "refused" in line][:20]
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
    print(f"agent_turn.py: the transcript, server log and summary are in {out}")


if __name__ == "__main__":
    main()
