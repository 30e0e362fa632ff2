"""A prompt cache: whole decoding states keyed by their tokens, in RAM (LRU) and on disk, checked before use.

An agent resends the same long prefix on every request; prefilling it again is what the user waits for.
A Snapshot holds everything a Session decodes on for a token prefix: the target's sequence state
(attention KV and, on hybrid targets, the recurrent state) and the drafter's KV of injected features,
as libllama's llama_state_seq bytes. Lookup returns the entry sharing the longest prefix with a prompt.

Entries belong to a context: a hash of everything that shapes the bytes or the numbers in them (the
target and drafter files, by model_identity.file_identity, n_ctx, n_batch, KV types, n_rs_seq, flash
attention, libllama version). Only entries of the asking context are candidates. Disk entries are
single files written to a temp name and renamed, so a reader never sees half of one; each is checked
(magic, format, header, sizes, SHA-256) before its bytes reach libllama, and one that fails is a miss
with a warning, never a crash or a wrong answer. A disk entry is written by the cache's writer thread, so a generation ends (and its reply leaves) without
waiting for the checksum and the write: until the file is in place the entry is served from memory, and
flush() (called at exit) waits for what is queued. This module holds bytes only; the Session turns them
into state (target.py, drafter.py call into C).
"""

from __future__ import annotations

import atexit
import hashlib
import json
import logging
import os
import queue
import re
import struct
import threading
import time
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np

from .model_identity import file_identity

__all__ = ["CacheEvent", "PromptCache", "Snapshot", "context_id", "file_identity", "parse_size"]

log = logging.getLogger("dflash_gguf.prompt_cache")

FORMAT = 1
MAGIC = b"DFPC"
SUFFIX = ".dfpc"
TEMP_MARK = ".tmp-"  # "<name>.tmp-<pid>": a file being written by process pid
_PREAMBLE = struct.Struct("<4sI")  # magic, header length
MAX_HEADER = 1 << 20
DEFAULT_DISK_BYTES = 8 << 30
MAX_QUEUED_WRITES = 4  # a store waits while this many disk writes are queued (each holds a whole state in memory)
FLUSH_TIMEOUT_S = 120.0  # the longest a close or the exit waits for queued writes
MAX_HEADER_ESTIMATE = 4096  # a header's JSON is a few hundred bytes: room enough for the budget check before it exists

_UNITS = {"": 1, "b": 1, "k": 10**3, "kb": 10**3, "kib": 1 << 10, "m": 10**6, "mb": 10**6, "mib": 1 << 20,
          "g": 10**9, "gb": 10**9, "gib": 1 << 30, "t": 10**12, "tb": 10**12, "tib": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes in a size such as 512MiB, 2GiB, 1.5GB or 1000000 (0 turns a tier off); ValueError otherwise."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text if isinstance(text, str) else "")
    if m is None or m.group(2).lower() not in _UNITS:
        raise ValueError(f"not a size: {text!r} (examples: 512MiB, 2GiB, 0)")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def context_id(settings: Mapping[str, Any]) -> str:
    """The identity of a decoding context: entries saved under one id restore only into the same id."""
    text = json.dumps({"format": FORMAT, **settings}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()


@dataclass(frozen=True)
class Snapshot:
    """The decoding state after `tokens`: named llama_state_seq blobs ("target", "drafter")."""

    tokens: tuple[int, ...]
    parts: Mapping[str, bytes]

    @property
    def nbytes(self) -> int:
        return sum(len(b) for b in self.parts.values()) + 4 * len(self.tokens)


@dataclass(frozen=True)
class CacheEvent:
    """What the prompt cache did for one generation: tier None is a miss (or nothing worth restoring)."""

    tier: str | None
    n_restored: int = 0  # prompt tokens whose state came from the cache
    restore_ms: float = 0.0  # finding, reading, checking and loading the entry
    stored: bool = False  # the state at the end of the generation was stored
    store_ms: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"tier": self.tier, "n_restored": self.n_restored, "restore_ms": self.restore_ms,
                "stored": self.stored, "store_ms": self.store_ms}


@dataclass(frozen=True)
class Hit:
    snapshot: Snapshot
    tier: str  # "ram" or "disk"
    n_usable: int  # positions of the snapshot the prompt can keep


@dataclass
class _DiskEntry:
    path: Path
    context: str
    tokens: np.ndarray
    size: int
    last_used: float


@dataclass
class _RamEntry:
    context: str
    snapshot: Snapshot
    tokens: np.ndarray


_Queued = _RamEntry  # a disk entry waiting for the writer: the same three things, held in memory


@dataclass
class CacheCounters:
    """Counters for /metrics; they only grow, except the byte and entry gauges."""

    hits: dict[str, int] = field(default_factory=lambda: {"ram": 0, "disk": 0})
    misses: int = 0
    restored_tokens: int = 0
    restore_seconds: float = 0.0
    stores: int = 0
    evictions: dict[str, int] = field(default_factory=lambda: {"ram": 0, "disk": 0})
    rejected_files: int = 0  # disk entries that failed their checks


def _shared(a: np.ndarray, prompt: np.ndarray) -> int:
    """Length of the common prefix of two token arrays."""
    n = min(len(a), len(prompt))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != prompt[:n])
    return int(diff[0]) if diff.size else n


