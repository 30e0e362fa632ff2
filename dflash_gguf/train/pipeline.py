"""The whole `dflash-train` recipe as stages: data (self-distillation), training, GGUF export.

Each stage picks up what an earlier, interrupted run left in the run directory: the feature
caches skip the prompts already answered, training resumes from its last checkpoint.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from ..schema import hf_layer_to_gguf
from .config import TrainConfig
from .data import FeatureCache, GenerationSettings, check_disk, estimate_cache_bytes, generate
from .errors import TrainError
from .interrupts import sigterm_as_interrupt
from .prompts import Prompt, load_prompts, split_prompts, weighted_order
from .run_data import RunData
from .target_spec import TargetSpec, read_target_spec

SPLIT_FILE = "split.json"
TRAIN_DATA = "data"
EVAL_DATA = "eval_data"


def target_layer_ids(n_target_layers: int, n_features: int) -> list[int]:
    """HF target layer ids (layer outputs) spread from the 2nd layer to the 4th from last.

    The idea of z-lab's `build_target_layer_ids`: shallow, middle and deep features, skipping the
    last layers that specialise in the target's own next token. One feature layer: the middle.
    """
    if n_features == 1:
        return [n_target_layers // 2]
    first, last = 1, n_target_layers - 3
    return [round(first + i * (last - first) / (n_features - 1)) for i in range(n_features)]


def resolve_layers(cfg: TrainConfig, spec: TargetSpec) -> list[int]:
    """HF target layer ids: given, or spread over the target's layers."""
    ids = list(cfg.target_layer_ids) if cfg.target_layer_ids else target_layer_ids(spec.info.n_layer, cfg.feature_layers)
    bad = [i for i in ids if not 0 <= i < spec.info.n_layer - 1]
    if bad:
        raise TrainError(f"target layer ids {bad} outside 0..{spec.info.n_layer - 2} for a {spec.info.n_layer}-layer target")
    return ids


def split(cfg: TrainConfig) -> tuple[list[Prompt], list[Prompt]]:
    """(train, test) prompts, and the test ids written to OUT/split.json for later τ measurements."""
    prompts = load_prompts(cfg.prompts)
    hold = {p.id for p in load_prompts(cfg.hold_out)} if cfg.hold_out else set()
    train, test = split_prompts(prompts, cfg.test_per_category, cfg.seed, hold)
    if not train:
        raise TrainError(f"{cfg.prompts}: no prompts left for training after holding back the test split")
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    by_cat: dict[str, list[str]] = {}
    for p in test:
        by_cat.setdefault(p.category, []).append(p.id)
    tmp = out / (SPLIT_FILE + ".tmp")
    tmp.write_text(json.dumps({"seed": cfg.seed, "prompts": str(cfg.prompts), "test": by_cat}, indent=1))
    tmp.replace(out / SPLIT_FILE)
    return train, test


def eval_subset(test: list[Prompt], hold_out: set[str], per_category: int) -> list[Prompt]:
    """The first `per_category` test prompts of each category (benchmark prompts left to the benchmark)."""
    taken: dict[str, int] = {}
    chosen = []
    for p in test:
        if p.id in hold_out or taken.get(p.category, 0) >= per_category:
            continue
        taken[p.category] = taken.get(p.category, 0) + 1
        chosen.append(p)
    return chosen


