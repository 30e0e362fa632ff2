"""What dflash-chat costs the decoder: decode tok/s of the same prompts headless vs inside the app.

One interleaved run: for every prompt and mode (plain, speculative), the generation runs headless
(Session.stream_chat iterated with nothing else to do), then the same generation inside the real app
(Textual's run_test, the embedded pair, keys typed through Pilot). Both figures come from the Session's own
GenerationStats, so they are measured the same way: decode_tokens_per_s is the wall-clock rate after the
prefill, as the worker thread iterated the stream (loop_tok/s counts only the time inside the decode loop).
The Session's cache is reset before every run, so each one prefills the same prompt.

    python scripts/measure_tui_overhead.py [--rounds 2] [--max-tokens 96] [--switch-interval S] [--profile OUT.prof]

--profile runs cProfile on the UI thread during the in-app runs and prints where its time went; it
also prints the UI thread's CPU seconds per reply (from /proc) with or without it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import threading
import time

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in a few sentences why the sky is blue.",
    "List five tips for writing clear code.",
)
SIZE = (120, 40)


def thread_cpu_s(tid: int) -> float:
    """CPU seconds (user + system) the thread with native id `tid` has used."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def headless(session, prompt: str, gen: dict) -> tuple[float, float]:
    session.reset()
    steps = session.stream_chat([{"role": "user", "content": prompt}], **gen)
    for _ in steps:
        pass
    stats = session.last_stats
    return stats.decode_tokens_per_s, stats.n_tokens / stats.loop_s if stats.loop_s else 0.0


async def in_app(app, pilot, session, prompt: str, speculative: bool, profiler) -> tuple[float, float, float]:
    app.action_new_chat()
    await pilot.pause()
    session.reset()
    ui = threading.get_native_id()
    cpu0 = thread_cpu_s(ui)
    if profiler is not None:
        profiler.enable()
    if speculative:
        app.query_one("#prompt").value = prompt
        await pilot.press("enter")
    else:  # what Ctrl+G runs: the same conversation, decoded plainly, streamed the same way
        app.history.append({"role": "user", "content": prompt})
        app._start_reply(app._conversation(), speculative=False)
        app.history.pop()
    await pilot.pause(0.05)
    while app.busy:
        await pilot.pause(0.1)  # polls lightly: the script must not load the UI thread itself
    if profiler is not None:
        profiler.disable()
    cpu = thread_cpu_s(ui) - cpu0
    stats = session.last_stats
    return stats.decode_tokens_per_s, stats.n_tokens / stats.loop_s if stats.loop_s else 0.0, cpu


def main() -> None:
    parser = argparse.ArgumentParser(prog="measure_tui_overhead.py")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--switch-interval", type=float, default=None,
                        help="the GIL switch interval the app sets (default: the app's own)")
    parser.add_argument("--profile", default=None, help="write the UI thread's cProfile here and print its top")
    args = parser.parse_args()

    from dflash_gguf.session import Session
    import dflash_gguf.tui.app as chat_app
    from dflash_gguf.tui.app import ChatApp
    from dflash_gguf.tui.options import ChatOptions, GenerationOptions

    if args.switch_interval is not None:
        chat_app.GIL_SWITCH_INTERVAL_S = args.switch_interval
    profiler = cProfile.Profile() if args.profile else None
    results: dict[tuple[str, str], list[float]] = {}
    loops: dict[tuple[str, str], list[float]] = {}
    cpus: dict[str, list[float]] = {}
    options = ChatOptions(generation=GenerationOptions(max_tokens=args.max_tokens))
    with Session(n_ctx=2048, n_threads=args.n_threads) as session:
        # warm-up: the adaptive controller measures its costs once per Session; not timed
        headless(session, PROMPTS[0], options.generation.session_kwargs(speculative=True))
        app = ChatApp(session, options)

        async def run() -> None:
            async with app.run_test(size=SIZE) as pilot:
                for _ in range(args.rounds):
                    for prompt in PROMPTS:
                        for mode in ("plain", "speculative"):
                            gen = options.generation.session_kwargs(speculative=mode == "speculative")
                            wall, loop = headless(session, prompt, gen)
                            results.setdefault((mode, "headless"), []).append(wall)
                            loops.setdefault((mode, "headless"), []).append(loop)
                            wall, loop, cpu = await in_app(app, pilot, session, prompt, mode == "speculative", profiler)
                            results.setdefault((mode, "app"), []).append(wall)
                            loops.setdefault((mode, "app"), []).append(loop)
                            cpus.setdefault(mode, []).append(cpu)

        asyncio.run(run())

    print(f"{len(PROMPTS)} prompts x {args.rounds} rounds, max_tokens {args.max_tokens}, "
          f"n_threads {args.n_threads}, GIL switch {chat_app.GIL_SWITCH_INTERVAL_S * 1000:g} ms in the app, interleaved headless/app; median decode tok/s (wall, after prefill)")
    print(f"{'mode':<12}{'headless':>10}{'in app':>10}{'app/headless':>14}{'loop hl':>10}{'loop app':>10}{'UI cpu s':>10}")
    for mode in ("plain", "speculative"):
        h = statistics.median(results[(mode, "headless")])
        a = statistics.median(results[(mode, "app")])
        lh = statistics.median(loops[(mode, "headless")])
        la = statistics.median(loops[(mode, "app")])
        print(f"{mode:<12}{h:>10.1f}{a:>10.1f}{a / h:>13.1%} {lh:>10.1f}{la:>10.1f}{statistics.median(cpus[mode]):>10.3f}")
    if profiler is not None:
        profiler.dump_stats(args.profile)
        stats = pstats.Stats(args.profile)
        stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
