"""llama.cpp's RPC backend: RPC server addresses checked before C sees them, servers probed with timeouts, and
a target split over two loopback rpc-servers decoding exactly as a local one.

The first tests need no RPC build. The rest (marked slow) need the libllama and rpc-server that
scripts/build_rpc.sh builds, and are skipped with that reason elsewhere:
    scripts/build_rpc.sh pytest -n 0 tests/test_rpc.py
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest
from chi_square import chi_square_p_value
from rpc_fixtures import free_port, rpc_servers, server_binary

from dflash_gguf import SamplingParams, Session, SessionOptions, SettingError, Target
from dflash_gguf import rpc
from dflash_gguf.sampling import probabilities

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Write a haiku about the sea."]
ALPHA = 1e-3
BLOCK = 4  # a fixed block: every cycle verifies drafts over the network (adaptive blocks mostly decode plainly here)


# -- addresses and probes: no RPC build needed -------------------------------------------------------------
def test_servers_are_host_port_strings_or_a_comma_separated_list():
    assert rpc.check_endpoints("localhost:50052, 10.0.0.2:50053") == ("localhost:50052", "10.0.0.2:50053")
    assert rpc.check_endpoints(["10.0.0.2:50052"]) == ("10.0.0.2:50052",)
    assert rpc.check_endpoints("") == () and rpc.check_endpoints(()) == ()
    options = SessionOptions(rpc_servers="10.0.0.2:50052", n_gpu_layers=-1)
    assert options.rpc_servers == ("10.0.0.2:50052",)


@pytest.mark.parametrize("value, fragment", [
    ("localhost", "host:port"),
    (":50052", "host:port"),
    ("localhost:", "host:port"),
    ("localhost:0", "from 1 to 65535"),
    ("localhost:65536", "from 1 to 65535"),
    ("localhost:50x", "from 1 to 65535"),
    ("[::1]:50052", "IPv4 only"),
    ("fe80::1:50052", "IPv4 only"),
    ("my host:50052", "blank space"),
    ("a:1,a:1", "given twice"),
    (50052, "must be"),
    (["a:1", 7], "'host:port' string"),
])
def test_a_bad_server_address_is_a_setting_error_naming_the_field(value, fragment):
    with pytest.raises(SettingError, match=fragment) as e:
        SessionOptions(rpc_servers=value, n_gpu_layers=-1)
    assert e.value.field == "rpc_servers"


def test_rpc_servers_with_no_offloaded_layer_are_refused():
    with pytest.raises(SettingError, match="no layer reaches the RPC servers"):
        SessionOptions(rpc_servers="10.0.0.2:50052")


@pytest.mark.parametrize("prog, main", [
    ("dflash-generate", "dflash_gguf.cli"), ("dflash-serve", "dflash_gguf.server.cli"),
    ("dflash-bench", "dflash_gguf.bench.cli"), ("dflash-chat", "dflash_gguf.tui.cli"),
])
def test_every_command_takes_rpc_and_a_bad_address_is_one_line(prog, main, capsys):
    import importlib

    module = importlib.import_module(main)
    with pytest.raises(SystemExit) as e:
        module.main(["--rpc", "localhost", "--n-gpu-layers", "-1"] + (["hi"] if prog == "dflash-generate" else []))
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --rpc: an RPC server is host:port" in err and err.count("\n") == 1, err


def test_a_port_nobody_listens_on_is_an_rpc_error():
    with pytest.raises(rpc.RpcError, match="cannot connect .* is rpc-server running there"):
        rpc.probe(f"127.0.0.1:{free_port()}")


def test_an_unresolvable_host_is_an_rpc_error():
    with pytest.raises(rpc.RpcError, match="cannot resolve no-such-host.invalid"):
        rpc.probe("no-such-host.invalid:50052")


def test_a_listener_that_never_answers_the_handshake_times_out():
    """What a busy rpc-server (serving another process) looks like: the connection is accepted by the kernel,
    the handshake never answered. libllama's client would wait forever; the probe gives up."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        with pytest.raises(rpc.RpcError, match="did not answer the RPC handshake within 0.3 s"):
            rpc.probe(f"127.0.0.1:{port}", timeout=0.3)