def prepare_data(cfg: TrainConfig, *, progress: bool = True) -> RunData:
    """Answer the held-out eval prompts and then the training prompts, caching features."""
    from ..target import Target  # libllama loads only when data is actually generated

    spec = read_target_spec(cfg.target, cfg.mask_token_id)
    layer_ids = resolve_layers(cfg, spec)
    train, test = split(cfg)
    hold = {p.id for p in load_prompts(cfg.hold_out)} if cfg.hold_out else set()
    settings = GenerationSettings(
        max_new_tokens=cfg.max_new_tokens, max_seq_len=cfg.max_seq_len, n_parallel=cfg.parallel,
        n_threads=cfg.threads, temperature=cfg.temperature, seed=cfg.seed, top_k=cfg.top_k,
    )
    gguf_layers = hf_layer_to_gguf(layer_ids)
    out = Path(cfg.out)
    caches = {
        name: FeatureCache.open_or_create(
            out / name, fingerprint=spec.info.fingerprint, layers=gguf_layers, n_embd=spec.info.n_embd, settings=settings
        )
        for name in (EVAL_DATA, TRAIN_DATA)
    }
    order = weighted_order(train, cfg.category_weights, cfg.seed)
    if cfg.max_prompts is not None:
        order = order[: cfg.max_prompts]
    eval_prompts = eval_subset(test, hold, cfg.eval_prompts_per_category)
    jobs = [(EVAL_DATA, eval_prompts), (TRAIN_DATA, order)]
    if cfg.max_seq_len > spec.context_length:
        raise TrainError(f"max_seq_len {cfg.max_seq_len} exceeds the target's context length {spec.context_length}")
    if cfg.from_archive is not None:
        rebuild_from_archive(cfg, caches, progress=progress)
        return RunData(spec, layer_ids, caches[TRAIN_DATA], caches[EVAL_DATA], train, test)
    n_todo = sum(p.id not in caches[name].done_ids for name, ps in jobs for p in ps)
    check_disk(out, estimate_cache_bytes(n_todo, settings, caches[TRAIN_DATA].manifest.row_bytes))
    if n_todo:
        deadline = time.time() + cfg.generate_minutes * 60 if cfg.generate_minutes else None
        target = Target.open(
            cfg.target, n_ctx=cfg.parallel * cfg.max_seq_len, n_batch=512, n_seq_max=cfg.parallel,
            n_threads=cfg.threads, flash_attn=cfg.flash_attn,
        )
        try:
            with sigterm_as_interrupt():
                target.capture(gguf_layers)
                for name, ps in jobs:
                    cache = caches[name]
                    todo = sum(p.id not in cache.done_ids for p in ps)
                    if not todo:
                        continue
                    bar = tqdm(total=todo, desc=f"generate {name}", unit="seq", disable=not progress, dynamic_ncols=True)

                    last = [0, 0, 0.0]

                    def report(n_seq: int, n_tok: int, seconds: float, bar=bar, last=last) -> None:
                        last[:] = [n_seq, n_tok, seconds]
                        bar.set_postfix(tok_s=f"{n_tok / max(seconds, 1e-9):.0f}", tokens=n_tok, refresh=False)
                        bar.update(n_seq - bar.n)

                    try:
                        generate(target, cache, ps, settings, deadline=deadline, progress=report)
                    finally:
                        bar.close()
                        if last[2] > 0:
                            _log_rate(cfg, {"stage": "generate", "cache": name, "sequences": last[0], "tokens": last[1],
                                            "seconds": round(last[2], 2), "tokens_per_s": round(last[1] / last[2], 1),
                                            "threads": cfg.threads, "parallel": cfg.parallel})
        finally:
            target.close()
    return RunData(spec, layer_ids, caches[TRAIN_DATA], caches[EVAL_DATA], train, test)


def rebuild_from_archive(cfg: TrainConfig, caches: dict[str, FeatureCache], *, progress: bool = True) -> None:
    """Fill the caches from the token archive `cfg.from_archive` by batched prefill (no generation)."""
    from ..target import Target
    from .archive import read_archive, rebuild

    archive = read_archive(cfg.from_archive)
    fp = caches[TRAIN_DATA].manifest.target_fingerprint
    if archive.provenance.get("target_fingerprint") != fp:
        raise TrainError(
            f"{cfg.from_archive}: the archive was made by target {archive.provenance.get('target_fingerprint')}, not {fp}"
        )
    todo = {name: [s for s in archive.split(name) if s.id not in caches[name].done_ids] for name in caches}
    longest = max((len(s.tokens) for ss in todo.values() for s in ss), default=0)
    if not longest:
        return
    n_seq = max(1, cfg.parallel)
    target = Target.open(
        cfg.target, n_ctx=n_seq * max(longest, 64), n_batch=cfg.prefill_batch, n_seq_max=n_seq,
        n_threads=cfg.threads, flash_attn=cfg.flash_attn,
    )
    try:
        with sigterm_as_interrupt():
            target.capture(caches[TRAIN_DATA].manifest.target_layers)
            for name in (EVAL_DATA, TRAIN_DATA):
                if not todo[name]:
                    continue
                bar = tqdm(total=len(todo[name]), desc=f"prefill {name}", unit="seq", disable=not progress, dynamic_ncols=True)
                last = [0, 0, 0.0]

                def report(n_seq: int, n_rows: int, seconds: float, bar=bar, last=last) -> None:
                    last[:] = [n_seq, n_rows, seconds]
                    bar.set_postfix(tok_s=f"{n_rows / max(seconds, 1e-9):.0f}", refresh=False)
                    bar.update(n_seq - bar.n)

                try:
                    rebuild(target, caches[name], todo[name], progress=report)
                finally:
                    bar.close()
                    if last[2] > 0:  # an interrupted rebuild reports its rate too
                        _log_rate(cfg, {"stage": "prefill", "cache": name, "sequences": last[0], "rows": last[1],
                                        "seconds": round(last[2], 2), "rows_per_s": round(last[1] / last[2], 1),
                                        "threads": cfg.threads, "n_batch": cfg.prefill_batch})
    finally:
        target.close()


