"""Saved calibration: the start-up cost measurement kept on disk, so a Session starts without re-timing batches.

A Session measures what verify batches and draft passes cost on this machine before it prices its first
adaptive cycle (timing.py; seconds on a CPU). The result depends only on the libllama build, the device the
layers sit on, the models, the threads and the context settings, so it is saved under a key made of all of
them, one JSON file per key, and reused while every part of the key is unchanged. A changed part is another
key, so it is measured again; `recalibrate` measures again whatever is saved. A file that cannot be read,
does not parse or belongs to another key is a miss, logged, never an error (nor a hang: a FIFO or a device
at the path is not read); so is a directory that cannot be written.

Where: $DFLASH_CALIBRATION_DIR, else $XDG_CACHE_HOME/dflash-gguf/calibration, else
~/.cache/dflash-gguf/calibration.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
import secrets
import stat
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping


from . import backends
from .controller import CostModel

if TYPE_CHECKING:
    from .drafter import Drafter
    from .memory import TargetMemory
    from .target import Target

ENV_DIR = "DFLASH_CALIBRATION_DIR"
FORMAT = 1  # bump when what timing.py measures, or how, changes: older files then stop matching
MAX_FILES = 64  # the oldest files beyond this many are removed when one is saved
SAVED, MEASURED = "saved", "measured"

log = logging.getLogger("dflash_gguf.calibration")


def directory() -> Path:
    """Where calibration files live (read anew each time, so tests and tools can point it elsewhere)."""
    given = os.environ.get(ENV_DIR)
    if given:
        return Path(given)
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "dflash-gguf" / "calibration"


def session_key(target: Target, drafter: Drafter | None, memory: TargetMemory,
                measurement: Mapping[str, int]) -> dict[str, Any]:
    """Everything a measured cost depends on: the build, where the layers are, the models, threads and
    context settings of target and drafter, the rollback mechanism, and what was measured (block sizes)."""
    key: dict[str, Any] = {
        "format": FORMAT,
        "build": backends.build(),
        "target": {"fingerprint": target.fingerprint(), **target.described(),
                   "placement": backends.placement(target.model, target.n_gpu_layers).as_dict(),
                   "flash_attn": target.flash_attn, "n_rs_seq": target.n_rs_seq,
                   "memory": memory.name},
        "drafter": None,
        "measurement": dict(measurement),
    }
    if drafter is not None:
        key["drafter"] = {"kind": drafter.kind, "block_size": drafter.block_size, **drafter.described(),
                          "placement": drafter.placement().as_dict()}
    return json.loads(json.dumps(key))  # as it reads back from a file: tuples are lists, keys strings


def path_for(key: Mapping[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return directory() / f"{digest}.json"


def _table(raw: Any) -> dict[int, float]:
    """A cost table read back: block sizes >= 1 to positive, finite seconds."""
    if not isinstance(raw, dict) or not raw:
        raise ValueError("a cost table is not a non-empty object")
    table = {int(n): float(s) for n, s in raw.items()}
    if any(n < 1 or not math.isfinite(s) or s <= 0 for n, s in table.items()):
        raise ValueError("a cost table holds a size < 1 or a time that is not a positive number")
    return table


def load(key: Mapping[str, Any]) -> CostModel | None:
    """The costs saved under this key, or None (nothing saved, or a file that is unreadable, corrupt or
    another key's: logged and left to be overwritten by the next measurement)."""
    path = path_for(key)
    try:
        text = _read_regular(path)
    except FileNotFoundError:
        log.info("calibration: none saved for this build, device, models and settings; measuring")
        return None
    except (OSError, UnicodeDecodeError) as e:
        log.warning("calibration: cannot read %s (%s); measuring again", path, e)
        return None
    try:
        saved = json.loads(text)
        if not isinstance(saved, dict) or saved.get("key") != key:
            log.warning("calibration: %s was saved for another build, device, model or setting; measuring again", path)
            return None
        costs = saved["costs"]
        rollback = costs.get("rollback")
        model = CostModel(_table(costs["target"]), _table(costs["draft"]),
                          rollback=None if rollback is None else _table(rollback))
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        log.warning("calibration: %s is corrupt (%s); measuring again", path, str(e) or type(e).__name__)
        return None
    log.info("calibration: reusing the costs saved in %s", path)
    return model


def _read_regular(path: Path) -> str:
    """The UTF-8 text of a regular file. The open does not block (a FIFO put at the path would wait for a
    writer forever) and the descriptor is checked before anything is read: anything else is an OSError."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0))
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise OSError(f"not a regular file (mode {stat.filemode(mode)})")
        f = os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise
    with f:
        return f.read().decode("utf-8")


def save(key: Mapping[str, Any], costs: CostModel) -> Path | None:
    """Write the costs under this key (a temporary file renamed into place); None where it cannot be written."""
    path = path_for(key)
    body = {"key": key, "saved_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "costs": {"target": costs.target.points(), "draft": costs.draft.points(),
                      "rollback": costs.rollback.points() if costs.rollback is not None else None}}
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(6)}.tmp")  # named first: any unwinding removes it
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "x", encoding="utf-8") as f:
            json.dump(body, f, indent=1)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("calibration: cannot save to %s (%s); the next start measures again", path, e)
        return None
    finally:
        with contextlib.suppress(OSError):  # gone once renamed; never made where the folder cannot be
            tmp.unlink()
    _prune(path.parent)
    log.info("calibration: saved to %s", path)
    return path


def _prune(folder: Path) -> None:
    """Keep the MAX_FILES newest files: every other build, model or setting once used leaves one behind."""
    try:
        files = sorted(folder.glob("*.json"), key=lambda p: p.stat().st_mtime_ns, reverse=True)
        for old in files[MAX_FILES:]:
            old.unlink(missing_ok=True)
    except OSError:
        pass  # another process pruned the same folder: nothing of ours is at stake


def saved_or_measured(key: Mapping[str, Any], measure: Callable[[], CostModel], *,
                      recalibrate: bool = False) -> tuple[CostModel, str]:
    """The costs saved under this key ('saved'), else `measure()` saved under it ('measured')."""
    if not recalibrate:
        costs = load(key)
        if costs is not None:
            return costs, SAVED
    else:
        log.info("calibration: measuring again, as asked (recalibrate)")
    costs = measure()
    save(key, costs)
    return costs, MEASURED