def test_a_listener_that_is_not_an_rpc_server_is_an_rpc_error():
    """An HTTP server, say: it reads the handshake as garbage and closes the connection."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)

        def close_after_reading() -> None:
            conn, _ = listener.accept()
            with conn:
                conn.recv(64)
                conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        thread = threading.Thread(target=close_after_reading)
        thread.start()
        try:
            with pytest.raises(rpc.RpcError, match="is this port an rpc-server"):
                rpc.probe(f"127.0.0.1:{listener.getsockname()[1]}")
        finally:
            thread.join()


@pytest.mark.skipif(rpc.supported(), reason="this libllama has the RPC backend")
def test_without_an_rpc_build_a_session_asking_for_servers_says_how_to_build_one():
    with pytest.raises(rpc.RpcUnavailableError, match="scripts/build_rpc.sh"):
        Session(rpc_servers=["127.0.0.1:50052"], n_gpu_layers=-1, n_ctx=256)


# -- two loopback rpc-servers: the RPC build ------------------------------------------------------------
needs_rpc = pytest.mark.skipif(
    not rpc.supported() or server_binary() is None,
    reason="needs the RPC build and its rpc-server: scripts/build_rpc.sh pytest tests/test_rpc.py")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with rpc_servers(2, tmp_path_factory.mktemp("rpc")) as procs:
        yield list(procs)


@pytest.fixture(scope="module")
def local():
    with Session(n_ctx=512, n_threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def remote(servers):
    """Every target layer on the two servers (split between them by their free memory), the drafter local."""
    with Session(n_ctx=512, n_threads=1, rpc_servers=servers, n_gpu_layers=-1) as s:
        yield s


@needs_rpc
@pytest.mark.slow
def test_the_target_is_split_over_the_two_servers_and_the_drafter_stays_local(remote, servers):
    placement = remote.placement
    assert [d.description for d in placement.gpus] == servers
    assert all(d.backend == "RPC" for d in placement.gpus) and not placement.on_cpu
    assert remote.drafter_placement.device == "CPU"


@needs_rpc
@pytest.mark.slow
def test_the_connections_to_the_servers_are_kept_alive(remote, servers):
    """A server machine that vanishes without a reset ends the connection after the keepalive probes,
    instead of leaving ggml's client in recv() for ever."""
    for endpoint in servers:
        socks = rpc.connections(endpoint)
        try:
            assert socks, f"no connection to {endpoint}"
            for sock in socks:
                assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == rpc.KEEPALIVE_IDLE_S
                assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) == rpc.USER_TIMEOUT_MS
        finally:
            for sock in socks:
                sock.close()


@needs_rpc
@pytest.mark.slow
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_output_over_rpc_is_the_local_output(local, remote, prompt):
    messages = [{"role": "user", "content": prompt}]
    ours = remote.chat(messages, max_tokens=48, temperature=0, block_size=BLOCK)
    assert ours.tokens == local.chat(messages, max_tokens=48, temperature=0, block_size=BLOCK).tokens
    assert ours.tokens == local.chat(messages, max_tokens=48, temperature=0, speculative=False).tokens
    stats = remote.last_stats
    assert stats.speculative and stats.cycles < len(ours.tokens)  # drafts were verified over the network


@needs_rpc
@pytest.mark.slow
def test_a_target_split_between_the_local_cpu_and_a_server_decodes_as_a_local_one(local, servers):
    """The first layers on this machine's CPU, the last 16 and the output on one server; features of both
    halves reach the drafter."""
    with Session(n_ctx=512, n_threads=1, rpc_servers=servers[:1], n_gpu_layers=16) as s:
        placement = s.placement
        assert placement.on_cpu and placement.n_offloaded == 16 and placement.gpus[0].description == servers[0]
        for prompt in PROMPTS[:2]:
            messages = [{"role": "user", "content": prompt}]
            ours = s.chat(messages, max_tokens=48, temperature=0, block_size=BLOCK)
            assert ours.tokens == local.chat(messages, max_tokens=48, temperature=0, block_size=BLOCK).tokens


