"""Time to first token on a long agent-style prompt: cold, warm from the RAM tier, warm from disk after a restart.

The workload is an agent's second request: turn 1 (system prompt + tool definitions + a file + a question)
is answered and stored; turn 2 resends all of it, the reply, and a new question. Cold prefills turn 2 in a
Session without a cache; RAM restores the stored turn in a new Session sharing the cache; disk does it in a
new process (a restarted server) with only (a copy of) the directory. Every Session first answers an
unrelated short prompt, so the drafter's one-off cost calibration is not counted as prefill. Greedy: the three
replies must be identical. --reps R repeats the three, interleaved, with R different questions in turn 2
(each warm run stores its turn, which shares the next run's prefix up to the question) and reports the
fastest of each too: on a loaded machine load only adds.

--catch-up N...: what a warm request costs as the restored prefix grows (issue 23: the drafter's catch-up
after a restored prefix must not be quadratic). For each N, a Session stores the state after the prompt's
first N tokens; a fork sharing its cache then sends those N tokens and a fixed new question, restores the N
and prefills the question, once speculatively (the drafter injects the question's features after the N
restored positions) and once plainly (target only); the difference is the drafter's catch-up.

    python scripts/bench_prompt_cache.py                        # the embedded pair, ~3000 tokens
    python scripts/bench_prompt_cache.py --target T --drafter D --tokens 10000 --kv q8_0
    python scripts/bench_prompt_cache.py --catch-up 1000 2000 4000 8000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
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


# the Session and its rooms (session.py alone was about 9,700 tokens before issue 34 split it)
SESSION_SOURCES = ("session.py", "speculation.py", "prompt_cache_link.py", "generation.py", "opening.py")


def agent_prompt(session: Session, n_tokens: int) -> list[int]:
    """System prompt, tool definitions and as much of the Session's source as brings it to about n_tokens."""
    package = Path(__file__).resolve().parents[1] / "dflash_gguf"
    head = ("<|im_start|>system\nYou are a coding agent working in a Python repository. Use the tools to read and "
            "change files; answer briefly.\n\nTools:\n" + "\n".join(json.dumps(t) for t in TOOLS)
            + "\n<|im_end|>\n<|im_start|>user\nHere is session.py and the modules it holds its parts in:\n\n")
    tail = "\n\nWhat does Session.reset do?<|im_end|>\n<|im_start|>assistant\n"
    text = "\n\n".join((package / name).read_text() for name in SESSION_SOURCES)
    body = session.target.vocab.tokenize(head + text + tail)
    while len(body) > n_tokens and text:
        text = text[: int(len(text) * n_tokens / len(body) * 0.98)]
        body = session.target.vocab.tokenize(head + text + tail)
    return body


# turn 2's new question, one per --reps run: each warm run stores its turn, which the next run's prefix
# then shares up to the question (the next run restores that), so every run asks its own
QUESTIONS = ["And Session.fork?", "And what does close do?", "Which locks does it take?", "Where is last_stats set?",
             "Is reset thread-safe?"]
MARKS = ["One", "Two", "Three", "Four", "Five", "Six", "Seven", "Eight", "Nine", "Ten"]  # --catch-up: per run
QUESTION = ("<|im_end|>\n<|im_start|>user\nNow a different task. Write a function that parses a size such as "
            "512MiB or 2GiB into bytes, with tests for each unit, and explain the edge cases you handle: an empty "
            "string, a negative number, an unknown unit, a fraction, whitespace around the number and the unit, "
            "and a number so large that it overflows.<|im_end|>\n<|im_start|>assistant\n")


def load() -> str:
    return "load average " + " ".join(f"{x:.1f}" for x in os.getloadavg())


