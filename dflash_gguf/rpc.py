"""llama.cpp's RPC backend: ggml devices on other machines, each lent by an `rpc-server`, that hold some of a
target's layers (upstream's `--rpc host:port`).

libllama's RPC client answers every failure with GGML_ABORT, which ends the process: an address it cannot
parse or reach, a server that does not answer its handshake or speaks another protocol version, a server
lending no device, and a connection lost mid-generation. So everything that can be checked first is checked
here, in Python and with timeouts, before a server is handed to C: the address is host:port, the host
resolves to IPv4 (the client connects with gethostbyname and AF_INET), the server accepts a connection,
answers the HELLO handshake within the timeout with this build's protocol version (rpc-server serves one
client at a time, so a server busy with another process never answers), and lends at least one device.

A connection lost later (the server killed, the machine gone) cannot be recovered in this process: ggml's
client aborts from its dispatcher thread while the caller waits inside llama_decode. The abort hook installed
with the first server turns that into one line on stderr, naming the servers that no longer accept
connections, and exit status EXIT_RPC_LOST, instead of a backtrace and SIGABRT. A caller that must outlive a
lost server runs the Session in a child process (dflash-chat does by default).
"""

from __future__ import annotations

import ctypes
import os
import socket
import struct
import sys
import threading
import time
from typing import Any, Sequence

from llama_cpp import llama_cpp as capi

from . import llama_ext

# ggml/include/ggml-rpc.h of the vendored llama.cpp; the client refuses another major or a newer minor
RPC_PROTO_MAJOR_VERSION = 7
RPC_PROTO_MINOR_VERSION = 0
# ggml/src/ggml-rpc/ggml-rpc.cpp: enum rpc_cmd and the HELLO messages (transport.h: RPC_CONN_CAPS_SIZE)
_CMD_HELLO = 14
_CMD_DEVICE_COUNT = 15
_CONN_CAPS_SIZE = 24
_HELLO_RSP_SIZE = 4 + _CONN_CAPS_SIZE
PROBE_TIMEOUT_S = 5.0
# ggml's connections: a server gone without a reset is noticed after IDLE + INTERVAL x PROBES seconds of
# silence, or when data sent to it stays unacknowledged for USER_TIMEOUT_MS
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 10, 5, 3
USER_TIMEOUT_MS = 30_000
# sysexits.h EX_UNAVAILABLE: a service the process depends on is gone
EXIT_RPC_LOST = 69
BUILD_HINT = "build one with scripts/build_rpc.sh (llama-cpp-python with CMAKE_ARGS=-DGGML_RPC=on)"


class RpcError(ConnectionError):
    """An RPC server that cannot take a model: unreachable, busy, another protocol, or lending no device."""


class RpcUnavailableError(RuntimeError):
    """The loaded libllama was built without the RPC backend."""


def parse_endpoint(text: str) -> tuple[str, int]:
    """'host:port' as (host, port); the host is a name or an IPv4 address (ggml's client has no IPv6)."""
    if not isinstance(text, str):
        raise TypeError(f"an RPC server is a 'host:port' string, got {text!r}")
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host or not port:
        raise ValueError(f"an RPC server is host:port, got {text!r}")
    if ":" in host or "[" in host:
        raise ValueError(f"{text!r}: ggml's RPC client connects over IPv4 only; give an IPv4 address or a host name")
    if any(c.isspace() or c == "," for c in host):
        raise ValueError(f"{text!r}: the host has blank space or a comma")
    if not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
    return host, int(port)


def check_endpoints(value: Any) -> tuple[str, ...]:
    """RPC servers as 'host:port' strings: a comma-separated string (upstream's --rpc) or a sequence of them;
    each checked with parse_endpoint, none twice."""
    items = value.split(",") if isinstance(value, str) else value
    if isinstance(value, str) and not value.strip():
        items = []
    if not isinstance(items, (list, tuple)):
        raise TypeError(f"must be 'host:port[,host:port...]' or a list of 'host:port' strings, got {value!r}")
    endpoints = tuple("%s:%d" % parse_endpoint(item) for item in items)
    for i, endpoint in enumerate(endpoints):
        if endpoint in endpoints[:i]:
            raise ValueError(f"{endpoint} is given twice")
    return endpoints


def supported() -> bool:
    """Whether the loaded libllama has the RPC backend (llama_supports_rpc)."""
    return bool(capi.llama_supports_rpc())