@needs_rpc
@pytest.mark.slow
def test_two_token_samples_over_rpc_follow_the_target_distribution(remote, embedded_target):
    """block_size 2: the second token is always drafted locally and verified on the servers."""
    params = SamplingParams(temperature=1.0)
    pairs = [remote.generate(PROMPTS[0], max_tokens=2, temperature=1.0, seed=seed, block_size=2).tokens
             for seed in range(240)]
    with Target.open(embedded_target, n_ctx=256, n_batch=64, n_threads=1) as reference:
        prompt = reference.vocab.tokenize(PROMPTS[0])

        def probs(tokens: list[int]):
            reference.clear()
            reference.decode(tokens, 0)
            return probabilities(reference.logits(len(tokens) - 1)[None], params)[0]

        first = [p[0] for p in pairs]
        assert chi_square_p_value(first, probs(prompt)) > ALPHA
        mode = Counter(first).most_common(1)[0][0]
        second = [p[1] for p in pairs if p[0] == mode]
        assert chi_square_p_value(second, probs(prompt + [mode])) > ALPHA
        assert chi_square_p_value(second, probs(prompt)) < ALPHA  # the check can fail: the wrong row is rejected


@needs_rpc
@pytest.mark.slow
def test_a_second_session_on_servers_in_use_shares_the_connection(remote, servers, local):
    """rpc-server serves one client at a time: a server this process already uses is not probed again
    (it could not answer), and the new model is placed on it through the same connection."""
    with Session(n_ctx=256, n_threads=1, rpc_servers=servers, n_gpu_layers=-1) as s:
        ours = s.generate(PROMPTS[0], max_tokens=16, temperature=0)
    assert ours.tokens == local.generate(PROMPTS[0], max_tokens=16, temperature=0).tokens


@needs_rpc
@pytest.mark.slow
def test_bad_servers_with_the_rpc_build_are_errors_before_libllama_sees_them(monkeypatch):
    with pytest.raises(rpc.RpcError, match="cannot connect"):
        Session(n_ctx=256, rpc_servers=[f"127.0.0.1:{free_port()}"], n_gpu_layers=-1)
    monkeypatch.setattr(rpc, "PROBE_TIMEOUT_S", 0.3)
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        with pytest.raises(rpc.RpcError, match="did not answer the RPC handshake"):
            Session(n_ctx=256, rpc_servers=[f"127.0.0.1:{listener.getsockname()[1]}"], n_gpu_layers=-1)


# the grammar leaves no end of text within the context: the generation still runs when the server is killed
LONG = "root ::= [a-z ,.]{1500,}"
LOSE_A_SERVER = f"""
import sys
from dflash_gguf import Session
with Session(n_ctx=512, n_threads=1, rpc_servers=sys.argv[1:], n_gpu_layers=-1) as s:
    for step in s.stream_chat([{{"role": "user", "content": "Tell me a long story."}}], max_tokens=2000,
                              temperature=0.8, seed=1, grammar={LONG!r}):
        print("step", flush=True)
"""


