"""The dflash-serve command: one-line usage errors, a taken port, the loopback warning, SIGTERM / SIGINT with a
stream open and a request queued, --lookup, --keepalive."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

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
    (["--n-ctx", "4"], "argument --n-ctx: must be an integer >= 8"),
    (["--threads", "0"], "argument --threads: must be None"),
    (["--block-size", "0"], "argument --block-size: must be None"),
    (["--bogus"], "unrecognized arguments"),
    (["--keepalive", "0"], "--keepalive must be a number of seconds > 0, got 0.0"),
    (["--keepalive", "-5"], "--keepalive must be a number of seconds > 0"),
    (["--keepalive", "nan"], "--keepalive must be a number of seconds > 0, got nan"),
    (["--keepalive", "inf"], "--keepalive must be a number of seconds > 0, got inf"),
    (["--keepalive", "soon"], "argument --keepalive: invalid float value: 'soon'"),
])
def test_bad_arguments_are_one_line_and_exit_2(argv, fragment, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert fragment in err and err.count("\n") == 1 and "Traceback" not in err


def test_keepalive_reaches_the_servers_settings():
    """--keepalive SECONDS is the app's keepalive_s (what every stream's heartbeat waits); 15 s without it."""
    from dflash_gguf.config import GenerationConfig
    from dflash_gguf.server.cli import _parser, server_config

    assert server_config(_parser().parse_args([]), GenerationConfig()).keepalive_s == 15.0
    assert server_config(_parser().parse_args(["--keepalive", "2.5"]), GenerationConfig()).keepalive_s == 2.5


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


def _wait_until_up(proc: subprocess.Popen, url: str, seconds: float) -> float:
    """Until the server's /health answers 200; fails if the process ends first or `seconds` pass. Returns
    that deadline."""
    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the server did not come up"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return deadline
        except httpx.TransportError:
            time.sleep(0.2)


COPY = (
    "Repeat this paragraph exactly.\n\nDr. No is the sixth novel by the English author Ian Fleming to feature his "
    "British Secret Service agent James Bond. Written at Fleming's Goldeneye estate in Jamaica, it was first "
    "published in the United Kingdom by Jonathan Cape in 1958."
)


@pytest.mark.slow  # dflash-serve in a fresh process, a stream and a queued request
@pytest.mark.parametrize("sig, flags", [
    (signal.SIGTERM, ["--host", "0.0.0.0"]),
    (signal.SIGINT, ["--lookup", "--block-size", "8"]),  # fixed: adaptive lookup drafts only where it pays here
], ids=["SIGTERM", "SIGINT-with-lookup"])
def test_a_signal_ends_streams_refuses_the_queue_and_exits_0(sig, flags):
    port = _free_port()
    proc = subprocess.Popen(SERVE + ["--port", str(port), "--log-level", "warning", *flags],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "DFLASH_API_KEY": ""})
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = _wait_until_up(proc, url, 60)
        if "--lookup" in flags:  # lookup drafts next to the drafter: a copied paragraph is drafted by lookup
            r = httpx.post(url + "/v1/chat/completions", timeout=120, json={
                "messages": [{"role": "user", "content": COPY}], "max_tokens": 48, "temperature": 0}).json()
            assert r["dflash"]["per_source"]["lookup"]["n_accepted"] > 0
            assert r["dflash"]["tokens_by_provenance"]["lookup"] > 0
        # the grammar leaves no end of text before 1500 characters: the stream still runs when the signal lands,
        # whatever the sampler draws (the server is another process, so no Event can hold it)
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 2000,
                "temperature": 0.7, "stream": True, "grammar": "root ::= [a-z ,.]{1500,}"}
        lines = []
        with ThreadPoolExecutor(1) as pool, httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
            for line in r.iter_lines():
                lines.append(line)
                # the role chunk, then a token: the stream runs (keep-alive comments during a slow prefill do
                # not count): queue a second request behind it, then the signal
                if sum(x.startswith("data: ") for x in lines) == 2 and line.startswith("data: "):
                    queued = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 4},
                                         timeout=60)
                    while httpx.get(url + "/health", timeout=5).json()["queue_depth"] != 1:
                        assert time.monotonic() < deadline + 60, "the second request was not queued"
                        time.sleep(0.05)
                    proc.send_signal(sig)
            refused = queued.result()
        assert proc.wait(30) == 0
        assert [line for line in lines if line][-1] == "data: [DONE]"  # the stream was closed by the server, not cut
        assert any('"code": "cancelled"' in line for line in lines)
        assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
        assert refused.json()["error"]["code"] == "shutting_down"
        err = proc.stderr.read()
        assert "Traceback" not in err
        if "0.0.0.0" in flags:
            assert "warning: binding 0.0.0.0 without --api-key" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.slow  # dflash-serve in a fresh process
def test_parallel_slots_are_sequences_of_one_context_and_answer_as_alone():
    """--parallel 2 --batch-slots: the start-up line says the slots decode in one batch, and two requests at once get, token
    for token, what each gets by itself (greedy; speculation priced by the batch, so mostly plain here)."""
    port = _free_port()
    proc = subprocess.Popen(SERVE + ["--port", str(port), "--parallel", "2", "--batch-slots", "--n-ctx", "512",
                                     "--log-level", "warning"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "DFLASH_API_KEY": ""})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_up(proc, url, 120)
        prompts = ["Name three primary colours.", "How many legs does a spider have?"]

        def ask(p):
            r = httpx.post(url + "/v1/chat/completions", timeout=300, json={
                "messages": [{"role": "user", "content": p}], "max_tokens": 24, "temperature": 0})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        alone = [ask(p) for p in prompts]
        with ThreadPoolExecutor(2) as pool:
            assert list(pool.map(ask, prompts)) == alone
        assert "dflash_batches_total" in httpx.get(url + "/metrics").text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
        err = proc.stderr.read()
        assert "2 slots decoding in one batch: sequences of one target context of 2 x 512 = 1024 cells" in err
        assert "Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_slots_share_a_context_unless_each_would_run_one_cpu_thread():
    """The default follows the measurement: contexts side by side win only where each runs ggml on one CPU thread
    (no barriers, the other cores used); on several threads, or offloaded, the slots share one context."""
    from dflash_gguf.config import SessionOptions
    from dflash_gguf.server.cli import _parser, batched

    def decide(*argv, gpu_layers=0, threads=None):
        return batched(_parser().parse_args(list(argv)), SessionOptions(n_gpu_layers=gpu_layers, n_threads=threads))

    assert decide("--parallel", "4", threads=2)
    assert not decide("--parallel", "4", threads=1)
    assert decide("--parallel", "4", gpu_layers=-1, threads=1)
    assert decide("--parallel", "4", "--batch-slots", threads=1)
    assert not decide("--parallel", "4", "--no-batch-slots", gpu_layers=-1, threads=4)
    assert not decide("--parallel", "1", "--batch-slots")  # one slot: nothing to share


@pytest.mark.slow  # dflash-serve in a fresh process, a long stream and a queued one
def test_a_queued_stream_gets_keep_alives_at_the_keepalive_flags_interval():
    """dflash-serve --keepalive 0.2: an Anthropic stream queued behind a long reply gets message_start and then
    `event: ping` every 0.2 s while it waits: three within a 10 s read timeout, which the default 15 s could not
    give."""
    port = _free_port()
    proc = subprocess.Popen(SERVE + ["--port", str(port), "--log-level", "warning", "--keepalive", "0.2"],
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "DFLASH_API_KEY": ""})
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_until_up(proc, url, 60)
        # the grammar leaves no end of text before 1500 characters: the slot stays busy while the second waits
        body = {"messages": [{"role": "user", "content": "Tell me a long story."}], "max_tokens": 2000,
                "temperature": 0.7, "stream": True, "grammar": "root ::= [a-z ,.]{1500,}"}
        queued = {"model": "m", "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "Hi"}]}
        with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as first:
            data = (line for line in first.iter_lines() if line.startswith("data: "))
            next(data), next(data)  # the role chunk, then a token: the slot is generating
            with httpx.stream("POST", url + "/v1/messages", json=queued, timeout=10) as r:
                events = (line for line in r.iter_lines() if line.startswith("event: "))
                seen = [next(events)]
                while seen.count("event: ping") < 3:
                    seen.append(next(events))
                depth = httpx.get(url + "/health", timeout=5).json()["queue_depth"]
        assert seen[0] == "event: message_start" and "event: content_block_delta" not in seen, seen
        assert depth == 1  # the pings came while it was queued
    finally:
        proc.kill()
        proc.wait()