def _log_rate(cfg: TrainConfig, row: dict) -> None:
    """Append a data-stage throughput record to OUT/data_rates.jsonl."""
    with (Path(cfg.out) / "data_rates.jsonl").open("a") as f:
        f.write(json.dumps({"time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **row}) + "\n")


def write_token_archive(cfg: TrainConfig) -> Path:
    """OUT's cached token sequences (training and held-out) as the compressed archive `cfg.archive_path`."""
    from .archive import file_sha256, write_archive

    out = Path(cfg.out)
    caches = {name: FeatureCache.open(out / name) for name in (TRAIN_DATA, EVAL_DATA) if (out / name / "manifest.json").is_file()}
    if not caches:
        raise TrainError(f"no feature cache in {out}: run the data stage first")
    split_info = json.loads((out / SPLIT_FILE).read_text()) if (out / SPLIT_FILE).is_file() else {}
    provenance = {
        "target_file": Path(cfg.target).name,
        "target_sha256": file_sha256(cfg.target),
        "prompts_file": Path(cfg.prompts).name,
        "prompts_sha256": file_sha256(cfg.prompts),
        "hold_out_file": Path(cfg.hold_out).name if cfg.hold_out else None,
        "split_seed": split_info.get("seed", cfg.seed),
        "held_out_ids": split_info.get("test", {}),
        "generation": "greedy self-distillation: the target answered each prompt through its chat template" if cfg.temperature == 0
        else f"sampled self-distillation at temperature {cfg.temperature}",
        "made_by": "dflash-train --stage archive",
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    path = cfg.archive_path
    write_archive(caches, path, provenance)
    return path


def load_data(cfg: TrainConfig) -> RunData:
    """The caches an earlier data stage wrote (no generation)."""
    spec = read_target_spec(cfg.target, cfg.mask_token_id)
    layer_ids = resolve_layers(cfg, spec)
    train_prompts, test = split(cfg)
    out = Path(cfg.out)
    train, ev = FeatureCache.open(out / TRAIN_DATA), FeatureCache.open(out / EVAL_DATA)
    if train.manifest.target_fingerprint != spec.info.fingerprint or train.manifest.target_layers != hf_layer_to_gguf(layer_ids):
        raise TrainError(f"{out / TRAIN_DATA}: the cache was made for another target or layer set")
    if not train.records:
        raise TrainError(f"{out / TRAIN_DATA}: the feature cache holds no sequences; run the data stage first")
    return RunData(spec, layer_ids, train, ev, train_prompts, test)


@dataclass
class RunResult:
    lines: list[str]
    checkpoint: Path | None = None
    gguf: Path | None = None

    def summary(self) -> list[str]:
        return self.lines


def run(cfg: TrainConfig, *, stage: str = "all", progress: bool = True) -> RunResult:
    """Run the stages of `stage` ("all", "data", "train", "export" or "tau") and say what they made."""
    cfg.validate()
    result = RunResult(lines=[])
    data = None
    if stage in ("all", "data"):
        data = prepare_data(cfg, progress=progress)
        result.lines.append(
            f"data: {len(data.train.records)} training sequences ({data.train.n_tokens} tokens), "
            f"{len(data.eval.records)} held-out, in {cfg.out}"
        )
    if stage == "archive":
        path = write_token_archive(cfg)
        result.lines.append(f"archive: {path} ({path.stat().st_size / 1e6:.2f} MB)")
        return result
    if stage in ("all", "train"):
        from .trainer import train

        data = data or load_data(cfg)
        report = train(cfg, data, progress=progress)
        result.checkpoint = report.best_checkpoint
        result.lines.extend(report.lines())
    if stage in ("all", "export"):
        from .export import export

        result.gguf = export(cfg)
        result.lines.append(f"gguf: {result.gguf}")
    if stage in ("all", "tau"):
        result.lines.extend(measure_tau(cfg, progress=progress).lines())
    return result


def measure_tau(cfg: TrainConfig, *, progress: bool = True):
    """Session τ of OUT's GGUF on held-out prompts, saved to OUT/session_tau.json."""
    from dataclasses import asdict

    from .evaluate import held_out_prompts, session_tau

    gguf = cfg.gguf_path
    if not gguf.is_file():
        raise TrainError(f"{gguf} not found: run the export stage first")
    hold = {p.id for p in load_prompts(cfg.hold_out)} if cfg.hold_out else set()
    prompts = held_out_prompts(Path(cfg.out), cfg.prompts, cfg.tau_prompts_per_category, hold)
    report = session_tau(
        cfg.target, gguf, prompts, block_size=cfg.block_size, max_tokens=cfg.tau_max_tokens,
        n_threads=cfg.threads, progress=progress,
    )
    out = Path(cfg.out) / "session_tau.json"
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps({"gguf": str(gguf), **asdict(report)}, indent=1))
    tmp.replace(out)
    return report
