"""A bounded load test of dflash-serve on loopback: concurrency x requests against --parallel slots.

For each --parallel P it starts `dflash-serve` as a subprocess on a free loopback port, warms it up,
then for each concurrency C sends --requests streamed chat completions (greedy, --max-tokens each)
from C concurrent clients, and reports aggregate tokens/s, p50/p95 time to first token and latency,
errors, and the server's RSS before and after. It also measures the server's own overhead: the same
requests at concurrency 1 on one slot, non-streamed, interleaved with Session.chat in this process.

    python scripts/load_test_server.py                       # 1,2,4,8 x 50 against --parallel 1 and 2
    python scripts/load_test_server.py --json out.json --concurrency 1,2 --requests 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = [
    "What is the capital of France?", "Name three primary colours.", "How many legs does a spider have?",
    "What is 12 times 12?", "Give me a synonym for happy.", "What does a thermometer measure?",
    "Which planet is closest to the sun?", "Write one sentence about the sea.", "What is the opposite of cold?",
    "Name a fruit that is yellow.",
]


def messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, max(0, round(q / 100 * (len(values) - 1))))]


async def one_stream(client: httpx.AsyncClient, i: int, max_tokens: int) -> dict:
    body = {"model": "dflash", "messages": messages(i), "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {"error": f"HTTP {r.status_code}"}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    return {"error": chunk["error"]["code"]}
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content") and ttft is None:
                    ttft = time.perf_counter() - t0
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    except httpx.HTTPError as e:
        return {"error": type(e).__name__}
    return {"ttft": ttft if ttft is not None else time.perf_counter() - t0, "latency": time.perf_counter() - t0,
            "tokens": tokens}


async def run_level(url: str, concurrency: int, n: int, max_tokens: int) -> dict:
    queue = list(range(n))
    results: list[dict] = []
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def worker() -> None:
            while queue:
                results.append(await one_stream(client, queue.pop(0), max_tokens))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    return {
        "concurrency": concurrency, "requests": n, "errors": len(results) - len(ok),
        "error_kinds": sorted({r["error"] for r in results if "error" in r}),
        "wall_s": wall, "tokens": sum(r["tokens"] for r in ok),
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "ttft_p50_ms": pct([r["ttft"] for r in ok], 50) * 1000, "ttft_p95_ms": pct([r["ttft"] for r in ok], 95) * 1000,
        "latency_p50_ms": pct([r["latency"] for r in ok], 50) * 1000,
        "latency_p95_ms": pct([r["latency"] for r in ok], 95) * 1000,
    }


class Server:
    def __init__(self, parallel: int, extra: list[str]) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [sys.executable, "-m", "dflash_gguf.server.cli", "--port", str(self.port), "--parallel", str(parallel),
               "--queue", "64", "--log-level", "warning", *extra]
        self.proc = subprocess.Popen(cmd, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 120
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"load_test_server: error: dflash-serve did not start ({' '.join(cmd)})")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)

    def stop(self) -> int:
        self.proc.terminate()
        return self.proc.wait(60)


def overhead(args: argparse.Namespace) -> dict:
    """Session.chat in this process against the same request through a one-slot server, interleaved.

    Each pair runs the same messages once each way, one after the other (the order alternates between
    pairs), so both see the same machine load; both caches see the same sequence of prompts. The ratio
    is the median of the per-pair ratios (server / Session.chat), HTTP round trip included.
    """
    from dflash_gguf import Session

    n = args.overhead_requests
    server = Server(1, args.server_args)
    local: list[float] = []
    remote: list[float] = []
    inside: list[float] = []  # each server request's own generation time, from its timings
    try:
        with Session(args.target, args.drafter, n_threads=args.threads, lookup=args.lookup) as s, \
                httpx.Client(base_url=server.url, timeout=600) as c:
            def in_process(i: int) -> float:
                t0 = time.perf_counter()
                s.chat(messages(i), max_tokens=args.max_tokens, temperature=0.0)
                return time.perf_counter() - t0

            def through_server(i: int) -> float:
                t0 = time.perf_counter()
                r = c.post("/v1/chat/completions", json={"messages": messages(i), "max_tokens": args.max_tokens,
                                                         "temperature": 0})
                seconds = time.perf_counter() - t0
                r.raise_for_status()
                t = r.json()["timings"]
                inside.append((t["prompt_ms"] + t["predicted_ms"]) / 1000)
                return seconds

            in_process(0)  # warm-up and calibration, both sides
            through_server(0)
            inside.clear()
            for i in range(n):
                if i % 2:
                    remote.append(through_server(i))
                    local.append(in_process(i))
                else:
                    local.append(in_process(i))
                    remote.append(through_server(i))
    finally:
        server.stop()
    pairs = [r / lo for r, lo in zip(remote, local)]
    return {"requests": n, "order": "interleaved pairs, alternating which goes first",
            "session_chat_median_ms": statistics.median(local) * 1000, "server_median_ms": statistics.median(remote) * 1000,
            "ratio_median_of_pairs": statistics.median(pairs),
            "ratio_p10_p90_of_pairs": [pct(pairs, 10), pct(pairs, 90)],
            "overhead_ms_median_of_pairs": statistics.median(r - lo for r, lo in zip(remote, local)) * 1000,
            # load-independent: each request's HTTP latency over the generation time inside that same request
            "in_request_ratio_median": statistics.median(r / g for r, g in zip(remote, inside)),
            "in_request_overhead_ms_median": statistics.median(r - g for r, g in zip(remote, inside)) * 1000}


def write_json(path: Path | None, out: dict) -> None:
    """The figures, written beside the destination and renamed into place."""
    if path is None:
        return
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(out, indent=2))
    tmp.replace(path)


def commit() -> str | None:
    r = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                       cwd=Path(__file__).resolve().parent)
    return r.stdout.strip() or None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parallel", default="1,2")
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--requests", type=int, default=50)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--overhead-requests", type=int, default=20)
    p.add_argument("--target")
    p.add_argument("--drafter")
    p.add_argument("--threads", type=int, help="CPU threads per slot (and for the in-process Session)")
    p.add_argument("--lookup", action=argparse.BooleanOptionalAction, default=None,
                   help="pass --lookup / --no-lookup to the server and lookup= to the in-process Session")
    p.add_argument("--overhead-only", action="store_true", help="measure only the overhead against Session.chat")
    p.add_argument("--json", type=Path, help="also write the figures here")
    a = p.parse_args()
    a.server_args = (["--target", a.target] if a.target else []) + (["--drafter", a.drafter] if a.drafter else []) \
        + (["--threads", str(a.threads)] if a.threads else []) \
        + ([] if a.lookup is None else ["--lookup" if a.lookup else "--no-lookup"])
    out = {"commit": commit(), "max_tokens": a.max_tokens, "threads": a.threads, "cpu_count": os.cpu_count(),
           "load_before": os.getloadavg(), "runs": []}
    o = out["overhead"] = overhead(a)
    print(f"overhead ({o['requests']} interleaved pairs): Session.chat {o['session_chat_median_ms']:.1f} ms, server "
          f"{o['server_median_ms']:.1f} ms, ratio {o['ratio_median_of_pairs']:.3f} (p10-p90 "
          f"{o['ratio_p10_p90_of_pairs'][0]:.3f}-{o['ratio_p10_p90_of_pairs'][1]:.3f}), "
          f"{o['overhead_ms_median_of_pairs']:.1f} ms; in-request ratio {o['in_request_ratio_median']:.3f} "
          f"({o['in_request_overhead_ms_median']:.1f} ms)", flush=True)
    if a.overhead_only:
        write_json(a.json, out)
        return 0
    for parallel in map(int, a.parallel.split(",")):
        server = Server(parallel, a.server_args)
        try:
            asyncio.run(run_level(server.url, parallel, 2 * parallel, a.max_tokens))  # warm-up: every slot
            before = rss_mib(server.proc.pid)
            levels = []
            for c in map(int, a.concurrency.split(",")):
                level = asyncio.run(run_level(server.url, c, a.requests, a.max_tokens))
                levels.append(level)
                print(f"parallel {parallel} concurrency {c}: {level['tokens_per_s']:.1f} tok/s, TTFT p50/p95 "
                      f"{level['ttft_p50_ms']:.0f}/{level['ttft_p95_ms']:.0f} ms, latency p50/p95 "
                      f"{level['latency_p50_ms']:.0f}/{level['latency_p95_ms']:.0f} ms, errors {level['errors']}",
                      flush=True)
            after = rss_mib(server.proc.pid)
        finally:
            rc = server.stop()
        out["runs"].append({"parallel": parallel, "rss_before_mib": before, "rss_after_mib": after, "exit_status": rc,
                            "levels": levels})
        print(f"parallel {parallel}: RSS {before:.1f} -> {after:.1f} MiB, exit status {rc}", flush=True)
    out["load_after"] = os.getloadavg()
    print("\n| parallel | concurrency | tok/s | TTFT p50 | TTFT p95 | latency p50 | latency p95 | errors |")
    print("|---|---|---|---|---|---|---|---|")
    for run in out["runs"]:
        for lv in run["levels"]:
            print(f"| {run['parallel']} | {lv['concurrency']} | {lv['tokens_per_s']:.1f} | {lv['ttft_p50_ms']:.0f} ms | "
                  f"{lv['ttft_p95_ms']:.0f} ms | {lv['latency_p50_ms']:.0f} ms | {lv['latency_p95_ms']:.0f} ms | {lv['errors']} |")
    write_json(a.json, out)
    return 0 if all(lv["errors"] == 0 for run in out["runs"] for lv in run["levels"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