@needs_rpc
@pytest.mark.slow
def test_a_server_killed_mid_generation_ends_the_process_with_one_line(tmp_path):
    """ggml's client aborts on a lost connection, from its own thread: no exception can reach the caller.
    The abort hook makes it one line naming the server and EXIT_RPC_LOST, never SIGABRT or a hang."""
    with rpc_servers(2, tmp_path) as servers:
        endpoints = list(servers)
        proc = subprocess.Popen([sys.executable, "-c", LOSE_A_SERVER, *endpoints], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)
        try:
            for _ in range(3):  # generating over both servers
                assert proc.stdout.readline() == "step\n", proc.stderr.read()
            victim = endpoints[1]
            servers[victim].kill()
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    err = proc.stderr.read()
    assert code == rpc.EXIT_RPC_LOST, err
    lines = [line for line in err.splitlines() if "dflash-gguf: error" in line]
    assert len(lines) == 1 and f"lost the RPC server {victim}:" in lines[0], err
    assert "Traceback" not in err


@needs_rpc
@pytest.mark.slow
def test_dflash_serve_with_rpc_answers_as_a_local_session(local, tmp_path):
    """dflash-serve --rpc in its own process (its own servers: each serves one client at a time)."""
    import httpx

    with rpc_servers(2, tmp_path) as servers:
        port = free_port()
        proc = subprocess.Popen([sys.executable, "-m", "dflash_gguf.server.cli", "--port", str(port), "--n-ctx", "512",
                                 "--threads", "1", "--n-gpu-layers", "-1", "--rpc", ",".join(servers),
                                 "--log-level", "warning"], stderr=subprocess.PIPE, text=True,
                                env={**os.environ, "DFLASH_API_KEY": ""})
        try:
            url = f"http://127.0.0.1:{port}"
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, proc.stderr.read()
                assert time.monotonic() < deadline, "dflash-serve did not come up"
                try:
                    health = httpx.get(url + "/health", timeout=1)
                    if health.status_code == 200:
                        break
                except httpx.TransportError:
                    time.sleep(0.2)
            assert "RPC" in health.json()["backend"], health.json()
            r = httpx.post(url + "/v1/completions", timeout=120,
                           json={"prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0}).json()
        finally:
            proc.terminate()
            proc.wait(30)
    assert r["choices"][0]["text"] == local.generate(PROMPTS[1], max_tokens=32, temperature=0).text


@needs_rpc
@pytest.mark.slow
def test_dflash_chat_with_rpc_replies_as_a_local_session_and_a_lost_server_is_a_failed_reply(local, tmp_path):
    """dflash-chat --rpc: its Session opens in the worker process with the servers and replies there; a server
    killed mid-reply ends that process, and the reply fails with the reason instead of hanging the UI."""
    from dflash_gguf.config import GenerationConfig
    from dflash_gguf.tui.cli import parse_options
    from dflash_gguf.tui.process_worker import ProcessWorker, SessionSpec

    messages = [{"role": "user", "content": PROMPTS[2]}]

    def reply(worker: ProcessWorker, config: GenerationConfig, steps: list, on_step=None):
        ended: list = []
        done = threading.Event()
        worker.reply(messages, config, steps, lambda message: (ended.append(message), done.set()))
        if on_step is not None:
            while not steps:
                assert not done.is_set(), ended
                time.sleep(0.05)
            on_step()
        assert done.wait(300), "the reply did not end"
        return ended[0]

    with rpc_servers(2, tmp_path) as servers:
        args, _ = parse_options(["--rpc", ",".join(servers), "--n-gpu-layers", "-1", "--n-ctx", "512",
                                 "--threads", "1"])
        assert args.session.rpc_servers == tuple(servers)
        worker = ProcessWorker(SessionSpec(options=args.session))
        try:
            steps: list = []
            end = reply(worker, GenerationConfig(max_tokens=32, temperature=0), steps)
            assert type(end).__name__ == "ReplyFinished", end
            theirs = local.chat(messages, max_tokens=32, temperature=0)
            assert [t for step in steps for t in step.tokens] == theirs.tokens
            victim = list(servers.values())[0]
            failed = reply(worker, GenerationConfig(max_tokens=2000, temperature=0.8, seed=1, grammar=LONG), [],
                           victim.kill)
        finally:
            worker.close()
    assert type(failed).__name__ == "ReplyFailed" and "lost an RPC server" in failed.error, failed