def _recv(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise ConnectionError("the server closed the connection")
        data += chunk
    return data


def _command(sock: socket.socket, cmd: int, payload: bytes, reply_size: int) -> bytes:
    """One RPC request (| cmd: u8 | size: u64 | payload |) and its reply (| size: u64 | data |)."""
    sock.sendall(struct.pack("<BQ", cmd, len(payload)) + payload)
    (size,) = struct.unpack("<Q", _recv(sock, 8))
    if size != reply_size:
        raise ConnectionError(f"a reply of {size} bytes where {reply_size} were expected")
    return _recv(sock, size)


def _address(endpoint: str) -> tuple[str, int]:
    host, port = parse_endpoint(endpoint)
    try:
        return socket.gethostbyname(host), port
    except OSError as e:
        raise RpcError(f"RPC server {endpoint}: cannot resolve {host} to an IPv4 address ({e})") from None


def probe(endpoint: str, timeout: float = PROBE_TIMEOUT_S) -> int:
    """How many devices the rpc-server at `endpoint` lends, asked the way libllama's client asks (HELLO, then
    DEVICE_COUNT) but with a timeout on every step; RpcError says what is wrong, where the client would abort."""
    address = _address(endpoint)
    try:
        sock = socket.create_connection(address, timeout=timeout)
    except socket.timeout:
        raise RpcError(f"RPC server {endpoint}: no answer to a connection within {timeout:g} s") from None
    except OSError as e:
        raise RpcError(f"RPC server {endpoint}: cannot connect ({e.strerror or e}); "
                       "is rpc-server running there?") from None
    with sock:
        try:
            hello = _command(sock, _CMD_HELLO, bytes(_CONN_CAPS_SIZE), _HELLO_RSP_SIZE)
            major, minor, patch = hello[:3]
            if major != RPC_PROTO_MAJOR_VERSION or minor > RPC_PROTO_MINOR_VERSION:
                raise RpcError(f"RPC server {endpoint} speaks RPC protocol {major}.{minor}.{patch}; this libllama "
                               f"speaks {RPC_PROTO_MAJOR_VERSION}.{RPC_PROTO_MINOR_VERSION}: build both from one "
                               "llama.cpp (scripts/build_rpc.sh builds the server too)")
            (count,) = struct.unpack("<I", _command(sock, _CMD_DEVICE_COUNT, b"", 4))
        except socket.timeout:
            raise RpcError(f"RPC server {endpoint} accepted a connection but did not answer the RPC handshake within "
                           f"{timeout:g} s: rpc-server serves one client at a time (is another process using it?), "
                           "or this port is not an rpc-server") from None
        except OSError as e:
            raise RpcError(f"RPC server {endpoint}: the RPC handshake failed ({e}); "
                           "is this port an rpc-server?") from None
    if count == 0:
        raise RpcError(f"RPC server {endpoint} lends no device")
    return count


def _reachable(endpoint: str, timeout: float) -> bool:
    """Whether the server still listens: a refused connection says it is gone. One busy with this process
    may leave a connection waiting in its backlog until the timeout, which still means it is there."""
    try:
        socket.create_connection(_address(endpoint), timeout=timeout).close()
    except socket.timeout:
        return True
    except OSError:
        return False
    return True


_lock = threading.Lock()
_servers: dict[str, tuple[int, ...]] = {}  # endpoint -> its devices, registered with ggml once per process
_holders: dict[int, tuple[str, ...]] = {}  # loaded model (address) -> the servers it holds buffers on


@ctypes.CFUNCTYPE(None, ctypes.c_char_p)
def _on_abort(message: bytes | None) -> None:
    """ggml_abort's hook: a lost RPC server becomes one line and EXIT_RPC_LOST. Any other abort prints ggml's
    message and goes on to abort() as before, without ggml's backtrace (the hook replaces its printing)."""
    text = (message or b"").decode("utf-8", errors="replace")
    if "RPC" not in text:
        print(text, file=sys.stderr, flush=True)
        return  # ggml_abort goes on to abort()
    time.sleep(0.5)  # a killed server's listening socket may outlive its connection by a moment
    lost = [e for e in _servers if not _reachable(e, 1.0)]
    what = f"lost the RPC server{'s' if len(lost) > 1 else ''} {', '.join(lost)}" if lost else \
        f"the RPC backend failed (servers {', '.join(_servers)})"
    try:
        sys.stdout.flush()
    except Exception:
        pass
    print(f"dflash-gguf: error: {what}: {text.split(': ', 1)[-1]}; ggml's RPC client cannot recover, so this "
          "process ends", file=sys.stderr, flush=True)
    os._exit(EXIT_RPC_LOST)


_set_abort_callback = llama_ext.ggml_function("ggml_set_abort_callback", [ctypes.c_void_p], ctypes.c_void_p)


def _add_server() -> Any:
    """ggml_backend_rpc_add_server, found as upstream's common/arg.cpp finds it: through the RPC registry."""
    reg = llama_ext.reg_by_name(b"RPC")
    address = llama_ext.reg_get_proc_address(reg, b"ggml_backend_rpc_add_server") if reg else None
    if not address:
        raise RpcUnavailableError(f"this libllama ({capi._lib._name}) has no RPC backend: {BUILD_HINT}")
    return ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_char_p)(address)


