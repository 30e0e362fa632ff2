"""What llama.cpp's RPC backend adds to a decode cycle: measured on loopback, with what crosses the wire.

Two rpc-servers on this machine's loopback (tests/rpc_fixtures.py; one CPU thread each, GGML_RPC_DEBUG on so
that their logs name every command), the embedded pair: one Session with every target layer on the two
servers and the drafter local, one Session all local, generating the same prompts greedily at a fixed block
size in interleaved pairs (the same cycles on both: the output is identical). Per pair it records each
Session's loop tok/s and verify ms per cycle; per remote generation the bytes sent to and received from the
servers (the kernel's TCP_INFO of ggml's connections) and the commands they served, of which those the
client waits on are round trips. The per-cycle bytes and commands are marginal: a
generation of --max-tokens minus one of a quarter of it, both after a reset, so the prompt's prefill cancels.

    scripts/build_rpc.sh                                    # the RPC build and rpc-server
    .venv-rpc/bin/python scripts/measure_rpc.py --pairs 5   # prints one JSON object
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import statistics
import struct
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea.",
           "List three uses of a paperclip."]


# struct tcp_info (linux/tcp.h): tcpi_bytes_acked and tcpi_bytes_received, u64 each, at byte 120
TCP_INFO_BYTES_AT = 120
# the commands whose caller waits for the server's answer (ggml-rpc.cpp: dispatcher->send with an output):
# each costs a round trip; set_tensor and graph_(re)compute are queued without one
WAITED = {"get_tensor", "copy_tensor", "set_tensor_hash", "alloc_buffer", "buffer_get_base", "get_alignment",
          "get_max_size", "get_alloc_size", "get_device_memory", "device_count", "hello"}


def tcp_bytes(endpoint: str) -> tuple[int, int]:
    """(sent, received) payload bytes of this process's connections to a server, as the kernel counts them."""
    from dflash_gguf import rpc

    sent = received = 0
    for sock in rpc.connections(endpoint):
        with sock:
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 160)
        acked, got = struct.unpack_from("<QQ", info, TCP_INFO_BYTES_AT)
        sent, received = sent + acked, received + got
    return sent, received


def commands(log: Path, start: int) -> tuple[Counter, int]:
    """The commands a server logged from byte `start` on (GGML_RPC_DEBUG: '[name] ...'), and the new end."""
    data = log.read_bytes()
    names = re.findall(rb"^\[(\w+)\]", data[start:], flags=re.M)
    return Counter(n.decode() for n in names), len(data)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=5, help="interleaved local/remote pairs per prompt (default: 5)")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="threads of the local Session and of each server")
    p.add_argument("--n-gpu-layers", type=int, default=-1,
                   help="target layers on the servers, the last ones (the output layer counted); -1: all")
    a = p.parse_args()

    from rpc_fixtures import rpc_servers

    from dflash_gguf import Session, backends, rpc

    if not rpc.supported():
        print(f"measure_rpc: {rpc.BUILD_HINT}", file=sys.stderr)
        return 2
    greedy = dict(temperature=0, block_size=a.block_size)
    with tempfile.TemporaryDirectory() as tmp, \
            rpc_servers(2, Path(tmp), threads=a.threads, env={"GGML_RPC_DEBUG": "1"}) as servers, \
            Session(n_ctx=512, n_threads=a.threads) as local, \
            Session(n_ctx=512, n_threads=a.threads, rpc_servers=list(servers),
                    n_gpu_layers=a.n_gpu_layers) as remote:
        logs = {e: Path(tmp) / f"rpc-server-{e.rsplit(':', 1)[1]}.log" for e in servers}
        offsets = {e: logs[e].stat().st_size for e in servers}

        def remote_run(prompt: str, max_tokens: int) -> tuple[object, dict[str, int], Counter]:
            """One generation after a reset, with the bytes and commands of both servers during it."""
            remote.reset()
            before = {e: tcp_bytes(e) for e in servers}
            for e in servers:
                _, offsets[e] = commands(logs[e], offsets[e])
            result = remote.generate(prompt, max_tokens=max_tokens, **greedy)
            moved = {"to_servers": 0, "from_servers": 0}
            served: Counter = Counter()
            for e in servers:
                sent, received = tcp_bytes(e)
                moved["to_servers"] += sent - before[e][0]
                moved["from_servers"] += received - before[e][1]
                counted, offsets[e] = commands(logs[e], offsets[e])
                served += counted
            return result, moved, served

        rows = []
        for prompt in PROMPTS:
            for _ in range(a.pairs):
                ours, moved, served = remote_run(prompt, a.max_tokens)
                stats_remote = remote.last_stats
                local.reset()
                theirs = local.generate(prompt, max_tokens=a.max_tokens, **greedy)
                stats_local = local.last_stats
                short, moved_short, served_short = remote_run(prompt, a.max_tokens // 4)
                cycles = stats_remote.cycles - remote.last_stats.cycles

                def per_cycle(long: Counter | dict, short: Counter | dict, keys) -> float:
                    return sum(long[k] - short[k] for k in keys) / cycles
                rows.append({
                    "prompt": prompt, "identical": ours.tokens == theirs.tokens, "cycles": stats_remote.cycles,
                    "tokens": len(ours.tokens),
                    "loop_tok_s": {"local": stats_local.loop_tokens_per_s, "rpc": stats_remote.loop_tokens_per_s},
                    "verify_ms_per_cycle": {"local": 1e3 * stats_local.verify_s / stats_local.cycles,
                                            "rpc": 1e3 * stats_remote.verify_s / stats_remote.cycles},
                    "marginal_cycles": cycles,
                    "bytes_per_cycle": {k: per_cycle(moved, moved_short, [k]) for k in moved} if cycles else None,
                    "commands_per_cycle": {k: per_cycle(served, served_short, [k]) for k in served} if cycles else None,
                    "round_trips_per_cycle": per_cycle(served, served_short, WAITED) if cycles else None,
                })
        placement = remote.placement.as_dict()

    def median(path: str, key: str) -> float:
        return statistics.median(r[path][key] for r in rows if r[path] is not None)

    verify = {k: median("verify_ms_per_cycle", k) for k in ("local", "rpc")}
    summary = {
        "command": " ".join(sys.argv),
        "build": {k: backends.build()[k] for k in ("llama_cpp_python", "backends")},
        "placement": placement,
        "n_gpu_layers": a.n_gpu_layers, "block_size": a.block_size, "max_tokens": a.max_tokens, "threads": a.threads,
        "pairs": len(rows),
        "identical": sum(r["identical"] for r in rows),
        "loop_tok_s_median": {k: median("loop_tok_s", k) for k in ("local", "rpc")},
        "verify_ms_per_cycle_median": verify,
        "added_ms_per_cycle_median": statistics.median(
            r["verify_ms_per_cycle"]["rpc"] - r["verify_ms_per_cycle"]["local"] for r in rows),
        "bytes_per_cycle_median": {k: median("bytes_per_cycle", k) for k in ("to_servers", "from_servers")},
        "round_trips_per_cycle_median": statistics.median(r["round_trips_per_cycle"] for r in rows
                                                          if r["round_trips_per_cycle"] is not None),
        "commands_per_cycle_median": {k: statistics.median(r["commands_per_cycle"].get(k, 0) for r in rows
                                                           if r["commands_per_cycle"])
                                      for k in sorted({k for r in rows if r["commands_per_cycle"]
                                                       for k in r["commands_per_cycle"]})},
        "rows": rows,
    }
    print(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