class PromptCache:
    """Snapshots keyed by token prefix: a RAM tier under an LRU byte budget, a disk tier under its own.

    ram_bytes=0: no RAM tier. directory=None: no disk tier. Thread-safe: one cache serves every slot of a
    server. Several processes may share a directory (each keeps its own budget view; files are atomic).
    Each store is written through to both tiers; a disk hit is promoted to RAM.
    """

    def __init__(self, ram_bytes: int = 0, directory: str | os.PathLike[str] | None = None,
                 disk_bytes: int = DEFAULT_DISK_BYTES) -> None:
        for name, value in (("ram_bytes", ram_bytes), ("disk_bytes", disk_bytes)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        self.ram_bytes = ram_bytes
        self.disk_bytes = disk_bytes if directory is not None else 0
        self.directory = Path(directory) if directory is not None else None
        self._lock = threading.Lock()
        self._ram: OrderedDict[tuple[str, bytes], _RamEntry] = OrderedDict()  # LRU first
        self._ram_used = 0
        self._disk: dict[str, _DiskEntry] = {}  # file name -> entry
        self._queued: dict[str, _Queued] = {}  # file name -> an entry the writer has yet to put in place
        # the writer's queue: (cache, file name) keeps a cache alive until its queued entries are written;
        # None ends the writer once the cache is gone
        self._writes: queue.Queue[tuple[PromptCache, str] | None] = queue.Queue()
        self._room = threading.BoundedSemaphore(MAX_QUEUED_WRITES)
        self._writer: threading.Thread | None = None
        self._bad: set[tuple[str, int, int]] = set()  # (name, size, mtime_ns) already warned about
        self.counters = CacheCounters()
        if self.directory is not None:
            if self.directory.exists() and not self.directory.is_dir():
                raise ValueError(f"{self.directory}: not a directory")
            self.directory.mkdir(parents=True, exist_ok=True)
            if not os.access(self.directory, os.W_OK | os.X_OK):
                raise ValueError(f"{self.directory}: not writable")
            with self._lock:
                self._scan()

    # -- sizes ---------------------------------------------------------------------------------
    # read by /metrics from the event loop while slots store: under the lock
    @property
    def ram_used(self) -> int:
        return self._ram_used

    @property
    def disk_used(self) -> int:
        with self._lock:
            return self._disk_used()

    @property
    def entries(self) -> dict[str, int]:
        with self._lock:
            return {"ram": len(self._ram), "disk": len(self._disk) + len(self._queued)}  # the queued are the disk tier's

    def _disk_used(self) -> int:
        return sum(e.size for e in self._disk.values())

    # -- lookup --------------------------------------------------------------------------------
    def lookup(self, context: str, prompt: Sequence[int], *, at_least: int = 0, prefix_only: bool = False) -> Hit | None:
        """The entry of `context` that lets `prompt` keep the most positions, if more than at_least.

        The prompt's last token is always decoded again (its logits start the reply), so at most
        len(prompt) - 1 positions are kept. prefix_only: the entry is usable only when the prompt extends
        all of it (a hybrid target's recurrent state cannot be cut back).
        """
        want = np.asarray(prompt, dtype=np.int32)
        limit = len(want) - 1

        def usable(tokens: np.ndarray) -> int:
            n = min(_shared(tokens, want), limit)
            return n if not prefix_only or n == len(tokens) else 0

        t0 = time.perf_counter()
        with self._lock:
            if self.directory is not None:
                self._scan()
            # the most positions first; at equal length RAM, then what the writer still holds, then disk
            candidates = sorted(
                [(usable(e.tokens), 2, key) for key, e in self._ram.items() if e.context == context]
                + [(usable(e.tokens), 1, name) for name, e in self._queued.items() if e.context == context]
                + [(usable(e.tokens), 0, name) for name, e in self._disk.items() if e.context == context],
                key=lambda c: (-c[0], -c[1]))
            for n, where, key in candidates:
                if n <= at_least:
                    break
                if where == 2:
                    self._ram.move_to_end(key)
                    return self._hit(Hit(self._ram[key].snapshot, "ram", n), t0)
                if where == 1:  # a disk entry on its way to the disk: its bytes are still in memory
                    return self._hit(Hit(self._queued[key].snapshot, "disk", n), t0)
                snapshot = self._read(self._disk[key])  # None (a warning) if it fails its checks: try the next
                if snapshot is not None:
                    self._put_ram(context, snapshot)
                    return self._hit(Hit(snapshot, "disk", n), t0)
            self.counters.misses += 1
            return None

    def _hit(self, hit: Hit, t0: float) -> Hit:
        self.counters.hits[hit.tier] += 1
        self.counters.restored_tokens += hit.n_usable
        self.counters.restore_seconds += time.perf_counter() - t0
        return hit

    def count_failed_restore(self, hit: Hit) -> None:
        """libllama refused a hit's state (counted as a miss, not a hit)."""
        with self._lock:
            self.counters.hits[hit.tier] -= 1
            self.counters.restored_tokens -= hit.n_usable
            self.counters.misses += 1

    # -- store ---------------------------------------------------------------------------------
    def store(self, context: str, snapshot: Snapshot, *, supersede: bool = True) -> bool:
        """Keep `snapshot` in both tiers (budgets allowing); True if a tier took it.

        supersede: entries of this context whose tokens are a prefix of the snapshot's are dropped (the
        longer one serves every prompt they did: a target whose memory reaches back, attention KV).
        """
        if not snapshot.tokens:
            return False
        tokens = np.asarray(snapshot.tokens, dtype=np.int32)
        name = entry_name(context, tokens)

        def superseded(e: _RamEntry | _DiskEntry) -> bool:
            return supersede and e.context == context and len(e.tokens) < len(tokens) and \
                _shared(e.tokens, tokens) == len(e.tokens)

        with self._lock:
            for key in [k for k, e in self._ram.items() if superseded(e)]:
                self._drop_ram(key)
            taken = self._put_ram(context, snapshot)
            write = False
            if self.directory is not None:
                for n in [n for n, e in self._queued.items() if superseded(e)]:
                    del self._queued[n]  # the writer skips it
                for n in [n for n, e in self._disk.items() if superseded(e)]:
                    self._remove_file(n)
                if name in self._disk:
                    self._touch(self._disk[name])
                elif name not in self._queued and self._fits(snapshot):
                    self._queued[name] = _Queued(context, snapshot, tokens)
                    write = True
                taken = taken or name in self._disk or name in self._queued
            if taken:
                self.counters.stores += 1
        if write:  # outside the lock: a full queue waits for the writer, which takes the lock
            try:
                self._start_writer()
                self._room.acquire()
            except BaseException:  # no writer, or interrupted while waiting: the entry is not queued after all
                with self._lock:
                    self._queued.pop(name, None)
                raise
            self._writes.put((self, name))
        return taken

    def flush(self, timeout: float | None = FLUSH_TIMEOUT_S) -> bool:
        """Wait until every queued disk entry is written (or has failed with a warning); False, with a warning,
        if some were still waiting after `timeout` seconds (a disk that hangs must not hang the process)."""
        done = self._writes.all_tasks_done
        with done:
            if done.wait_for(lambda: not self._writes.unfinished_tasks, timeout):
                return True
            left = self._writes.unfinished_tasks
        log.warning("prompt cache: %d disk write(s) still unfinished after %.0f s; not waiting longer", left, timeout)
        return False

    def clear(self) -> None:
        """Forget every entry of both tiers (the files of the directory this cache wrote included)."""
        with self._lock:
            self._ram.clear()
            self._ram_used = 0
            self._queued.clear()
            for name in list(self._disk):
                self._remove_file(name)

    # -- RAM tier ------------------------------------------------------------------------------
    def _put_ram(self, context: str, snapshot: Snapshot) -> bool:
        size = snapshot.nbytes
        if size > self.ram_bytes:
            return False
        key = (context, _token_key(snapshot.tokens))
        if key in self._ram:
            self._ram.move_to_end(key)
            return True
        while self._ram and self._ram_used + size > self.ram_bytes:
            self._drop_ram(next(iter(self._ram)))
            self.counters.evictions["ram"] += 1
        self._ram[key] = _RamEntry(context, snapshot, np.asarray(snapshot.tokens, dtype=np.int32))
        self._ram_used += size
        return True

    def _drop_ram(self, key: tuple[str, bytes]) -> None:
        entry = self._ram.pop(key)
        self._ram_used -= entry.snapshot.nbytes

    # -- disk tier -----------------------------------------------------------------------------
    def _fits(self, snapshot: Snapshot) -> bool:
        size = _PREAMBLE.size + MAX_HEADER_ESTIMATE + snapshot.nbytes  # tokens and parts
        if size > self.disk_bytes:
            log.info("prompt cache: an entry of %d bytes exceeds the disk budget of %d; not written", size, self.disk_bytes)
            return False
        return True

    def _start_writer(self) -> None:
        with self._lock:
            if self._writer is None:
                writer = threading.Thread(target=_write_loop, args=(self._writes, self._room),
                                          name="prompt-cache-writer", daemon=True)
                writer.start()
                self._writer = writer
                weakref.finalize(self, self._writes.put, None)
                _WRITING.add(self)

    def _write(self, name: str) -> None:
        """Put a queued entry in place: checksum and temp file outside the lock, room and rename under it."""
        with self._lock:
            job = self._queued.get(name)
        if job is None:
            return  # superseded or cleared while it waited
        parts = list(job.snapshot.parts.items())
        body = [job.tokens.astype("<i4").tobytes(), *(data for _, data in parts)]
        digest = hashlib.sha256()
        for chunk in body:
            digest.update(chunk)
        header = json.dumps({
            "format": FORMAT, "context": job.context, "n_tokens": len(job.tokens),
            "parts": [[k, len(v)] for k, v in parts], "sha256": digest.hexdigest(), "created": time.time(),
        }).encode()
        size = _PREAMBLE.size + len(header) + sum(len(b) for b in body)
        assert self.directory is not None
        path = self.directory / name
        temp = self.directory / f"{name}{TEMP_MARK}{os.getpid()}"
        try:
            with temp.open("wb") as f:
                f.write(_PREAMBLE.pack(MAGIC, len(header)))
                f.write(header)
                for chunk in body:
                    f.write(chunk)
            with self._lock:
                if self._queued.pop(name, None) is None:
                    temp.unlink()  # superseded or cleared while it was written
                    return
                for victim in sorted(self._disk.values(), key=lambda e: e.last_used):
                    if self._disk_used() + size <= self.disk_bytes:
                        break
                    self._remove_file(victim.path.name)
                    self.counters.evictions["disk"] += 1
                os.replace(temp, path)
                self._disk[name] = _DiskEntry(path, job.context, job.tokens.copy(), size, time.time())
        except OSError as e:
            log.warning("prompt cache: could not write %s: %s", path, e)
            with self._lock:
                self._queued.pop(name, None)
            try:
                temp.unlink(missing_ok=True)
            except OSError:
                pass  # the directory is gone or read-only: the warning above said what failed

    def _scan(self) -> None:
        """Bring the disk index up to date with the directory: new files' headers are read and checked,
        vanished files forgotten, temp files of writers that are gone removed."""
        assert self.directory is not None
        seen: set[str] = set()
        try:
            listing = list(os.scandir(self.directory))
        except OSError as e:
            log.warning("prompt cache: cannot list %s: %s", self.directory, e)
            return
        for item in listing:
            name = item.name
            if TEMP_MARK in name:
                _remove_orphan_temp(Path(item.path))
                continue
            if not name.endswith(SUFFIX) or not item.is_file():
                continue
            seen.add(name)
            if name in self._disk:
                continue
            try:
                stat = item.stat()
            except OSError:
                continue
            mark = (name, stat.st_size, stat.st_mtime_ns)
            if mark in self._bad:
                continue
            entry = self._read_header(Path(item.path), stat.st_size)
            if entry is None:
                self._bad.add(mark)
                self.counters.rejected_files += 1
                continue
            entry.last_used = stat.st_mtime
            self._disk[name] = entry
        for name in set(self._disk) - seen:
            del self._disk[name]

    def _read_header(self, path: Path, size: int) -> _DiskEntry | None:
        """The entry a file describes, if its preamble, header and size are consistent; else a warning."""
        try:
            with path.open("rb") as f:
                header, tokens = _parse_head(f, size)
        except (OSError, ValueError) as e:
            log.warning("prompt cache: ignoring %s: %s", path, e)
            return None
        if not path.name.startswith(header["context"][:16]):
            log.warning("prompt cache: ignoring %s: its header names another context (a renamed file)", path)
            return None
        return _DiskEntry(path, header["context"], tokens, size, 0.0)

    def _read(self, entry: _DiskEntry) -> Snapshot | None:
        """The snapshot in a disk entry, checked whole (header, sizes, checksum); None (and a warning) if bad."""
        try:
            with entry.path.open("rb") as f:
                size = os.fstat(f.fileno()).st_size
                header, tokens = _parse_head(f, size)
                if header["context"] != entry.context or not np.array_equal(tokens, entry.tokens):
                    raise ValueError("the file changed since it was indexed")
                digest = hashlib.sha256(tokens.astype("<i4").tobytes())
                parts = {}
                for name, n in header["parts"]:
                    data = f.read(n)
                    if len(data) != n:
                        raise ValueError(f"truncated: part {name!r} has {len(data)} of {n} bytes")
                    digest.update(data)
                    parts[name] = data
            if digest.hexdigest() != header["sha256"]:
                raise ValueError("checksum mismatch (corrupt)")
        except FileNotFoundError:
            self._disk.pop(entry.path.name, None)  # another process evicted it: a plain miss
            return None
        except (OSError, ValueError) as e:
            log.warning("prompt cache: ignoring %s: %s", entry.path, e)
            self.counters.rejected_files += 1
            self._disk.pop(entry.path.name, None)
            try:
                stat = entry.path.stat()
                self._bad.add((entry.path.name, stat.st_size, stat.st_mtime_ns))
            except OSError:
                pass
            return None
        self._touch(entry)
        return Snapshot(tuple(int(t) for t in tokens), parts)

    def _touch(self, entry: _DiskEntry) -> None:
        entry.last_used = time.time()
        try:
            os.utime(entry.path)  # the LRU order survives a restart (and is shared with other processes)
        except OSError:
            pass

    def _remove_file(self, name: str) -> None:
        entry = self._disk.pop(name)
        try:
            entry.path.unlink()
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("prompt cache: could not remove %s: %s", entry.path, e)


def _write_loop(writes: "queue.Queue[tuple[PromptCache, str] | None]", room: threading.BoundedSemaphore) -> None:
    """The writer thread: queued entries to disk, one at a time, until its cache is gone."""
    while True:
        job = writes.get()
        try:
            if job is None:
                return
            cache, name = job
            try:
                cache._write(name)
            except Exception:  # noqa: BLE001 - an unexpected failure is logged; the writer serves the rest
                log.exception("prompt cache: writing %s failed", name)
                with cache._lock:
                    cache._queued.pop(name, None)
            room.release()
            del job, cache  # a cache with nothing queued may go
        finally:
            writes.task_done()


_WRITING: "weakref.WeakSet[PromptCache]" = weakref.WeakSet()  # the caches that have a writer, for the exit


@atexit.register
def _flush_at_exit() -> None:
    """Before the interpreter ends (and the writers, daemon threads, with it), the queued writes are done."""
    for cache in list(_WRITING):
        cache.flush()


def entry_name(context: str, tokens: Sequence[int]) -> str:
    """The file name of an entry: its context's prefix and a hash of its tokens (so a lookup can match a name)."""
    return f"{context[:16]}-{_token_key(tokens).hex()[:24]}{SUFFIX}"


def _token_key(tokens: Sequence[int]) -> bytes:
    return hashlib.sha256(np.asarray(tokens, dtype="<i4").tobytes()).digest()


def _parse_head(f: Any, size: int) -> tuple[dict[str, Any], np.ndarray]:
    """(header, tokens) of an open entry file positioned at 0, checked against the file's size."""
    pre = f.read(_PREAMBLE.size)
    if len(pre) != _PREAMBLE.size:
        raise ValueError("truncated (no preamble)")
    magic, n_header = _PREAMBLE.unpack(pre)
    if magic != MAGIC:
        raise ValueError(f"not a dflash prompt-cache file (magic {magic!r})")
    if n_header > MAX_HEADER:
        raise ValueError(f"header of {n_header} bytes is implausible")
    raw = f.read(n_header)
    if len(raw) != n_header:
        raise ValueError("truncated header")
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ValueError("unreadable header") from None
    if not isinstance(header, dict) or header.get("format") != FORMAT:
        raise ValueError(f"format {header.get('format') if isinstance(header, dict) else None!r}, "
                         f"this reader knows {FORMAT}")
    n, parts, context, digest = header.get("n_tokens"), header.get("parts"), header.get("context"), header.get("sha256")
    ok = (isinstance(n, int) and n > 0 and isinstance(context, str) and isinstance(digest, str)
          and isinstance(parts, list) and all(isinstance(p, list) and len(p) == 2 and isinstance(p[0], str)
                                              and isinstance(p[1], int) and p[1] > 0 for p in parts))
    if not ok:
        raise ValueError("malformed header")
    expected = _PREAMBLE.size + n_header + 4 * n + sum(p[1] for p in parts)
    if size != expected:
        raise ValueError(f"{size} bytes, the header describes {expected} (truncated or padded)")
    raw_tokens = f.read(4 * n)
    if len(raw_tokens) != 4 * n:
        raise ValueError("truncated tokens")
    return header, np.frombuffer(raw_tokens, dtype="<i4").astype(np.int32)


def _remove_orphan_temp(path: Path) -> None:
    """Delete a temp file whose writer process is gone (killed mid-write); a live writer's is left alone."""
    try:
        pid = int(path.name.rsplit(TEMP_MARK, 1)[1])
    except ValueError:
        return
    if pid == os.getpid():
        return
    try:
        os.kill(pid, 0)
        return  # still running: its rename will come
    except ProcessLookupError:
        pass
    except PermissionError:
        return  # another user's live process
    try:
        path.unlink()
        log.info("prompt cache: removed %s, left by a writer that is gone", path)
    except OSError:
        pass