def connect(endpoints: Sequence[str]) -> list[int]:
    """The devices the servers lend, in order, each server probed first and registered with ggml once.

    A server this process already holds a model on is busy serving it, so it is only checked to accept
    connections; one whose models were all freed (its connection closed) is probed in full again."""
    endpoints = check_endpoints(list(endpoints))
    if not endpoints:
        return []
    if not supported():
        raise RpcUnavailableError(f"this libllama ({capi._lib._name}) was built without RPC: {BUILD_HINT}")
    with _lock:
        in_use = {e for held in _holders.values() for e in held}
        for endpoint in endpoints:
            if endpoint in in_use:
                if not _reachable(endpoint, PROBE_TIMEOUT_S):
                    raise RpcError(f"RPC server {endpoint} no longer accepts connections")
                continue
            count = probe(endpoint)
            if endpoint in _servers:
                continue
            add_server = _add_server()
            if not _servers:
                _set_abort_callback(ctypes.cast(_on_abort, ctypes.c_void_p))
            reg = add_server(endpoint.encode())
            registered = llama_ext.reg_dev_count(reg) if reg else 0
            if registered != count:
                raise RpcError(f"RPC server {endpoint}: ggml found {registered} devices there, the probe {count}")
            llama_ext.register(reg)
            _servers[endpoint] = tuple(llama_ext.reg_dev_get(reg, i) for i in range(count))
        return [dev for endpoint in endpoints for dev in _servers[endpoint]]


def local_devices() -> list[int]:
    """The devices libllama would give a model of its own accord, without the RPC servers (src/llama.cpp's
    default choice): the discrete GPUs, one per device id; the integrated ones of one backend only where
    there is no discrete GPU."""
    gpus: list[int] = []
    igpus: list[int] = []
    ids: set[bytes] = set()
    for i in range(llama_ext.dev_count()):
        dev = llama_ext.dev_get(i)
        kind = llama_ext.dev_type(dev)
        reg = llama_ext.dev_backend_reg(dev)
        # GGML_BACKEND_DEVICE_TYPE_GPU; an RPC device's props are never asked for: that would cross the network
        if kind == 1 and llama_ext.reg_name(reg) != b"RPC":
            props = llama_ext.DevProps()
            llama_ext.dev_get_props(dev, ctypes.byref(props))
            if props.device_id and props.device_id in ids:
                continue
            if props.device_id:
                ids.add(props.device_id)
            gpus.append(dev)
        elif kind == 2 and (not igpus or reg == llama_ext.dev_backend_reg(igpus[-1])):  # GGML_BACKEND_DEVICE_TYPE_IGPU
            igpus.append(dev)
    return gpus or igpus


def model_devices(endpoints: Sequence[str]) -> list[int] | None:
    """The device list for a model about to load: None (libllama's default) while this process has no RPC
    server registered; else the given servers' devices first (where libllama puts RPC devices, to keep the
    last layers and the output next to each other), then the local GPUs. A model given no server (the
    drafter) stays local: the servers registered for the target are not its devices."""
    remote = connect(endpoints)
    if not remote and not _servers:
        return None
    return remote + local_devices()


def connections(endpoint: str) -> list[socket.socket]:
    """This process's TCP connections to `endpoint` (ggml's among them), each as a socket on a duplicate of
    its descriptor: options set on it are the connection's own. Read from /proc/self/fd (Linux; none
    elsewhere). Close them after use; the connections stay open."""
    address = _address(endpoint)
    found: list[socket.socket] = []
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return found
    for name in names:
        try:
            if not os.readlink(f"/proc/self/fd/{name}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            match = sock.family == socket.AF_INET and sock.type == socket.SOCK_STREAM and sock.getpeername() == address
        except OSError:
            match = False
        if match:
            found.append(sock)
        else:
            sock.close()
    return found


def _keep_alive(endpoint: str) -> None:
    """TCP keepalive and a user timeout on ggml's connection to a server: a machine that vanishes (powered
    off, cable pulled) sends no reset, and ggml's client would wait in recv() for ever; with these the
    kernel ends the connection after KEEPALIVE_* / USER_TIMEOUT_MS, ggml's client fails, the abort hook
    names the server. A server that is alive but slow is not cut: its kernel answers the probes."""
    for sock in connections(endpoint):
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE_S), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL_S),
                                  ("TCP_KEEPCNT", KEEPALIVE_PROBES), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
                if hasattr(socket, option):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def hold(model: int, endpoints: Sequence[str]) -> None:
    """A loaded model holds buffers on these servers (its connection to them stays open, kept alive) until
    released."""
    if endpoints:
        with _lock:
            _holders[model] = tuple(endpoints)
        for endpoint in endpoints:
            _keep_alive(endpoint)


def release(model: int) -> None:
    """The model was freed: its servers' connections close with its last buffer."""
    with _lock:
        _holders.pop(model, None)
