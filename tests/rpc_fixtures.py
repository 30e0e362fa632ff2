"""rpc-server processes on this machine's loopback, for the RPC tests and scripts/measure_rpc.py."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from dflash_gguf import rpc


def server_binary() -> Path | None:
    """ggml's rpc-server as scripts/build_rpc.sh builds it (next to the RPC venv's python), or
    $DFLASH_RPC_SERVER; None when neither is there."""
    path = Path(os.environ.get("DFLASH_RPC_SERVER", Path(sys.executable).parent / "ggml-rpc-server"))
    return path if path.is_file() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def rpc_servers(n: int, log_dir: Path, *, threads: int = 1,
                env: dict[str, str] | None = None) -> Iterator[dict[str, subprocess.Popen]]:
    """n rpc-server processes on free loopback ports (`threads` CPU threads each), by endpoint, ready when
    the probe answers; killed at the end. Each one's output goes to log_dir/rpc-server-PORT.log."""
    binary = server_binary()
    assert binary is not None, "no rpc-server: run scripts/build_rpc.sh"
    procs: dict[str, subprocess.Popen] = {}
    try:
        for _ in range(n):
            port = free_port()
            with open(log_dir / f"rpc-server-{port}.log", "w") as log:
                procs[f"127.0.0.1:{port}"] = subprocess.Popen(
                    [str(binary), "-H", "127.0.0.1", "-p", str(port), "-t", str(threads)],
                    stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        for endpoint, proc in procs.items():
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, f"rpc-server {endpoint} exited with {proc.returncode}"
                try:
                    rpc.probe(endpoint, timeout=5)
                    break
                except rpc.RpcError:
                    assert time.monotonic() < deadline, f"rpc-server {endpoint} did not come up"
                    time.sleep(0.1)
        yield procs
    finally:
        for proc in procs.values():
            proc.kill()
            proc.wait()
