"""Many requests at once (issue 37): aggregate throughput of dflash-serve at concurrency 1, 2, 4, 8.

Servers, each started as a subprocess on a free loopback port with --parallel P, measured one after the other:
  per-slot   the server as it was before batching across slots (--baseline REV, run from a git worktree of that
             commit, so no old code path stays in the tree): one context per slot, plain (--block-size 1)
  plain      this tree, --batch-slots: the slots are sequences of one context, --no-speculative
  plain@REV  the same server at an earlier commit (--before REV), measured beside this tree's
  dflash     this tree, --batch-slots, speculative (the cost model prices each block by its share of the batch)
  upstream   llama-server -np P built from the vendored llama.cpp (--llama-server PATH), plain, if given
  upstream-dflash  the same with the same drafter (-md, --spec-type draft-dflash, --spec-draft-n-max 15)
The servers run side by side (all started, then measured in turn), so that a machine whose load drifts
weighs on every one alike: for each round and each concurrency C, each server in turn (the order reversed
every other round) gets C requests
(distinct prompts, greedy, --max-tokens each) started together; tok/s is all completion tokens over the wall
time at that concurrency, summed over the --rounds rounds. "8 at once / one at a time" divides the tok/s at
the highest concurrency by the tok/s of the same requests sent one at a time (concurrency 1) to the same
server. Every reply is compared with that server's reply to the same prompt at concurrency 1 (greedy):
mismatches are counted, never hidden. Where the server's slots share one context its /metrics say how long
its decodes took: "in decode" is that share of the wall time, the rest being the server's own time (HTTP,
the Python between decodes) and the machine's other work; "batches" are its decodes, so that batches split
by a slot left out of a cycle show. The load average is sampled before each level.

    python scripts/bench_batching.py --baseline 2d83559 --parallel 8 --json batching.json
"""

from __future__ import annotations

import argparse
import asyncio
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from load_test_server import PROMPTS, commit, free_port, rss_mib, write_json  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


