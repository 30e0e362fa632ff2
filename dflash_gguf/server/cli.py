"""`dflash-serve`: the OpenAI- and Anthropic-compatible server; with no arguments, the embedded pair on 127.0.0.1:8000.

Weights load once: slot 0 opens the models, every other slot is Session.fork() of it: the next sequence of
one shared target context (its decodes batched with the other slots'), its own drafter context and caches. Bad input is one line on stderr and exit status 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import math
import os
import socket
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Sequence

from ..cli_parser import DRAFTER_HELP, EXIT_BAD_INPUT, OneLineParser
from ..config import (KV_CACHE_SETTINGS, PROMPT_CACHE_SETTINGS, CacheOptions, GenerationConfig, SessionOptions,
                      add_arguments, from_arguments)
from .config import (DEFAULT_KEEPALIVE_S, DEFAULT_MAX_TOKENS, DEFAULT_MODEL_ALIAS, LOOPBACK_HOSTS, ServerConfig, default_cache_ram,
                     default_max_body, machine_memory)

if TYPE_CHECKING:
    from ..target import Target

PROG = "dflash-serve"
SESSION = ("n_ctx", "n_gpu_layers", "n_gpu_layers_draft", "n_threads", "lookup", "mtp", "recalibrate", *KV_CACHE_SETTINGS,
           "rpc_servers")
GENERATION = ("block_size", "speculative")


def _parser() -> argparse.ArgumentParser:
    p = OneLineParser(prog=PROG, description=__doc__.splitlines()[0])
    p.add_argument("--target", type=Path, help="target GGUF (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--drafter", type=Path, help=DRAFTER_HELP)
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", help="require this key (Bearer or x-api-key); default: $DFLASH_API_KEY if set")
    p.add_argument("--parallel", type=int, default=1, help="slots: generations that run at once (default 1)")
    p.add_argument("--batch-slots", action=argparse.BooleanOptionalAction, default=None,
                   help="the slots are sequences of one target context, their decodes batched (default: yes, "
                        "unless the target runs on the CPU on one thread, where a context per slot uses the other "
                        "cores: docs/SERVER.md)")
    p.add_argument("--queue", type=int, default=16, help="requests that may wait for a slot; more get 429 (default 16)")
    memory = machine_memory()
    # per slot; the context defaults to the model's trained context (agents' prompts are 7-30k tokens)
    add_arguments(p, SessionOptions, SESSION, n_ctx=None)
    add_arguments(p, GenerationConfig, GENERATION)  # server-wide; each request's own fields apply over them
    # one prompt cache, shared by every slot; its RAM tier sized from this machine's memory
    add_arguments(p, CacheOptions, PROMPT_CACHE_SETTINGS, cache_ram=default_cache_ram(memory))
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS,
                   help="a reply's length when the request names none; 0: up to the end of the context "
                        f"(default {DEFAULT_MAX_TOKENS}); a request's own is clamped to what the context has left")
    p.add_argument("--model-alias", default=DEFAULT_MODEL_ALIAS, help=f"the model id clients name (default {DEFAULT_MODEL_ALIAS!r})")
    p.add_argument("--accept-any-model", action=argparse.BooleanOptionalAction, default=True,
                   help="answer whatever `model` a client names (agents send their own; default: on, as llama-server "
                        "does with one model); --no-accept-any-model: any other name is a 404")
    p.add_argument("--max-body-bytes", type=int, default=default_max_body(memory),
                   help="request body limit (default: a thousandth of this machine's memory, 16-256 MiB: %(default)s)")
    p.add_argument("--keepalive", type=float, default=DEFAULT_KEEPALIVE_S, metavar="SECONDS",
                   help="seconds of silence after which a stream sends its keep-alive (Anthropic ping, an SSE comment, "
                        "Responses' in_progress): while queued, during a long prefill, while a tool call is held back "
                        f"(default {DEFAULT_KEEPALIVE_S:g})")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    return p


def _check_args(p: argparse.ArgumentParser, a: argparse.Namespace) -> tuple[SessionOptions, GenerationConfig, CacheOptions]:
    if a.drafter is not None and a.target is None:
        p.error("--drafter needs --target: the embedded drafter belongs to the embedded target")
    for flag, path in (("--target", a.target), ("--drafter", a.drafter)):
        if path is not None and not path.is_file():
            p.error(f"{flag} {path}: no such file")
    if not 0 <= a.port <= 65535:
        p.error(f"--port must be 0..65535, got {a.port}")
    if a.parallel < 1:
        p.error(f"--parallel must be >= 1, got {a.parallel}")
    if a.queue < 0:
        p.error(f"--queue must be >= 0, got {a.queue}")
    if a.max_body_bytes < 1024:
        p.error(f"--max-body-bytes must be >= 1024, got {a.max_body_bytes}")
    if not a.model_alias:
        p.error("--model-alias must not be empty")
    if a.api_key is not None and not a.api_key:
        p.error("--api-key must not be empty")
    if a.max_tokens < 0:
        p.error(f"--max-tokens must be >= 0, got {a.max_tokens}")
    if not (math.isfinite(a.keepalive) and a.keepalive > 0):
        p.error(f"--keepalive must be a number of seconds > 0, got {a.keepalive}")
    return (from_arguments(p, SessionOptions, a, SESSION), from_arguments(p, GenerationConfig, a, GENERATION),
            from_arguments(p, CacheOptions, a, PROMPT_CACHE_SETTINGS))


def server_config(a: argparse.Namespace, generation: GenerationConfig) -> ServerConfig:
    """The app's settings from the checked arguments."""
    return ServerConfig(model_alias=a.model_alias, api_key=a.api_key, max_queue=a.queue,
                        max_body_bytes=a.max_body_bytes, generation=generation, max_tokens=a.max_tokens or None,
                        accept_any_model=a.accept_any_model, keepalive_s=a.keepalive, created=int(time.time()))


