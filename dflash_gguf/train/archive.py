"""The self-distilled token sequences as a small archive, and the feature cache rebuilt from it.

Generating the responses is the expensive part of the data stage (one token per sequence per
decode); the features are GBs but are a pure function of the tokens. The archive keeps only the
tokens (a compressed npz of a few MB, with its provenance), so the data survives the machine that
made it. `rebuild` recomputes the feature cache from it by batched prefill: whole sequences in
each decode, the target's top-k next-token logits read at the same time.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from .data import FEATURE_DTYPE, FeatureCache, top_k_rows
from .errors import TrainError
from .prompts import Prompt

ARCHIVE_VERSION = 1


@dataclass(frozen=True)
class ArchivedSequence:
    id: str
    category: str
    split: str  # the cache it came from: "data" (training) or "eval_data" (held out)
    tokens: np.ndarray  # int64, prompt + response
    response_start: int


@dataclass
class Archive:
    provenance: dict
    sequences: list[ArchivedSequence]

    def split(self, name: str) -> list[ArchivedSequence]:
        return [s for s in self.sequences if s.split == name]

    @property
    def n_tokens(self) -> int:
        return sum(len(s.tokens) for s in self.sequences)

    @property
    def n_response_tokens(self) -> int:
        return sum(len(s.tokens) - s.response_start for s in self.sequences)


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with Path(path).open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_archive(caches: dict[str, FeatureCache], path: Path, provenance: dict) -> Archive:
    """Write every sequence of `caches` ({split name: cache}) to the compressed npz `path`.

    Tokens are stored as uint16 when the vocabulary allows it; `provenance` (target, prompts,
    generation settings, ...) is stored as JSON beside the arrays.
    """
    seqs: list[ArchivedSequence] = []
    fingerprints = {c.manifest.target_fingerprint for c in caches.values()}
    if len(fingerprints) > 1:
        raise TrainError(f"caches made for different targets: {sorted(fingerprints)}")
    for name, cache in caches.items():
        for r in cache.records:
            tokens, _ = cache.load(r)
            seqs.append(ArchivedSequence(r.id, r.category, name, tokens, r.response_start))
    if not seqs:
        raise TrainError("no cached sequences to archive: run the data stage first")
    tokens = np.concatenate([s.tokens for s in seqs])
    dtype = np.uint16 if tokens.max() < 2**16 else np.int32
    lengths = np.asarray([len(s.tokens) for s in seqs], dtype=np.int32)
    meta = {
        "version": ARCHIVE_VERSION,
        "target_fingerprint": fingerprints.pop(),
        "settings": next(iter(caches.values())).manifest.settings,
        "n_sequences": len(seqs),
        "n_tokens": int(tokens.size),
        "n_response_tokens": int(sum(len(s.tokens) - s.response_start for s in seqs)),
        **provenance,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez_compressed(
        tmp,
        tokens=tokens.astype(dtype),
        lengths=lengths,
        response_start=np.asarray([s.response_start for s in seqs], dtype=np.int32),
        ids=np.asarray([s.id for s in seqs]),
        categories=np.asarray([s.category for s in seqs]),
        splits=np.asarray([s.split for s in seqs]),
        provenance=np.asarray(json.dumps(meta, sort_keys=True)),
    )
    tmp.replace(path)
    return Archive(meta, seqs)


def read_archive(path: Path) -> Archive:
    """The archive at `path`; TrainError if it is missing or not one."""
    path = Path(path)
    if not path.is_file():
        raise TrainError(f"token archive not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["provenance"]))
            tokens = z["tokens"].astype(np.int64)
            lengths, starts = z["lengths"], z["response_start"]
            ids, cats, splits = z["ids"], z["categories"], z["splits"]
    except (OSError, ValueError, KeyError) as e:
        raise TrainError(f"{path}: not a dflash-train token archive ({e})") from None
    if meta.get("version") != ARCHIVE_VERSION:
        raise TrainError(f"{path}: archive version {meta.get('version')}, this trainer reads {ARCHIVE_VERSION}")
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    seqs = [
        ArchivedSequence(str(ids[i]), str(cats[i]), str(splits[i]), tokens[offsets[i] : offsets[i + 1]], int(starts[i]))
        for i in range(len(lengths))
    ]
    return Archive(meta, seqs)


def rebuild(
    target,
    cache: FeatureCache,
    sequences: Sequence[ArchivedSequence],
    *,
    shard_sequences: int = 64,
    progress: Callable[[int, int, float], None] | None = None,
) -> tuple[int, int, float]:
    """Fill `cache` with the features (and top-k logits) of `sequences` not cached yet, by prefill.

    Every sequence's `tokens[:-1]` is decoded (the last token is never an input, as in generation);
    sequences are packed whole into batches of up to `target.n_batch` rows, one sequence id each,
    and a sequence longer than a batch continues in the next one. Logits are read only for the rows
    that predict response tokens (from `response_start - 1` on). The target must already capture
    the cache's layers. Returns (sequences written, rows decoded, seconds).
    """
    k = cache.manifest.top_k
    done = cache.done_ids
    todo = [s for s in sequences if s.id not in done]
    n_seq_max = target.n_seq_max
    finished: list[tuple] = []
    t0 = time.time()
    n_rows_total = n_written = 0

    # per active sequence: [seq, seq_id, next row, feature chunks, topk ids chunks, topk logit chunks]
    queue = list(todo)
    active: list[list] = []
    free_ids = list(range(n_seq_max))
    try:
        while queue or active:
            while queue and free_ids and len(active) < n_seq_max:
                active.append([queue.pop(0), free_ids.pop(0), 0, [], [], []])
            rows_tok, rows_pos, rows_seq, rows_out, spans = [], [], [], [], []
            for a in active:
                seq, sid, nxt = a[0], a[1], a[2]
                n_in = len(seq.tokens) - 1
                room = target.n_batch - len(rows_tok)
                if room <= 0:
                    break
                take = min(room, n_in - nxt)
                pos = np.arange(nxt, nxt + take)
                spans.append((a, len(rows_tok), take))
                rows_tok.extend(seq.tokens[nxt : nxt + take].tolist())
                rows_pos.extend(pos.tolist())
                rows_seq.extend([sid] * take)
                rows_out.extend((pos >= seq.response_start - 1).tolist() if k else [False] * take)
            if not any(rows_out):
                rows_out[-1] = True  # libllama wants at least one output row
            target.decode(rows_tok, rows_pos, rows_seq, logits=rows_out)
            n_rows_total += len(rows_tok)
            feats = target.features(len(rows_tok)).astype(FEATURE_DTYPE)
            out_rows = np.asarray(rows_out, dtype=bool)
            out_index = np.cumsum(out_rows) - 1
            logits = target.output_logits() if k else None
            for a, first, take in spans:
                a[3].append(feats[first : first + take])
                if k:
                    ids = np.full((take, k), -1, dtype=np.int32)
                    vals = np.zeros((take, k), dtype=np.float16)
                    sel = out_rows[first : first + take]
                    if sel.any():
                        rows = out_index[first : first + take][sel]
                        ids[sel], vals[sel] = top_k_rows(np.asarray(logits[rows]), k)
                    a[4].append(ids)
                    a[5].append(vals)
                a[2] += take
            still = []
            for a in active:
                seq = a[0]
                if a[2] >= len(seq.tokens) - 1:
                    topk = (np.concatenate(a[4]), np.concatenate(a[5])) if k else None
                    prompt = Prompt(seq.id, seq.category, "")
                    finished.append((prompt, seq.tokens.astype(np.int32), np.concatenate(a[3]), seq.response_start, topk))
                    target.remove(a[1], 0, -1)
                    free_ids.append(a[1])
                else:
                    still.append(a)
            active = still
            if len(finished) >= shard_sequences:
                cache.add_shard(finished)
                n_written += len(finished)
                finished = []
            if progress is not None:
                progress(n_written + len(finished), n_rows_total, time.time() - t0)
    except KeyboardInterrupt:
        cache.add_shard(finished)
        raise
    if finished:
        cache.add_shard(finished)
        n_written += len(finished)
    for a in active:
        target.remove(a[1], 0, -1)
    return n_written, n_rows_total, time.time() - t0