class Server:
    """A server process on a free port, stopped by stop()."""

    def __init__(self, cmd: list[str], *, cwd: Path = ROOT, env: dict[str, str] | None = None,
                 health: str = "/health") -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([*cmd, "--port", str(self.port)], cwd=cwd, env=env, stderr=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise SystemExit(f"bench_batching: error: the server did not start ({' '.join(cmd)})")
            try:
                if httpx.get(self.url + health, timeout=2).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()


async def one(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> tuple[str, int]:
    body = {"model": "m", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "temperature": 0, "seed": 0}
    r = await client.post("/v1/chat/completions", json=body)
    r.raise_for_status()
    data = r.json()
    return data["choices"][0]["message"]["content"], data["usage"]["completion_tokens"]


async def level(url: str, concurrency: int, rounds: int, max_tokens: int, first_round: int = 0) -> dict:
    """`rounds` rounds of `concurrency` requests started together; the replies by prompt."""
    replies: dict[str, str] = {}
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=1800) as client:
        t0 = time.perf_counter()
        for r in range(first_round, first_round + rounds):
            prompts = [PROMPTS[(r * concurrency + i) % len(PROMPTS)] for i in range(concurrency)]
            done = await asyncio.gather(*(one(client, p, max_tokens) for p in prompts))
            for p, (text, n) in zip(prompts, done):
                replies.setdefault(p, text)
                tokens += n
        wall = time.perf_counter() - t0
    return {"concurrency": concurrency, "requests": rounds * concurrency, "tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "replies": replies}


def decode_figures(url: str) -> tuple[float, int] | None:
    """(seconds in llama_decode, decodes) of the server's shared context so far; None where it has none."""
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    s = re.search(r"^dflash_batch_seconds_total (\S+)$", text, re.M)
    n = re.search(r"^dflash_batches_total (\S+)$", text, re.M)
    return None if s is None or n is None else (float(s.group(1)), int(float(n.group(1))))


def side_by_side(servers: dict[str, Server], a: argparse.Namespace) -> list[dict]:
    """Every server warmed up, then each concurrency's rounds given to each server in turn."""
    rss = {}
    for name, server in servers.items():
        asyncio.run(level(server.url, a.parallel, 1, 4))  # warm-up: every slot, calibration
        rss[name] = rss_mib(server.proc.pid)
    levels: dict[str, list[dict]] = {name: [] for name in servers}
    loads = []
    for c in a.concurrency:
        loads.append(os.getloadavg()[0])
        totals = {name: {"concurrency": c, "requests": 0, "tokens": 0, "wall_s": 0.0, "decode_s": 0.0,
                         "batches": 0, "replies": {}} for name in servers}
        for r in range(a.rounds):
            order = list(servers.items())
            for name, server in order if r % 2 == 0 else order[::-1]:  # no server always goes first
                before = decode_figures(server.url)
                lv = asyncio.run(level(server.url, c, 1, a.max_tokens, first_round=r))
                after = decode_figures(server.url)
                t = totals[name]
                for k in ("requests", "tokens", "wall_s"):
                    t[k] += lv[k]
                for p, text in lv["replies"].items():
                    t["replies"].setdefault(p, text)
                if before is not None and after is not None:
                    t["decode_s"] += after[0] - before[0]
                    t["batches"] += after[1] - before[1]
                else:
                    t["decode_s"] = t["batches"] = None
        for name, t in totals.items():
            t["tokens_per_s"] = t["tokens"] / t["wall_s"]
            levels[name].append(t)
    out = []
    for name, lvs in levels.items():
        alone = {}
        for lv in lvs:  # concurrency 1 first: the replies each prompt gets by itself
            for p, text in lv["replies"].items():
                alone.setdefault(p, text)
        for lv in lvs:
            lv["mismatches"] = sum(text != alone[p] for p, text in lv.pop("replies").items())
            share = "" if lv["decode_s"] is None else (
                f", {100 * lv['decode_s'] / lv['wall_s']:.0f}% in decode, {lv['batches']} batches")
            print(f"{name:9} c={lv['concurrency']}: {lv['tokens_per_s']:6.1f} tok/s  ({lv['tokens']} tokens in "
                  f"{lv['wall_s']:.1f} s{share}, replies differing from c=1: {lv['mismatches']})", flush=True)
        out.append({"server": name, "rss_mib": rss[name], "levels": lvs,
                    "at_once_over_one_at_a_time": lvs[-1]["tokens_per_s"] / lvs[0]["tokens_per_s"]})
    print("load average (1 min) before each level: " + ", ".join(f"c={c} {x:.1f}" for c, x in zip(a.concurrency, loads)))
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parallel", type=int, default=8)
    p.add_argument("--concurrency", default="1,2,4,8")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--threads", type=int, help="CPU threads (every server; default: each one's own choice)")
    p.add_argument("--baseline", help="the commit before batching across slots (its per-slot server is measured)")
    p.add_argument("--before", help="an earlier commit whose batched plain server is measured beside this tree's")
    p.add_argument("--llama-server", type=Path, help="upstream llama-server binary (-np P, plain), if measured")
    p.add_argument("--only", default="per-slot,plain,dflash,upstream,upstream-dflash",
                   help="which servers, comma-separated")
    p.add_argument("--json", type=Path)
    a = p.parse_args()
    a.concurrency = [int(c) for c in a.concurrency.split(",")]
    if a.concurrency[0] != 1:
        p.error("--concurrency must start with 1: the other levels are compared with it")
    if max(a.concurrency) > a.parallel:
        p.error("--concurrency above --parallel would measure the queue, not the slots")
    if a.llama_server is not None and not a.llama_server.is_file():
        p.error(f"--llama-server {a.llama_server}: no such file")
    only = set(a.only.split(","))
    threads = ["--threads", str(a.threads)] if a.threads else []
    ours = [sys.executable, "-m", "dflash_gguf.server.cli", "--parallel", str(a.parallel), "--queue", "64",
            "--n-ctx", "1024", "--log-level", "warning", *threads]
    out = {"commit": commit(), "baseline": a.baseline, "before": a.before, "parallel": a.parallel, "max_tokens": a.max_tokens,
           "rounds": a.rounds, "cpu_count": os.cpu_count(), "load_before": os.getloadavg(), "servers": []}
    servers: dict[str, Server] = {}
    trees: list[Path] = []

    def at(rev: str, option: str) -> tuple[Path, dict[str, str]]:
        """A git worktree of `rev`, and the environment that runs the server from it."""
        tree = Path(tmp) / f"tree{len(trees)}"
        made = subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT,
                              capture_output=True, text=True)
        if made.returncode != 0:
            p.error(f"{option} {rev}: {made.stderr.strip().splitlines()[-1] if made.stderr else 'git failed'}")
        trees.append(tree)
        return tree, {**os.environ, "PYTHONPATH": str(tree)}

    with tempfile.TemporaryDirectory() as tmp:
        try:
            if a.baseline and "per-slot" in only:
                tree, env = at(a.baseline, "--baseline")
                servers["per-slot"] = Server([*ours, "--block-size", "1"], cwd=tree, env=env)
            if a.before:
                tree, env = at(a.before, "--before")
                servers[f"plain@{a.before}"] = Server([*ours, "--batch-slots", "--no-speculative"], cwd=tree, env=env)
            if "plain" in only:
                servers["plain"] = Server([*ours, "--batch-slots", "--no-speculative"])
            if "dflash" in only:
                servers["dflash"] = Server([*ours, "--batch-slots"])
            if a.llama_server and "upstream" in only:
                from dflash_gguf import defaults

                cmd = [str(a.llama_server), "-m", str(defaults.embedded_target()), "-np", str(a.parallel),
                       "-c", str(1024 * a.parallel), "-fa", "on", "--host", "127.0.0.1",
                       *(["-t", str(a.threads)] if a.threads else [])]
                servers["upstream"] = Server(cmd)
                if "upstream-dflash" in only:  # the same drafter, upstream's draft-dflash with its blocks as ours
                    draft = [*cmd, "-md", str(defaults.embedded_drafter()), "--spec-type", "draft-dflash",
                             "--spec-draft-n-max", "15"]
                    servers["upstream-dflash"] = Server(draft)
            out["servers"] = side_by_side(servers, a)
        finally:
            for server in servers.values():
                server.stop()
            for tree in trees:
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, capture_output=True)
    out["load_after"] = os.getloadavg()
    print(f"\n| server | {' | '.join(f'c={c} tok/s' for c in a.concurrency)} | at once / one at a time | "
          "in decode, by c | replies differing | RSS MiB |")
    print("|---|" + "---|" * (len(a.concurrency) + 4))
    for s in out["servers"]:
        cells = " | ".join(f"{lv['tokens_per_s']:.1f}" for lv in s["levels"])
        share = "-" if s["levels"][0]["decode_s"] is None else " / ".join(
            f"{100 * lv['decode_s'] / lv['wall_s']:.0f}%" for lv in s["levels"])
        print(f"| {s['server']} | {cells} | {s['at_once_over_one_at_a_time']:.2f}x | {share} | "
              f"{sum(lv['mismatches'] for lv in s['levels'])} | {s['rss_mib']:.0f} |")
    write_json(a.json, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