def _said_at_start(a: argparse.Namespace, cache: CacheOptions, target: "Target") -> list[str]:
    """What the server chose for an agent out of the box, said once at start-up, and the one warning."""
    from ..batching import SequenceTarget  # libllama: loaded by then, but not for --help or a bad argument

    n_ctx, n_ctx_train = target.n_ctx_seq, target.n_ctx_train
    if isinstance(target, SequenceTarget):
        slots = (f"{a.parallel} slots decoding in one batch: sequences of one target context of "
                 f"{a.parallel} x {n_ctx} = {target.shared.owner.n_ctx} cells")
    elif a.parallel > 1:
        why = ("--no-batch-slots" if a.batch_slots is False else
               "one CPU thread each: side by side they use the other cores; --batch-slots to share one")
        slots = f"{a.parallel} slots, a context each ({why})"
    else:
        slots = "one slot"
    lines = [f"{slots}; context {n_ctx} tokens per slot ({'--n-ctx' if a.n_ctx else 'the model'}; trained for {n_ctx_train}), "
             f"replies up to {a.max_tokens or 'the end of the context'} tokens unless a request says, prompt cache "
             f"{_mib(cache.cache_ram)} in RAM{'' if cache.cache_dir is None else f' + {cache.cache_dir}'}, "
             f"request bodies up to {_mib(a.max_body_bytes)}, a stream's keep-alive after {a.keepalive:g} s of silence, "
             f"{'any model name answered' if a.accept_any_model else f'only model {a.model_alias!r} answered'}"]
    if n_ctx_train > 0 and n_ctx > n_ctx_train:
        lines.append(f"warning: --n-ctx {n_ctx} is past the {n_ctx_train} tokens the model was trained for: "
                     "replies past that point may lose coherence")
    return lines


def _mib(n: int) -> str:
    return f"{n / (1 << 30):.1f} GiB" if n >= 1 << 30 else f"{n >> 20} MiB"


