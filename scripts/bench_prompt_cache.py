"""Time to first token on a long agent-style prompt: cold, warm from the RAM tier, warm from disk after a restart.

The workload is an agent's second request: turn 1 (system prompt + tool definitions + a file + a question)
is answered and stored; turn 2 resends all of it, the reply, and a new question. Cold prefills turn 2 in a
Session without a cache; RAM restores the stored turn in a new Session sharing the cache; disk does it in a
new process (a restarted server) with only the directory. Every Session first answers an unrelated short
prompt, so the drafter's one-off cost calibration is not counted as prefill. Greedy: the three replies must
be identical.

    python scripts/bench_prompt_cache.py                        # the embedded pair, ~3000 tokens
    python scripts/bench_prompt_cache.py --target T --drafter D --tokens 3000 --kv q8_0
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash_gguf import Session
from dflash_gguf.prompt_cache import PromptCache

TOOLS = [
    {"name": "read_file", "description": "Read a file of the repository.", "parameters": {"path": "string"}},
    {"name": "write_file", "description": "Write a file.", "parameters": {"path": "string", "text": "string"}},
    {"name": "run", "description": "Run a shell command in the repository and return its output.",
     "parameters": {"cmd": "string", "timeout_s": "integer"}},
    {"name": "search", "description": "Search the code for a string.", "parameters": {"query": "string"}},
]


def agent_prompt(session: Session, n_tokens: int) -> list[int]:
    """System prompt, tool definitions and as much of a source file as brings it to about n_tokens."""
    source = Path(__file__).resolve().parents[1] / "dflash_gguf" / "session.py"
    head = ("<|im_start|>system\nYou are a coding agent working in a Python repository. Use the tools to read and "
            "change files; answer briefly.\n\nTools:\n" + "\n".join(json.dumps(t) for t in TOOLS)
            + "\n<|im_end|>\n<|im_start|>user\nHere is session.py:\n\n")
    tail = "\n\nWhat does Session.reset do?<|im_end|>\n<|im_start|>assistant\n"
    text = source.read_text()
    body = session.target.tokenize(head + text + tail)
    while len(body) > n_tokens and text:
        text = text[: int(len(text) * n_tokens / len(body) * 0.98)]
        body = session.target.tokenize(head + text + tail)
    return body


def ttft(session: Session, tokens: list[int], max_tokens: int) -> tuple[float, list[int], dict | None]:
    """Seconds to the first token, the reply's tokens, what the prompt cache did."""
    t0 = time.perf_counter()
    first = None
    reply = []
    for step in session.stream_tokens(tokens, max_tokens=max_tokens):
        if first is None:
            first = time.perf_counter() - t0
        reply += step.tokens
    stats = session.last_stats
    event = None if stats.prompt_cache is None else {**stats.prompt_cache.as_dict(), "prefill_s": stats.prefill_s,
                                                     "cache_n": stats.n_cached_tokens}
    return first, reply, event


def open_session(args: argparse.Namespace, cache: PromptCache | None) -> Session:
    s = Session(args.target, args.drafter, n_ctx=args.n_ctx, n_threads=args.threads, type_k=args.kv, type_v=args.kv,
                prompt_cache=cache)
    s.generate("Hello.", max_tokens=4)  # calibration and warm-up, outside every timing
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path)
    p.add_argument("--drafter", type=Path)
    p.add_argument("--tokens", type=int, default=3000, help="turn-1 prompt length (default 3000)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--n-ctx", type=int, default=8192)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv", default="f16", help="KV cache type of target and drafter (f16, q8_0, q4_0)")
    p.add_argument("--phase", choices=["all", "disk"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--turn2", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()

    if args.phase == "disk":  # the restarted process: a cache with only the directory
        with open_session(args, PromptCache(directory=args.dir)) as s:
            print(json.dumps(ttft(s, json.loads(args.turn2.read_text()), args.max_tokens)))
        return

    directory = Path(tempfile.mkdtemp(prefix="dflash-pc-"))
    try:
        cache = PromptCache(ram_bytes=8 << 30, directory=directory, disk_bytes=16 << 30)
        with open_session(args, cache) as s:
            turn1 = agent_prompt(s, args.tokens)
            t1, reply1, _ = ttft(s, turn1, args.max_tokens)  # stores prompt + reply
            turn2 = turn1 + reply1 + s.tokenize("<|im_end|>\n<|im_start|>user\nAnd Session.fork?<|im_end|>\n"
                                                "<|im_start|>assistant\n", add_special=False)
        with open_session(args, None) as s:
            cold, reply_cold, _ = ttft(s, turn2, args.max_tokens)
            cold_prefill = s.last_stats.prefill_s
        restart = Path(tempfile.mkdtemp(prefix="dflash-pc-restart-"))
        shutil.copytree(directory, restart, dirs_exist_ok=True)  # its own copy: what it stores is not seen here
        saved = restart / "turn2.json"
        saved.write_text(json.dumps(turn2))
        cmd = [sys.executable, __file__, "--phase", "disk", "--dir", str(restart), "--turn2", str(saved),
               "--max-tokens", str(args.max_tokens), "--n-ctx", str(args.n_ctx), "--threads", str(args.threads),
               "--kv", args.kv]
        cmd += ["--target", str(args.target)] if args.target else []
        cmd += ["--drafter", str(args.drafter)] if args.drafter else []
        disk, reply_disk, event_disk = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
        shutil.rmtree(restart, ignore_errors=True)
        with open_session(args, cache) as s:
            ram, reply_ram, event_ram = ttft(s, turn2, args.max_tokens)
        entries = list(directory.glob("*.dfpc"))
        per_token = max(e.stat().st_size for e in entries) / (len(turn1) + len(reply1) - 1)
        print(f"turn 1: {len(turn1)} tokens (TTFT {t1:.2f} s, stored); turn 2: {len(turn2)} tokens; KV {args.kv}")
        print(f"cold TTFT           {cold:8.3f} s  (prefill {cold_prefill:.3f} s)")
        print(f"warm from RAM TTFT  {ram:8.3f} s  ({100 * ram / cold:.1f}% of cold; {event_ram})")
        print(f"warm from disk TTFT {disk:8.3f} s  ({100 * disk / cold:.1f}% of cold, new process; {event_disk})")
        print(f"entry size: {per_token / 1024:.1f} KiB per cached token (target + drafter state)")
        print(f"replies identical: {reply_cold == reply_ram == reply_disk}")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    main()
