"""dflash-serve --cache-ram / --cache-dir (issue 23): a real server restarted between two requests with the same
prefix answers the second from its disk cache, with the same reply; hits show in timings, dflash and /metrics;
a server killed while it writes an entry leaves a temp file the next start ignores and removes; a corrupt or
foreign file is a miss with a warning and the reply is still right; a bad size is one line and exit 2."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

from dflash_gguf.prompt_cache import MAGIC, SUFFIX, TEMP_MARK
from dflash_gguf.server.cli import main

SERVE = [sys.executable, "-m", "dflash_gguf.server.cli"]
SYSTEM = ("You are a coding agent with tools read_file(path), write_file(path, text) and run(cmd). "
          "Think step by step and answer briefly.\n\n" + "def mul(a, b):\n    return a * b\n\n" * 20)


def after_header(entry: bytes) -> bytes:
    """An entry file's bytes after its magic, header length and JSON header: the saved state itself."""
    return entry[8 + int.from_bytes(entry[4:8], "little"):]


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


@pytest.mark.slow  # three dflash-serve processes on the embedded pair
def test_a_server_killed_mid_write_leaves_nothing_the_next_start_trusts(tmp_path):
    """A real SIGKILL at a known point of a real write. An entry's file name depends only on the decoding
    context and the tokens, so a first server, answering the request into another directory, tells its name;
    a FIFO made at the temp name the second server will write (name + TEMP_MARK + its pid) holds that write
    open: the test reads the entry's first bytes through it, so the server is blocked in the middle of its
    write, and kills it there. The reply has come back by then: the cache's writer thread writes after it. The third start must ignore and remove what the killed writer left, and must
    also meet a corrupt copy of the entry and a foreign file: each a miss with a warning, never a crash, and
    the reply is the one the first server gave."""
    reference, directory = tmp_path / "reference", tmp_path / "cache"
    first = Server("--cache-dir", str(reference))
    try:
        expected = first.chat("What does mul do?")
        first.stop()
    finally:
        first.kill()
    (entry,) = reference.glob(f"*{SUFFIX}")
    good = entry.read_bytes()
    assert len(good) > 1 << 20  # far more than a pipe holds: the writer cannot finish while the test only reads

    directory.mkdir()
    writer = Server("--cache-dir", str(directory))
    try:
        fifo = directory / f"{entry.name}{TEMP_MARK}{writer.proc.pid}"
        os.mkfifo(fifo)
        answered: list[dict] = []
        replied = threading.Event()

        def request() -> None:
            try:
                answered.append(writer.chat("What does mul do?"))
            finally:
                replied.set()
                # stop the server: its exit waits for the queued write (the test kills it blocked in there);
                # one that never writes through the FIFO just exits, and then the read below must end
                writer.proc.terminate()
                writer.proc.wait()
                with contextlib.suppress(OSError):  # no reader left: the test has read and killed already
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

        client = threading.Thread(target=request)
        client.start()
        with open(fifo, "rb") as f:  # returns once the server has opened its temp file for writing
            head = f.read(64 << 10)
            assert head[:4] == MAGIC, "the server did not write its entry through the temp name"
            replied.wait()  # the reply comes while the write is held open: it does not wait for the write
            writer.proc.kill()  # blocked in write(): the rest of the entry never arrives
            writer.proc.wait()
        client.join()
        assert answered and fifo.exists()  # the reply came before the write; the killed writer left the FIFO
    finally:
        writer.kill()
    assert [p.name for p in directory.iterdir()] == [fifo.name]

    corrupt = bytearray(good)
    corrupt[-64:] = bytes(b ^ 0xFF for b in corrupt[-64:])  # same size, so only the checksum can tell
    (directory / entry.name).write_bytes(bytes(corrupt))
    foreign = directory / f"{entry.name[:16]}-{'0' * 24}{SUFFIX}"  # a name of this context, another program's bytes
    foreign.write_bytes(b"GGUF" + bytes(range(256)) * 64)
    third = Server("--cache-dir", str(directory), "--cache-ram", "0")
    try:
        assert not fifo.exists()  # removed at startup: its writer is gone
        reply = third.chat("What does mul do?")
        assert reply["choices"][0]["message"] == expected["choices"][0]["message"]
        assert reply["dflash"]["prompt_cache"]["tier"] is None and reply["timings"]["cache_n"] == 0
        assert reply["dflash"]["prompt_cache"]["stored"]
        assert 'dflash_prompt_cache_lookups_total{result="miss"} 1' in third.metrics()
        err = third.stop()
    finally:
        third.kill()
    assert f"ignoring {directory / entry.name}: checksum mismatch" in err, err
    assert f"ignoring {foreign}: not a dflash prompt-cache file" in err, err
    assert "Traceback" not in err
    # the entry the third server wrote replaced the corrupt one (the same state bytes as the first server's;
    # only the header's creation time differs), and no temp file is left
    assert sorted(p.name for p in directory.iterdir()) == sorted([entry.name, foreign.name])
    rewritten = (directory / entry.name).read_bytes()
    assert after_header(rewritten) == after_header(good)  # the header's JSON holds the time: its length varies
