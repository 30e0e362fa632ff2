"""The dflash-serve command: one-line usage errors, a taken port, the loopback warning, SIGTERM with a stream open."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from dflash_gguf.server.cli import bind, is_loopback, main

SERVE = [sys.executable, "-m", "dflash_gguf.server.cli"]


@pytest.mark.parametrize("argv, fragment", [
    (["--parallel", "0"], "--parallel must be >= 1"),
    (["--queue", "-1"], "--queue must be >= 0"),
    (["--port", "70000"], "--port must be 0..65535"),
    (["--drafter", "d.gguf"], "--drafter needs --target"),
    (["--target", "/nonexistent.gguf"], "no such file"),
    (["--api-key", ""], "--api-key must not be empty"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err


def test_a_taken_port_is_one_line(capsys):
    with bind("127.0.0.1", 0) as taken:
        assert main(["--port", str(taken.getsockname()[1])]) == 2
    err = capsys.readouterr().err
    assert "cannot listen on 127.0.0.1" in err and err.count("\n") == 1


def test_loopback_detection():
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost") and is_loopback("127.1.2.3")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.168.1.2")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_with_a_stream_open_ends_cleanly():
    port = _free_port()
    proc = subprocess.Popen(SERVE + ["--port", str(port), "--host", "0.0.0.0", "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "DFLASH_API_KEY": ""})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 2000,
                "temperature": 0.7, "stream": True}
        lines = []
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                if len(lines) == 4:
                    proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        assert [line for line in lines if line][-1] == "data: [DONE]"  # the stream was closed by the server, not cut
        assert any('"code": "cancelled"' in line for line in lines)
        err = proc.stderr.read()
        assert "warning: binding 0.0.0.0 without --api-key" in err and "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
