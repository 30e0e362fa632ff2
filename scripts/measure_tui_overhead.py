"""What dflash-chat costs the decoder: decode tok/s of the same prompts headless vs inside the app, with the
Session on a thread of the app (ThreadWorker) and in a worker process (ProcessWorker).

One interleaved run: for every round, prompt and mode (plain, speculative) it runs, one after the other,
- headless: Session.stream_chat iterated in this process with nothing else to do;
- thread app: the real app (Textual's run_test, 120x40, the embedded pair) on a ThreadWorker of that Session;
- process headless: the worker process's Session, its Steps sent over the pipe to nobody drawing them;
- process app: the real app on that ProcessWorker.
Every figure is the Session's own GenerationStats, measured where the Session runs: decode_tokens_per_s is
the wall-clock rate after the prefill as the Session's consumer iterated the stream (what the UI can slow);
loop tok/s counts only the time inside the decode loop. Caches are reset before every run, so each one
prefills the same prompt. Load averages are printed before and after.

    python scripts/measure_tui_overhead.py [--rounds 2] [--max-tokens 96] [--switch-interval S] [--profile OUT.prof]

--profile runs cProfile on the UI thread during the in-app runs and prints where its time went; the UI
thread's CPU seconds per reply (from /proc) are printed with or without it.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import os
import pstats
import statistics
import threading

PROMPTS = (
    "Write a Python function that checks whether a string is a palindrome.",
    "Explain in a few sentences why the sky is blue.",
    "List five tips for writing clear code.",
)
SIZE = (120, 40)
RUNS = ("headless", "thread app", "process headless", "process app")


def thread_cpu_s(tid: int) -> float:
    """CPU seconds (user + system) the thread with native id `tid` has used."""
    with open(f"/proc/self/task/{tid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def headless(session, prompt: str, gen):
    session.reset()
    for _ in session.stream_chat([{"role": "user", "content": prompt}], gen):
        pass
    return session.last_stats


def worker_headless(worker, prompt: str, gen):
    """A reply through the worker with nobody drawing it: what the process boundary alone costs."""
    from dflash_gguf.tui.messages import ReplyFinished

    worker.reset()
    ended = threading.Event()
    result = []

    def post(message) -> None:
        result.append(message)
        ended.set()

    worker.reply([{"role": "user", "content": prompt}], gen, [], post)
    ended.wait()
    assert isinstance(result[0], ReplyFinished), result[0]
    return result[0].stats


async def in_app(worker, options, prompt: str, speculative: bool, profiler) -> tuple[object, float]:
    from dflash_gguf.tui.app import ChatApp

    worker.reset()
    app = ChatApp(worker, options)
    async with app.run_test(size=SIZE) as pilot:
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
    return app.last_generation, cpu


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
    from dataclasses import replace

    from dflash_gguf.config import GenerationConfig, SessionOptions
    from dflash_gguf.tui.options import ChatOptions
    from dflash_gguf.tui.process_worker import ProcessWorker, SessionSpec
    from dflash_gguf.tui.worker import ThreadWorker

    if args.switch_interval is not None:
        chat_app.GIL_SWITCH_INTERVAL_S = args.switch_interval
    profiler = cProfile.Profile() if args.profile else None
    wall: dict[tuple[str, str], list[float]] = {}
    loop: dict[tuple[str, str], list[float]] = {}
    cpus: dict[tuple[str, str], list[float]] = {}
    options = ChatOptions(generation=GenerationConfig(max_tokens=args.max_tokens))
    load_before = os.getloadavg()
    spec = SessionSpec(options=SessionOptions(n_ctx=2048, n_threads=args.n_threads))
    with spec.open() as session, ProcessWorker(spec) as process:
        thread = ThreadWorker(session)
        # warm-up: the adaptive controller measures its costs once per Session; not timed
        warm = options.generation
        headless(session, PROMPTS[0], warm)
        worker_headless(process, PROMPTS[0], warm)

        def record(run: str, mode: str, stats, cpu: float | None = None) -> None:
            wall.setdefault((run, mode), []).append(stats.decode_tokens_per_s)
            loop.setdefault((run, mode), []).append(stats.loop_tokens_per_s or 0.0)
            if cpu is not None:
                cpus.setdefault((run, mode), []).append(cpu)

        async def run() -> None:
            for _ in range(args.rounds):
                for prompt in PROMPTS:
                    for mode in ("plain", "speculative"):
                        speculative = mode == "speculative"
                        gen = replace(options.generation, speculative=speculative)
                        record("headless", mode, headless(session, prompt, gen))
                        record("thread app", mode, *await in_app(thread, options, prompt, speculative, profiler))
                        record("process headless", mode, worker_headless(process, prompt, gen))
                        record("process app", mode, *await in_app(process, options, prompt, speculative, profiler))

        asyncio.run(run())
        thread.close()
    load_after = os.getloadavg()

    print(f"{len(PROMPTS)} prompts x {args.rounds} rounds, max_tokens {args.max_tokens}, n_threads {args.n_threads}, "
          f"GIL switch {chat_app.GIL_SWITCH_INTERVAL_S * 1000:g} ms in the app; interleaved; medians")
    print(f"load average before {load_before[0]:.2f} {load_before[1]:.2f} {load_before[2]:.2f}, "
          f"after {load_after[0]:.2f} {load_after[1]:.2f} {load_after[2]:.2f}")
    print("paired: each run over the headless run of the same round, prompt and mode (median, quartiles)")
    print(f"{'mode':<12}{'run':<18}{'decode tok/s':>13}{'(min-max)':>14}{'/ headless':>11}{'paired':>9}"
          f"{'(q1-q3)':>14}{'loop tok/s':>11}{'UI cpu s':>10}")
    for mode in ("plain", "speculative"):
        base_runs = wall[("headless", mode)]
        base = statistics.median(base_runs)
        for run in RUNS:
            w = statistics.median(wall[(run, mode)])
            paired = [x / b for x, b in zip(wall[(run, mode)], base_runs)]
            q1, _, q3 = statistics.quantiles(paired, n=4)
            lp = statistics.median(loop[(run, mode)])
            cpu = f"{statistics.median(cpus[(run, mode)]):>10.2f}" if (run, mode) in cpus else f"{'':>10}"
            spread = f"{min(wall[(run, mode)]):.1f}-{max(wall[(run, mode)]):.1f}"
            print(f"{mode:<12}{run:<18}{w:>13.1f}{spread:>14}{w / base:>10.1%}{statistics.median(paired):>9.1%}"
                  f"{f'{q1:.0%}-{q3:.0%}':>14} {lp:>10.1f}{cpu}")
    if profiler is not None:
        profiler.dump_stats(args.profile)
        stats = pstats.Stats(args.profile)
        stats.sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
