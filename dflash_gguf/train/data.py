"""Self-distilled training data: the target answers the prompts and its features are cached.

The target writes each response itself (its chat template, batched multi-sequence decoding), and
the layer inputs the drafter reads are captured by `Target` during that same generation, the path
the runtime uses, so training sees the features inference sees. Finished sequences are written in
fp16 shards (`shard_NNNNN.tokens.npy`, `.features.npy`) listed in `manifest.json`; every file is
written to a temporary name and renamed, so an interrupted run loses only unfinished sequences and
a rerun continues with the prompts not done yet.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Sequence

import numpy as np

from ..sampling import SamplingParams, probabilities, sample_token
from ..target import Target
from .errors import TrainError
from .prompts import Prompt

MANIFEST = "manifest.json"
CACHE_VERSION = 2  # 2: top-k values are log-probabilities of the full distribution (1: raw logits)
FEATURE_DTYPE = np.float16
DISK_MARGIN = 1.2  # headroom over the estimate: shards, manifest rewrites, checkpoints


@dataclass(frozen=True)
class GenerationSettings:
    max_new_tokens: int = 256
    max_seq_len: int = 512  # prompt + response; prompts that leave no room are skipped
    n_parallel: int = 16
    n_threads: int = 2
    temperature: float = 0.0
    seed: int = 0
    shard_sequences: int = 64
    top_k: int = 16  # target logits kept per response token (ids + log-probabilities) for soft labels and DSpark; 0 = none


@dataclass
class SequenceRecord:
    """One cached sequence: prompt + response tokens; features for every token but the last."""

    id: str
    category: str
    shard: int
    token_offset: int
    feature_offset: int
    n_tokens: int
    response_start: int  # index of the first response token

    @property
    def n_features(self) -> int:
        return self.n_tokens - 1


@dataclass
class Manifest:
    version: int
    target_fingerprint: str
    target_layers: list[int]  # GGUF layer-input ids, capture order
    n_embd: int
    settings: dict
    shards: list[dict] = field(default_factory=list)  # {"index", "n_sequences", "n_tokens"}
    sequences: list[dict] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # prompt ids that did not fit max_seq_len
    top_k: int = 0  # target top-k log-probabilities stored per feature row (0: none; caches made before they existed)

    @property
    def row_bytes(self) -> int:
        return len(self.target_layers) * self.n_embd * np.dtype(FEATURE_DTYPE).itemsize


def chat_prompt_text(target: Target, user_text: str) -> str:
    """The target's chat template applied to one user message, ready for generation."""
    from llama_cpp.llama_chat_format import Jinja2ChatFormatter

    template = target.vocab.chat_template()
    if not template:
        raise TrainError("the target GGUF has no chat template (tokenizer.chat_template)")
    formatter = Jinja2ChatFormatter(
        template,
        eos_token=target.vocab.special_token_text(target.vocab.eos_token()),
        bos_token=target.vocab.special_token_text(target.vocab.bos_token()),
    )
    return formatter(messages=[{"role": "user", "content": user_text}]).prompt