def ttft(session: Session, tokens: list[int], args: argparse.Namespace) -> tuple[float, list[int], dict | None]:
    """Seconds to the first token, the reply's tokens, what the prompt cache did."""
    t0 = time.perf_counter()
    first = None
    reply = []
    for step in session.stream_tokens(tokens, max_tokens=args.max_tokens, block_size=args.block_size):
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
    p.add_argument("--block-size", type=int, help="fixed blocks (default: adaptive, whose choices follow measured "
                   "timings, so under load two runs may verify in other batches and part at a near tie)")
    p.add_argument("--n-ctx", type=int, help="default: room for the longest prompt and reply, rounded up to a multiple of 1024")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--kv", default="f16", help="KV cache type of target and drafter (f16, q8_0, q4_0)")
    p.add_argument("--catch-up", type=int, nargs="+", metavar="N", help="restored prefix lengths to time (see above)")
    p.add_argument("--reps", type=int, help=f"interleaved runs of cold, disk and RAM (default 1, at most "
                   f"{len(QUESTIONS)}); with --catch-up, per N (default 3)")
    p.add_argument("--phase", choices=["all", "disk"], default="all", help=argparse.SUPPRESS)
    p.add_argument("--dir", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--turn2", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    args.reps = args.reps if args.reps is not None else 3 if args.catch_up else 1
    most = len(MARKS) // 2 if args.catch_up else len(QUESTIONS)
    if not 1 <= args.reps <= most:
        p.error(f"--reps must be between 1 and {most}")
    longest = max(args.catch_up or [args.tokens]) + 512  # the prompt, a second turn or question, the replies
    args.n_ctx = args.n_ctx or -(-longest // 1024) * 1024

    if args.catch_up:
        catch_up(args)
        return
    if args.phase == "disk":  # the restarted process: a cache with only the directory
        with open_session(args, PromptCache(directory=args.dir)) as s:
            print(json.dumps(ttft(s, json.loads(args.turn2.read_text()), args)))
        return

    directory = Path(tempfile.mkdtemp(prefix="dflash-pc-"))
    try:
        cache = PromptCache(ram_bytes=8 << 30, directory=directory, disk_bytes=16 << 30)
        with open_session(args, cache) as s:
            turn1 = agent_prompt(s, args.tokens)
            t1, reply1, stored = ttft(s, turn1, args)  # stores prompt + reply
            turns = [turn1 + reply1 + s.tokenize(f"<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n",
                                                 add_special=False) for q in QUESTIONS[: args.reps]]
        print(f"turn 1: {len(turn1)} tokens (TTFT {t1:.2f} s; stored in {stored['store_ms']:.0f} ms after its last "
              f"token, the disk write queued); turn 2: {len(turns[0])} tokens; KV {args.kv}; "
              f"n_ctx {args.n_ctx}; {args.threads} threads; {load()}")
        print("| run | cold TTFT s (prefill s) | warm RAM TTFT s | % of cold | warm disk TTFT s (new process) | % of cold "
              "| restored RAM / disk | restore ms RAM / disk | replies identical | load |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |")
        best = {"cold": [], "ram": [], "disk": []}
        for i, turn2 in enumerate(turns):
            with open_session(args, None) as s:
                cold, reply_cold, _ = ttft(s, turn2, args)
                cold_prefill = s.last_stats.prefill_s
            disk, reply_disk, event_disk = restarted(args, directory, turn2)
            with open_session(args, cache) as s:  # another Session sharing the cache: a slot of the same server
                ram, reply_ram, event_ram = ttft(s, turn2, args)
            for k, v in (("cold", cold), ("ram", ram), ("disk", disk)):
                best[k].append(v)
            print(f"| {i + 1} | {cold:.3f} ({cold_prefill:.3f}) | {ram:.3f} | {100 * ram / cold:.1f}% | {disk:.3f} | "
                  f"{100 * disk / cold:.1f}% | {event_ram['n_restored']} / {event_disk['n_restored']} | "
                  f"{event_ram['restore_ms']:.0f} / {event_disk['restore_ms']:.0f} | "
                  f"{same(reply_cold, reply_ram, reply_disk)} | {load()[len('load average '):]} |", flush=True)
            if event_ram["tier"] != "ram" or event_disk["tier"] != "disk":
                raise SystemExit(f"expected a RAM and a disk hit, got {event_ram} and {event_disk}")
        cold, ram, disk = (min(best[k]) for k in ("cold", "ram", "disk"))
        print(f"fastest of {len(turns)}: cold {cold:.3f} s, warm RAM {ram:.3f} s ({100 * ram / cold:.1f}%), "
              f"warm disk {disk:.3f} s ({100 * disk / cold:.1f}%)")
        per_token = max(e.stat().st_size for e in directory.glob("*.dfpc")) / (len(turn1) + len(reply1) - 1)
        print(f"entry size: {per_token / 1024:.1f} KiB per cached token (target + drafter state)")
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def same(cold: list[int], ram: list[int], disk: list[int]) -> str:
    """'yes', or where each warm reply first parts from the cold one."""
    if cold == ram == disk:
        return "yes"

    def parts(a: list[int], b: list[int]) -> str:
        i = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        return "same" if a == b else f"token {i}"

    return f"NO: RAM {parts(cold, ram)}, disk {parts(cold, disk)}"


def restarted(args: argparse.Namespace, directory: Path, turn2: list[int]) -> tuple[float, list[int], dict]:
    """ttft() of turn2 in a new process whose cache is a copy of `directory` (a restarted server)."""
    restart = Path(tempfile.mkdtemp(prefix="dflash-pc-restart-"))
    try:
        shutil.copytree(directory, restart, dirs_exist_ok=True)  # its own copy: what it stores is not seen here
        saved = restart / "turn2.json"
        saved.write_text(json.dumps(turn2))
        cmd = [sys.executable, __file__, "--phase", "disk", "--dir", str(restart), "--turn2", str(saved),
               "--max-tokens", str(args.max_tokens), "--n-ctx", str(args.n_ctx), "--threads", str(args.threads),
               "--kv", args.kv]
        cmd += ["--block-size", str(args.block_size)] if args.block_size else []
        cmd += ["--target", str(args.target)] if args.target else []
        cmd += ["--drafter", str(args.drafter)] if args.drafter else []
        return tuple(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
    finally:
        shutil.rmtree(restart, ignore_errors=True)


def catch_up(args: argparse.Namespace) -> None:
    """Restore N tokens and prefill a fixed question after them, speculatively and plainly, interleaved
    --reps times for each N (the fastest of each kept: load only adds). The Ns are prefixes of one prompt,
    so one Session prefills the longest only once (each shorter prefix's state is stored and measured
    before the next, longer one supersedes it). The drafter's inject calls are recorded: the rows it was
    given and where, which is what makes the catch-up linear (only the new tokens) or quadratic (all)."""
    longest = max(args.catch_up)
    print(f"n_ctx {args.n_ctx}, {args.threads} threads, KV {args.kv}, fastest of {args.reps} interleaved runs; "
          f"{load()}")
    print("| restored N | restore ms | question prefill, speculative s | plain s | drafter inject s | "
          "rows injected (at position) | load |")
    print("| ---: | ---: | ---: | ---: | ---: | --- | --- |")
    with open_session(args, PromptCache(ram_bytes=8 << 30)) as s:
        prompt = agent_prompt(s, int(longest * 1.04) + 64)  # it comes out a few % under what is asked
        question = s.tokenize(QUESTION, add_special=False)
        for n in sorted(args.catch_up):
            if n > len(prompt):
                raise SystemExit(f"--catch-up {n}: the agent prompt has only {len(prompt)} tokens")
            prefix = prompt[:n]
            for _ in s.stream_tokens(prefix, max_tokens=1):  # stores the state after the prefix (and a token)
                pass
            runs: dict[bool, list[Run]] = {True: [], False: []}
            for i in range(args.reps):
                for speculative in (True, False):
                    # the forks share the cache and a speculative run stores its prompt: the next run's prompt
                    # must not extend it (it would restore the question too), so each run's question is its own
                    # from the first token
                    asked = s.tokenize(f" {MARKS[2 * i + speculative]}:", add_special=False) + question
                    with s.fork() as other:
                        runs[speculative].append(warm_prefill(other, prefix + asked, n, speculative))
            spec = min(runs[True], key=lambda r: r.prefill_s)
            plain = min(r.prefill_s for r in runs[False])
            restore = min(r.restore_ms for r in runs[True] + runs[False])
            calls = " / ".join(sorted({", ".join(f"{k} ({p})" for k, p in r.injected) or "none" for r in runs[True]}))
            if any(r.injected for r in runs[False]):
                calls += "; plain runs injected too: " + str([r.injected for r in runs[False]])
            print(f"| {n} | {restore:.0f} | {spec.prefill_s:.3f} | {plain:.3f} | {spec.inject_s:.3f} | {calls} | "
                  f"{load()[len('load average '):]} |", flush=True)
    print(f"question: {len(question)} tokens, after a word of each run's own (a token or two)")


@dataclass
class Run:
    restore_ms: float
    prefill_s: float
    inject_s: float  # in the drafter's inject (part of prefill_s)
    injected: list[tuple[int, int]]  # (rows, first position) of each inject call


def warm_prefill(session: Session, tokens: list[int], n_restored: int, speculative: bool) -> Run:
    """One generation of one token that must restore n_restored tokens from the RAM tier."""
    run = Run(0.0, 0.0, 0.0, [])
    drafter = session.drafter
    inject = drafter.inject

    def recorded_inject(features, positions):
        t0 = time.perf_counter()
        try:
            return inject(features, positions)
        finally:
            run.inject_s += time.perf_counter() - t0
            run.injected.append((len(features), int(positions)))

    drafter.inject = recorded_inject  # this fork's drafter only
    for _ in session.stream_tokens(tokens, max_tokens=1, speculative=speculative):
        pass
    stats = session.last_stats
    if stats.prompt_cache.tier != "ram" or stats.n_cached_tokens != n_restored:
        raise SystemExit(f"expected a RAM hit of {n_restored} tokens, got {stats.prompt_cache}")
    run.restore_ms, run.prefill_s = stats.prompt_cache.restore_ms, stats.prefill_s
    return run


if __name__ == "__main__":
    main()
