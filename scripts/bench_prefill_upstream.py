"""Cold prefill against upstream llama-server's: the same GGUF, the same prompt tokens, the same threads and batch.

Prefill is what an agent's user waits for on a long prompt, so ours must run as fast as the engine allows.
Both sides get the same token ids (an agent-style prompt from bench_prompt_cache.py), n_batch = n_ubatch,
flash attention on, and are measured interleaved (ours, theirs, ours, ...) after one warm-up each, so that
machine load hits both alike. Ours is `prefill_s` of a plain Session after reset() (target only: the same
work llama-server does); upstream's is `timings.prompt_ms` of a /completion with cache_prompt off. The second
pair runs the drafter on both sides: our Session with it, and a llama-server given it (`-md`, upstream's
draft-dflash), whose prefill also feeds every batch's target features into the drafter's KV cache
(common_speculative_process after each batch, inside prompt_ms): the same work our prefill does.

    python scripts/bench_prefill_upstream.py --server /path/to/llama-server --tokens 8000 --n-ctx 8192

llama-server caps a slot's context at the model's training context (SmolLM2: 8192) and refuses a longer
prompt; our Session only warns. To compare beyond it, raise the model's trained length for llama-server
(`--server-arg=--override-kv --server-arg=llama.context_length=int:12288`): it changes no computation.

Build llama-server from the llama.cpp that llama-cpp-python 0.3.36 vendors, with the flags scripts/setup.sh
uses (see docs/BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_prompt_cache import agent_prompt  # noqa: E402

from dflash_gguf import Session, defaults  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=3600) as r:
        return json.loads(r.read())


def start_server(args: argparse.Namespace, target: Path, port: int, drafter: Path | None = None) -> subprocess.Popen:
    threads = ["-t", str(args.threads), "-tb", str(args.threads)]
    draft = [] if drafter is None else ["-md", str(drafter), "--spec-type", "draft-dflash",
                                        "-td", str(args.threads), "-tbd", str(args.threads)]
    cmd = [str(args.server), "-m", str(target), "--host", "127.0.0.1", "--port", str(port), *threads, *draft,
           "-c", str(args.n_ctx), "-b", str(args.n_batch), "-ub", str(args.n_batch), "-fa", "on", "-np", "1",
           "--no-webui", "--cache-ram", "0", *args.server_arg]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"llama-server exited with {proc.returncode}: {' '.join(cmd)}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.5)
    proc.kill()
    raise SystemExit("llama-server did not become healthy in 300 s")


def upstream_prefill_s(port: int, tokens: list[int]) -> float:
    out = post(f"http://127.0.0.1:{port}/completion",
               {"prompt": tokens, "n_predict": 1, "cache_prompt": False, "temperature": 0})
    n = out["timings"]["prompt_n"]
    if n != len(tokens):
        raise SystemExit(f"llama-server processed {n} prompt tokens, not {len(tokens)}")
    return out["timings"]["prompt_ms"] / 1000.0


def our_prefill_s(session: Session, tokens: list[int]) -> float:
    session.reset()
    for _ in session.stream_tokens(tokens, max_tokens=1, speculative=session.drafter is not None):
        pass
    stats = session.last_stats
    if stats.n_cached_tokens:
        raise SystemExit(f"the Session reused {stats.n_cached_tokens} tokens after reset()")
    return stats.prefill_s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--server", type=Path, required=True, help="a llama-server binary")
    p.add_argument("--target", type=Path, help="default: the embedded SmolLM2 target")
    p.add_argument("--drafter", type=Path, help="default: the embedded drafter (for the second pair)")
    p.add_argument("--tokens", type=int, default=10000)
    p.add_argument("--n-ctx", type=int, default=12288)
    p.add_argument("--n-batch", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--server-arg", action="append", default=[], help="one more llama-server argument (repeatable)")
    args = p.parse_args()
    target = args.target or defaults.embedded_target()
    drafter = args.drafter or defaults.embedded_drafter()
    if not args.server.is_file():
        p.error(f"--server: no such file: {args.server}")
    if args.target and not args.drafter:
        p.error("--target needs --drafter: the second pair runs the drafter on both sides")
    kw = dict(n_ctx=args.n_ctx, n_batch=args.n_batch, n_threads=args.threads, flash_attn=True)

    port, draft_port = free_port(), free_port()
    servers = [start_server(args, target, port), start_server(args, target, draft_port, drafter)]
    try:
        with Session(target, lookup=False, **kw) as plain, Session(target, drafter, **kw) as spec:
            spec.generate("Hello.", max_tokens=4)  # the drafter's cost calibration, outside every timing
            tokens = agent_prompt(plain, args.tokens)
            runs = {
                "upstream llama-server": lambda: upstream_prefill_s(port, tokens),
                "ours, target only": lambda: our_prefill_s(plain, tokens),
                "upstream, with the drafter": lambda: upstream_prefill_s(draft_port, tokens),
                "ours, with the drafter": lambda: our_prefill_s(spec, tokens),
            }
            times: dict[str, list[float]] = {name: [] for name in runs}
            for name, run in runs.items():  # warm-up
                run()
            for _ in range(args.reps):
                for name, run in runs.items():
                    times[name].append(run())
    finally:
        for server in servers:
            server.terminate()
            server.wait(30)
    med = {name: statistics.median(t) for name, t in times.items()}
    print(f"prompt: {len(tokens)} tokens; {args.threads} threads, n_batch = n_ubatch = {args.n_batch}, "
          f"flash attention on; {args.reps} interleaved runs each (median; all runs in seconds)")
    for name, t in times.items():
        print(f"{name:28s}{med[name]:8.3f} s  {[round(x, 3) for x in t]}")
    print(f"ratio (upstream time / ours): target only {med['upstream llama-server'] / med['ours, target only']:.3f}, "
          f"both with the drafter {med['upstream, with the drafter'] / med['ours, with the drafter']:.3f}, "
          f"ours with the drafter against upstream without {med['upstream llama-server'] / med['ours, with the drafter']:.3f}")


if __name__ == "__main__":
    main()