class FeatureCache:
    """The on-disk cache of one target + layer set: manifest, shards, and reading them back."""

    def __init__(self, directory: Path, manifest: Manifest):
        self.directory = Path(directory)
        self.manifest = manifest
        self._open: dict[int, tuple[np.ndarray, np.ndarray]] = {}

    @classmethod
    def open_or_create(cls, directory: Path, *, fingerprint: str, layers: Sequence[int], n_embd: int, settings: GenerationSettings) -> "FeatureCache":
        """The cache in `directory`, created empty if absent; TrainError if it was made for another target."""
        directory = Path(directory)
        path = directory / MANIFEST
        if path.is_file():
            cache = cls.open(directory)
            m = cache.manifest
            if m.target_fingerprint != fingerprint or list(m.target_layers) != list(layers) or m.n_embd != n_embd:
                raise TrainError(
                    f"{path}: this feature cache was made for target {m.target_fingerprint} layers {m.target_layers}, "
                    f"not {fingerprint} layers {list(layers)}; use another --out directory"
                )
            return cache
        directory.mkdir(parents=True, exist_ok=True)
        cache = cls(directory, Manifest(CACHE_VERSION, fingerprint, list(layers), n_embd, asdict(settings), top_k=settings.top_k))
        cache._write_manifest()
        return cache

    @classmethod
    def open(cls, directory: Path) -> "FeatureCache":
        path = Path(directory) / MANIFEST
        if not path.is_file():
            raise TrainError(f"no feature cache at {directory} (missing {MANIFEST})")
        try:
            raw = json.loads(path.read_text())
            manifest = Manifest(**raw)
        except (json.JSONDecodeError, TypeError) as e:
            raise TrainError(f"{path}: unreadable manifest ({e})") from None
        if manifest.version != CACHE_VERSION:
            raise TrainError(f"{path}: cache version {manifest.version}, this trainer reads {CACHE_VERSION}")
        return cls(directory, manifest)

    def _write_manifest(self) -> None:
        tmp = self.directory / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(asdict(self.manifest)))
        tmp.replace(self.directory / MANIFEST)

    def _shard_paths(self, index: int) -> tuple[Path, Path]:
        stem = self.directory / f"shard_{index:05d}"
        return Path(f"{stem}.tokens.npy"), Path(f"{stem}.features.npy")

    def _topk_paths(self, index: int) -> tuple[Path, Path]:
        stem = self.directory / f"shard_{index:05d}"
        return Path(f"{stem}.topk_ids.npy"), Path(f"{stem}.topk_logits.npy")

    @property
    def done_ids(self) -> set[str]:
        return {s["id"] for s in self.manifest.sequences} | set(self.manifest.skipped)

    @property
    def records(self) -> list[SequenceRecord]:
        return [SequenceRecord(**s) for s in self.manifest.sequences]

    @property
    def n_tokens(self) -> int:
        return sum(s["n_tokens"] for s in self.manifest.sequences)

    def add_shard(self, finished: list[tuple], skipped: Iterable[str] = ()) -> None:
        """Write (prompt, tokens, features, response_start[, (topk_ids, topk_logits)]) sequences as
        one shard, then list them. A cache with `top_k` stores, per feature row, the target's top-k
        next-token ids (int32, -1 where the row had no logits) and logits (fp16)."""
        if not finished:
            self.manifest.skipped.extend(skipped)
            self._write_manifest()
            return
        index = len(self.manifest.shards)
        tok_path, feat_path = self._shard_paths(index)
        tokens = np.concatenate([item[1] for item in finished]).astype(np.int32)
        feats = np.concatenate([item[2] for item in finished]).astype(FEATURE_DTYPE)
        arrays = [(tok_path, tokens), (feat_path, feats)]
        k = self.manifest.top_k
        if k:
            ids, vals = [], []
            for item in finished:
                n_rows = len(item[2])
                if len(item) > 4 and item[4] is not None:
                    ids.append(np.asarray(item[4][0], dtype=np.int32).reshape(n_rows, k))
                    vals.append(np.asarray(item[4][1], dtype=np.float16).reshape(n_rows, k))
                else:
                    ids.append(np.full((n_rows, k), -1, dtype=np.int32))
                    vals.append(np.zeros((n_rows, k), dtype=np.float16))
            arrays += list(zip(self._topk_paths(index), (np.concatenate(ids), np.concatenate(vals))))
        check_disk(self.directory, sum(a.nbytes for _, a in arrays))
        for path, arr in arrays:
            tmp = path.with_name(path.name + ".tmp")
            with tmp.open("wb") as f:
                np.save(f, arr)
            tmp.replace(path)
        tok_off = feat_off = 0
        for prompt, t, f, start, *_ in finished:
            self.manifest.sequences.append(
                asdict(SequenceRecord(prompt.id, prompt.category, index, tok_off, feat_off, len(t), start))
            )
            tok_off += len(t)
            feat_off += len(f)
        self.manifest.shards.append({"index": index, "n_sequences": len(finished), "n_tokens": int(len(tokens))})
        self.manifest.skipped.extend(skipped)
        self._write_manifest()

    def load(self, record: SequenceRecord) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int64 (n_tokens,), features fp16 (n_tokens-1, n_layers*n_embd)) of one sequence."""
        if record.shard not in self._open:
            tok_path, feat_path = self._shard_paths(record.shard)
            self._open[record.shard] = (np.load(tok_path, mmap_mode="r"), np.load(feat_path, mmap_mode="r"))
        tokens, feats = self._open[record.shard]
        t = np.asarray(tokens[record.token_offset : record.token_offset + record.n_tokens], dtype=np.int64)
        f = feats[record.feature_offset : record.feature_offset + record.n_features]
        return t, f

    def load_topk(self, record: SequenceRecord) -> tuple[np.ndarray, np.ndarray] | None:
        """(ids int64 (n_features, k), logits float32 (n_features, k)) of one sequence: row j is the
        target's top-k for token j+1 (ids -1 where no logits were kept); None if the cache has none."""
        if not self.manifest.top_k:
            return None
        key = ("topk", record.shard)
        if key not in self._open:
            ids_path, val_path = self._topk_paths(record.shard)
            if not ids_path.is_file():
                return None
            self._open[key] = (np.load(ids_path, mmap_mode="r"), np.load(val_path, mmap_mode="r"))
        ids, vals = self._open[key]
        sl = slice(record.feature_offset, record.feature_offset + record.n_features)
        return np.asarray(ids[sl], dtype=np.int64), np.asarray(vals[sl], dtype=np.float32)