def is_loopback(host: str) -> bool:
    if host in LOOPBACK_HOSTS:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a taken port is a one-line error, not a traceback."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    family, _, _, _, addr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if family == socket.AF_INET6:
            sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        sock.bind(addr)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def batched(a: argparse.Namespace, options: SessionOptions) -> bool:
    """Whether the slots share one target context, their decodes batched (issue 37): --batch-slots / --no-batch-slots,
    else wherever a context would run more than one CPU thread or is offloaded. Contexts side by side that each
    run ggml on several threads oversubscribe the cores and wait at every op's barrier (8 at once at --threads 2
    here: 55 tok/s against 74 shared); on one thread each (half the cores of a 2- or 3-core machine) they use
    the other cores with no barrier at all, which one shared context on that thread cannot (116 against 69 tok/s,
    docs/BENCHMARKS.md "2026-12-08")."""
    from ..target import default_threads  # libllama: loaded by then, but not for --help or a bad argument

    if a.batch_slots is not None:
        return a.batch_slots and a.parallel > 1
    threads = default_threads() if options.n_threads is None else options.n_threads
    return a.parallel > 1 and (options.n_gpu_layers != 0 or threads > 1)


def open_sessions(a: argparse.Namespace, options: SessionOptions, cache: CacheOptions | None = None) -> list:
    """Slot 0 opens the models, the others fork it (the next sequence of its context); all share one prompt
    cache (if any)."""
    from ..session import Session

    prompt_cache = None if cache is None else cache.open()
    shared = batched(a, options)
    first = Session(a.target, a.drafter, SessionOptions.build(options, sequences=a.parallel if shared else 1),
                    prompt_cache=prompt_cache)
    sessions = [first]
    try:
        if shared:
            first.calibrate()  # timed alone, before the slots share the context (the forks read what it saved)
        for _ in range(a.parallel - 1):
            sessions.append(first.fork())
    except BaseException:
        for s in sessions:
            s.close()
        raise
    return sessions


def main(argv: Sequence[str] | None = None) -> int:
    p = _parser()
    a = p.parse_args(argv)
    if a.api_key is None and os.environ.get("DFLASH_API_KEY"):
        a.api_key = os.environ["DFLASH_API_KEY"]
    options, generation, cache = _check_args(p, a)
    try:
        import uvicorn

        from .app import create_app
        from .serving import Server
    except ImportError as e:
        print(f"{PROG}: error: the server needs its extra: pip install 'dflash-gguf[server]' ({e.name} is missing)",
              file=sys.stderr)
        return EXIT_BAD_INPUT
    if not is_loopback(a.host) and a.api_key is None:
        print(f"{PROG}: warning: binding {a.host} without --api-key: anyone who can reach this port can use the model",
              file=sys.stderr)
    try:
        sock = bind(a.host, a.port)
    except OSError as e:
        print(f"{PROG}: error: cannot listen on {a.host}:{a.port}: {e.strerror or e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        sessions = open_sessions(a, options, cache)
    except (ValueError, TypeError, OSError, RuntimeError) as e:
        sock.close()
        print(f"{PROG}: error: {str(e).splitlines()[0] if str(e) else type(e).__name__}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        sock.close()
        return 130
    try:
        app = create_app(sessions, server_config(a, generation))
        host, port = sock.getsockname()[:2]
        target = sessions[0].target
        for line in _said_at_start(a, cache, target):
            print(f"{PROG}: {line}", file=sys.stderr)
        print(f"{PROG}: serving {a.model_alias!r} with {a.parallel} slot(s) on http://{_url_host(host)}:{port}/v1",
              file=sys.stderr, flush=True)
        server = Server(uvicorn.Config(app, log_level=a.log_level, timeout_graceful_shutdown=10,
                                       access_log=a.log_level == "debug"))
        server.run(sockets=[sock])
    finally:
        sock.close()
        for s in sessions:
            s.close()
    return 0


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


if __name__ == "__main__":
    logging.basicConfig()
    raise SystemExit(main())
