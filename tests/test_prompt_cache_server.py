"""dflash-serve --cache-ram / --cache-dir (issue 23): a real server restarted between two requests with the same
prefix answers the second from its disk cache, with the same reply; hits show in timings, dflash and /metrics;
a bad size is one line and exit 2."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import httpx
import pytest

from dflash_gguf.server.cli import main

SERVE = [sys.executable, "-m", "dflash_gguf.server.cli"]
SYSTEM = ("You are a coding agent with tools read_file(path), write_file(path, text) and run(cmd). "
          "Think step by step and answer briefly.\n\n" + "def mul(a, b):\n    return a * b\n\n" * 20)


@pytest.mark.parametrize("argv, fragment", [
    (["--cache-ram", "2 GiBs"], "argument --cache-ram: not a size: '2 GiBs'"),
    (["--cache-ram", "-1"], "argument --cache-ram: not a size"),
    (["--cache-disk", "lots"], "argument --cache-disk: not a size"),
    (["--cache-dir", "/etc/hostname"], "argument --cache-dir: /etc/hostname exists and is not a directory"),
    (["--cache-type-k", "q3"], "argument --cache-type-k: must be one of f32, f16, bf16, q8_0"),
])
def test_bad_cache_arguments_are_one_line_and_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A dflash-serve process on a free port, up once /health answers."""

    def __init__(self, *flags: str) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(SERVE + ["--port", str(self.port), "--log-level", "warning", "--n-ctx", "2048",
                                              *flags], stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "DFLASH_API_KEY": ""})
        deadline = time.monotonic() + 120
        while True:
            assert self.proc.poll() is None, f"the server exited: {self.proc.stderr.read()}"
            assert time.monotonic() < deadline, "the server did not come up"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                time.sleep(0.2)

    def chat(self, question: str) -> dict:
        body = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                "max_tokens": 16, "temperature": 0}
        r = httpx.post(self.url + "/v1/chat/completions", json=body, timeout=300)
        assert r.status_code == 200, r.text
        return r.json()

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(60) == 0
        return self.proc.stderr.read()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.slow  # two dflash-serve processes on the embedded pair
def test_a_restarted_server_answers_the_same_prefix_from_disk(tmp_path):
    cache = ["--cache-ram", "512MiB", "--cache-dir", str(tmp_path), "--cache-disk", "1GiB"]
    first = Server(*cache)
    try:
        cold = first.chat("What does mul do?")
        assert cold["dflash"]["prompt_cache"]["tier"] is None and cold["dflash"]["prompt_cache"]["stored"]
        assert cold["timings"]["cache_n"] == 0
        again = first.chat("What does mul do?")  # the same server: its live context (or the RAM tier) serves it
        assert again["choices"][0]["message"] == cold["choices"][0]["message"]
        assert 'dflash_prompt_cache_stores_total 2' in first.metrics()
        err = first.stop()
        assert "Traceback" not in err
    finally:
        first.kill()
    assert list(tmp_path.glob("*.dfpc"))
    second = Server(*cache)
    try:
        warm = second.chat("What does mul do?")
        n_prompt = warm["usage"]["prompt_tokens"]
        assert warm["choices"][0]["message"] == cold["choices"][0]["message"]
        assert warm["dflash"]["prompt_cache"]["tier"] == "disk"
        assert warm["dflash"]["prompt_cache"]["n_restored"] == n_prompt - 1
        assert warm["timings"]["cache_n"] == n_prompt - 1 and warm["timings"]["prompt_n"] == 1
        other = second.chat("And what does add do?")  # the shared system prefix is restored, the question prefilled
        assert 0 < other["timings"]["cache_n"] < other["usage"]["prompt_tokens"] - 1
        text = second.metrics()
        assert 'dflash_prompt_cache_lookups_total{result="disk"} 1' in text
        assert 'dflash_prompt_cache_restored_tokens_total' in text and 'dflash_prompt_cache_bytes{tier="disk"}' in text
        second.stop()
    finally:
        second.kill()