def top_k_rows(logits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """(ids (n, k) int32, log-probabilities (n, k) fp16) of the k largest logits of each row, largest first.

    Log-probabilities of the full-vocabulary softmax, not raw logits: a softmax over the kept entries
    (soft labels) is the same either way, and DSpark's total variation needs the true p of each kept
    token and the mass left outside them, which raw top-k logits cannot give.
    """
    logits = np.asarray(logits, dtype=np.float32)
    part = np.argpartition(-logits, k - 1, axis=1)[:, :k]
    vals = np.take_along_axis(logits, part, axis=1)
    order = np.argsort(-vals, axis=1, kind="stable")
    vals = np.take_along_axis(vals, order, axis=1)
    top = vals[:, :1]
    lse = top + np.log(np.exp(logits - top).sum(axis=1, keepdims=True))
    return np.take_along_axis(part, order, axis=1).astype(np.int32), (vals - lse).astype(np.float16)


def _slot_topk(s: "_Slot", k: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The slot's top-k rows laid out per feature row (-1 ids where no logits were read)."""
    if not k:
        return None
    n_rows = len(s.tokens) - 1
    ids = np.full((n_rows, k), -1, dtype=np.int32)
    vals = np.zeros((n_rows, k), dtype=np.float16)
    for r, i, v in s.topk:
        ids[r], vals[r] = i, v
    return ids, vals


def check_disk(directory: Path, needed_bytes: int) -> None:
    """TrainError if the disk holding `directory` has less free space than `needed_bytes` (+margin)."""
    free = shutil.disk_usage(directory).free
    if free < needed_bytes * DISK_MARGIN:
        raise TrainError(
            f"not enough disk for the feature cache in {directory}: need ~{needed_bytes * DISK_MARGIN / 1e9:.2f} GB, "
            f"{free / 1e9:.2f} GB free (generate fewer prompts with --max-prompts, or use another --out)"
        )


def estimate_cache_bytes(n_prompts: int, settings: GenerationSettings, row_bytes: int) -> int:
    """Upper bound for `n_prompts` sequences: every one at max_seq_len tokens."""
    return n_prompts * settings.max_seq_len * (row_bytes + 4)


@dataclass
class _Slot:
    prompt: Prompt
    tokens: list[int]
    response_start: int
    features: list[np.ndarray] = field(default_factory=list)
    n_decoded: int = 0  # tokens already in the KV cache
    topk: list[tuple[int, np.ndarray, np.ndarray]] = field(default_factory=list)  # (feature row, ids, logits)


def generate(
    target: Target,
    cache: FeatureCache,
    prompts: Sequence[Prompt],
    settings: GenerationSettings,
    *,
    deadline: float | None = None,
    progress: Callable[[int, int, float], None] | None = None,
) -> int:
    """Answer every prompt not yet cached, capturing features as the answers are decoded.

    Continuous batching: up to `n_parallel` sequences share each decode; a finished slot takes
    the next prompt (its whole prompt prefilled in the same batch). Stops early at `deadline`
    (time.time()), keeping every finished sequence. Returns the number of sequences written.
    Each shard checks the free disk before it is written; `check_disk` with `estimate_cache_bytes`
    checks the whole job up front.
    """
    params = SamplingParams(temperature=settings.temperature, seed=settings.seed)
    params.validate()
    rng = np.random.default_rng(settings.seed)
    done = cache.done_ids
    todo = [p for p in prompts if p.id not in done]
    pending = iter(todo)
    slots: list[_Slot | None] = [None] * settings.n_parallel
    finished: list[tuple[Prompt, np.ndarray, np.ndarray, int]] = []
    skipped: list[str] = []
    n_written = 0
    n_generated = 0
    t0 = time.time()
    exhausted = False

    def refill(i: int) -> None:
        nonlocal exhausted
        while not exhausted:
            p = next(pending, None)
            if p is None:
                exhausted = True
                return
            toks = target.vocab.tokenize(chat_prompt_text(target, p.prompt), add_special=False, parse_special=True)
            if len(toks) + 2 > min(settings.max_seq_len, target.n_ctx_seq):
                skipped.append(p.id)
                continue
            slots[i] = _Slot(p, toks, len(toks))
            return

    for i in range(settings.n_parallel):
        refill(i)
    try:
        while any(s is not None for s in slots):
            if deadline is not None and time.time() > deadline:
                break
            tok_rows: list[int] = []
            pos_rows: list[int] = []
            seq_rows: list[int] = []
            spans: list[tuple[int, int, int]] = []  # (slot, first row, n rows)
            for i, s in enumerate(slots):
                if s is None:
                    continue
                new = s.tokens[s.n_decoded :]
                if len(tok_rows) + len(new) > target.n_batch:
                    continue  # this prefill waits for a roomier batch
                spans.append((i, len(tok_rows), len(new)))
                tok_rows.extend(new)
                pos_rows.extend(range(s.n_decoded, s.n_decoded + len(new)))
                seq_rows.extend([i] * len(new))
            out = np.zeros(len(tok_rows), dtype=bool)
            for _, first, n in spans:
                out[first + n - 1] = True
            target.decode(tok_rows, pos_rows, seq_rows, logits=out)
            feats = target.features(len(tok_rows)).astype(FEATURE_DTYPE)
            logits = target.output_logits()
            for k, (i, first, n) in enumerate(spans):
                s = slots[i]
                s.features.append(feats[first : first + n])
                s.n_decoded += n
                row = logits[k]
                nxt = int(np.argmax(row)) if params.greedy else sample_token(probabilities(row, params), rng)
                if settings.top_k:
                    ids, vals = top_k_rows(row[None], settings.top_k)
                    s.topk.append((s.n_decoded - 1, ids[0], vals[0]))
                s.tokens.append(nxt)
                n_generated += 1
                n_response = len(s.tokens) - s.response_start
                if target.vocab.is_eog(nxt) or n_response >= settings.max_new_tokens or len(s.tokens) >= settings.max_seq_len:
                    finished.append((s.prompt, np.asarray(s.tokens, dtype=np.int32), np.concatenate(s.features), s.response_start,
                                     _slot_topk(s, settings.top_k)))
                    target.remove(i, 0, -1)
                    slots[i] = None
                    refill(i)
            if len(finished) >= settings.shard_sequences:
                cache.add_shard(finished, skipped)
                n_written += len(finished)
                finished, skipped = [], []
            if progress is not None:
                progress(n_written + len(finished), n_generated, time.time() - t0)
    except KeyboardInterrupt:
        cache.add_shard(finished, skipped)  # finished answers survive the interrupt
        raise
    if finished or skipped:
        cache.add_shard(finished, skipped)
        n_written += len(finished)
    for i, s in enumerate(slots):
        if s is not None:
            target.remove(i, 0, -1)
    return n_written
