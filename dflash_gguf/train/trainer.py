"""The training loop: AdamW on the drafter, periodic τ evaluation, resumable checkpoints.

OUT/checkpoints/last holds the z-lab checkpoint plus `trainer_state.pt` (optimizer, step, RNG
states); rerunning continues from there, with any sequences the data stage has added since.
OUT/checkpoints/best holds the checkpoint of the best held-out τ; OUT/metrics.jsonl every
evaluation (the τ curve against steps and data size).
"""

from __future__ import annotations

import json
import math
import random
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..kinds import kind_named
from ..kinds.training import ScoredRows
from .batches import Batch, draw_anchors, make_batch, spread_anchors
from .config import TrainConfig
from .data import FeatureCache
from .errors import TrainError
from .interrupts import sigterm_as_interrupt
from .model import CHECKPOINT_CONFIG, Drafter, DrafterConfig, checkpoint_to_state
from .run_data import RunData
from .recipe import (
    IGNORE, block_labels, default_gamma, distill_loss, expected_acceptance, label_shift, weighted_loss,
)
from .target_init import init_from_target
from .target_spec import read_embedding_and_head
from .vocab import choose_draft_vocab, coverage, prompt_token_counts, target_to_draft, token_counts

STATE_FILE = "trainer_state.pt"
METRICS_FILE = "metrics.jsonl"
EVAL_BLOCKS = 48  # evenly spaced blocks per held-out sequence


def pick_device(name: str) -> torch.device:
    if name != "auto":
        if name == "cuda" and not torch.cuda.is_available():
            raise TrainError("--device cuda: torch sees no CUDA device")
        if name == "mps" and not torch.backends.mps.is_available():
            raise TrainError("--device mps: torch sees no MPS device")
        return torch.device(name)
    if torch.cuda.is_available():
        return torch.device("cuda")
    if torch.backends.mps.is_available():
        return torch.device("mps")
    return torch.device("cpu")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """bf16 autocast where the hardware runs it fast (CUDA with bf16); fp32 elsewhere (bf16 is slower on CPUs)."""
    if name == "bfloat16":
        return torch.bfloat16
    if name == "float32":
        return torch.float32
    return torch.bfloat16 if device.type == "cuda" and torch.cuda.is_bf16_supported() else torch.float32


@dataclass
class TrainReport:
    step: int
    best_tau: float
    best_step: int
    best_checkpoint: Path | None
    last_eval: dict = field(default_factory=dict)
    seconds: float = 0.0

    def lines(self) -> list[str]:
        taus = ", ".join(f"{k} {v:.2f}" for k, v in sorted(self.last_eval.get("tau", {}).items()))
        return [
            f"train: step {self.step}, {self.seconds / 60:.1f} min this run; held-out τ (offline, greedy): {taus}",
            f"best: τ {self.best_tau:.3f} at step {self.best_step} -> {self.best_checkpoint}",
        ]


def build_model(cfg: TrainConfig, data: RunData, d2t: np.ndarray | None) -> Drafter:
    spec = data.spec
    embed, head = read_embedding_and_head(cfg.target)
    dcfg = DrafterConfig(
        hidden_size=spec.info.n_embd,
        intermediate_size=spec.n_ff,
        num_hidden_layers=cfg.draft_layers,
        num_attention_heads=spec.n_head,
        num_key_value_heads=spec.n_head_kv,
        head_dim=spec.head_dim,
        rms_norm_eps=spec.rms_eps,
        rope_theta=spec.rope_theta,
        vocab_size=spec.info.n_vocab,
        num_target_layers=spec.info.n_layer,
        target_layer_ids=list(data.layer_ids),
        block_size=cfg.block_size,
        mask_token_id=spec.mask_token_id,
        max_position_embeddings=spec.context_length,
        draft_vocab_size=None if d2t is None else len(d2t),
        extra={"target_fingerprint": spec.info.fingerprint, "mask_token": spec.mask_token_text,
               "recipe": {"soft_labels": cfg.soft_labels, "init_from_target": cfg.init_from_target}},
        kind=cfg.kind, conv_kernel_size=cfg.conv_kernel_size, conv_group_size=cfg.conv_group_size,
        selector_rank=cfg.selector_rank, selector_top_k=cfg.selector_top_k, markov_rank=cfg.markov_rank,
    )
    torch.manual_seed(cfg.seed)
    model = Drafter(
        dcfg,
        torch.from_numpy(embed),
        None if head is embed else torch.from_numpy(head),
        None if d2t is None else torch.from_numpy(d2t),
    )
    if cfg.init_from_target:
        init_from_target(model, cfg.target)
    return model


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup, then cosine decay to a tenth of the peak at `cfg.steps`."""
    if step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    progress = min(1.0, (step - cfg.warmup) / max(1, cfg.steps - cfg.warmup))
    return cfg.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def _atomic_dir(final: Path, write) -> None:
    """Write a directory under a temporary name, then swap it in, so a crash keeps the old one."""
    tmp = final.with_name(final.name + ".tmp")
    if tmp.exists():
        shutil.rmtree(tmp)
    write(tmp)
    old = final.with_name(final.name + ".old")
    if final.exists():
        if old.exists():
            shutil.rmtree(old)
        final.rename(old)
    tmp.rename(final)
    if old.exists():
        shutil.rmtree(old)


class Trainer:
    def __init__(self, cfg: TrainConfig, data: RunData, *, progress: bool = True):
        self.cfg, self.data, self.progress = cfg, data, progress
        self.out = Path(cfg.out)
        self.ckpt_dir = self.out / "checkpoints"
        self.device = pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        self.gamma = cfg.gamma if cfg.gamma is not None else default_gamma(cfg.block_size)
        self.shift = label_shift(cfg.kind)
        has_topk = bool(data.train.manifest.top_k)
        if cfg.soft_labels > 0 and not has_topk:
            raise TrainError(
                f"{data.train.directory}: the cache holds no target top-k logits for --soft-labels; "
                "rebuild it with --stage data --from-archive (it stores them), or drop --soft-labels"
            )
        # a kind whose loss reads the target distribution (DSpark's total-variation and confidence terms) has it
        # wherever the cache does
        self.kind_training = kind_named(cfg.kind).training()
        self.soft = has_topk and (cfg.soft_labels > 0 or self.kind_training.target_distribution)
        torch.set_num_threads(cfg.threads)
        last = self.ckpt_dir / "last"
        self._vocab_note = ""
        d2t = self._resume_vocab(last) if (last / STATE_FILE).is_file() else self._new_vocab()
        self.d2t = d2t
        self.model = build_model(cfg, data, d2t).to(self.device)
        self.t2d = None if d2t is None else target_to_draft(d2t, data.spec.info.n_vocab)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.opt = torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay)
        self.rng = np.random.default_rng(cfg.seed)
        self.step = 0
        self.best_tau, self.best_step = -math.inf, -1
        self.n_trained_tokens = 0
        self.elapsed = 0.0
        self._mark = time.time()
        self.last_eval: dict = {}
        if (last / STATE_FILE).is_file():
            self._load(last)

    # -- vocabulary --------------------------------------------------------------------------
    def _new_vocab(self) -> np.ndarray | None:
        n_vocab = self.data.spec.info.n_vocab
        if self.cfg.draft_vocab is None or self.cfg.draft_vocab >= n_vocab:
            return None
        counts = token_counts(self.data.train, n_vocab)
        prompt_counts = prompt_token_counts(self.cfg.target, self.data.train_prompts, n_vocab)
        d2t = choose_draft_vocab(counts, prompt_counts, self.cfg.draft_vocab, self.data.spec.eog_ids)
        held_out = token_counts(self.data.eval, n_vocab)
        self._vocab_note = (
            f"draft vocab {len(d2t)} covers {coverage(counts, d2t):.2%} of {counts.sum()} cached response tokens, "
            f"{coverage(held_out, d2t):.2%} of {held_out.sum()} held-out ones"
        )
        return d2t

    def _resume_vocab(self, last: Path) -> np.ndarray | None:
        cfg = json.loads((last / CHECKPOINT_CONFIG).read_text())
        state = torch.load(last / STATE_FILE, map_location="cpu", weights_only=False)
        if cfg["dflash_config"]["target_layer_ids"] != list(self.data.layer_ids) or cfg["num_hidden_layers"] != self.cfg.draft_layers:
            raise TrainError(f"{last}: this checkpoint has another geometry (layers/target layers) than the command asks for")
        if DrafterConfig.from_hf(cfg).kind != self.cfg.kind:
            raise TrainError(f"{last}: this checkpoint is a {DrafterConfig.from_hf(cfg).kind} drafter, not --kind {self.cfg.kind}")
        return None if state["d2t"] is None else np.asarray(state["d2t"], dtype=np.int64)

    # -- checkpoints -------------------------------------------------------------------------
    def _state(self) -> dict:
        self._tick()
        return {
            "step": self.step,
            "optimizer": self.opt.state_dict(),
            "rng_numpy": self.rng.bit_generator.state,
            "rng_torch": torch.get_rng_state(),
            "rng_python": random.getstate(),
            "best_tau": self.best_tau,
            "best_step": self.best_step,
            "n_trained_tokens": self.n_trained_tokens,
            "elapsed": self.elapsed,
            "d2t": None if self.d2t is None else self.d2t.tolist(),
        }

    def save(self, name: str = "last", with_state: bool = True) -> Path:
        final = self.ckpt_dir / name
        self.ckpt_dir.mkdir(parents=True, exist_ok=True)

        def write(tmp: Path) -> None:
            self.model.save_checkpoint(tmp)
            if with_state:
                torch.save(self._state(), tmp / STATE_FILE)

        _atomic_dir(final, write)
        return final

    def _load(self, last: Path) -> None:
        from safetensors.torch import load_file

        tensors = checkpoint_to_state(load_file(str(last / "model.safetensors")))
        for k in ("d2t", "t2d", "lm_head.weight"):
            tensors.pop(k, None)
        self.model.load_state_dict(tensors)
        state = torch.load(last / STATE_FILE, map_location="cpu", weights_only=False)
        self.opt.load_state_dict(state["optimizer"])
        self.rng.bit_generator.state = state["rng_numpy"]
        torch.set_rng_state(state["rng_torch"])
        random.setstate(state["rng_python"])
        self.step = state["step"]
        self.best_tau, self.best_step = state["best_tau"], state["best_step"]
        self.n_trained_tokens = state["n_trained_tokens"]
        self.elapsed = state["elapsed"]

    # -- one step ----------------------------------------------------------------------------
    def _forward(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss, slot accuracy) over the scored slots of a batch, with the kind's own terms."""
        cfg = self.cfg
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
            hidden = self.model.hidden(batch.features, batch.ctx_pos, batch.block_ids, batch.block_pos, batch.mask)
            scored = batch.labels != IGNORE
            h, prev = hidden[scored], batch.prev[scored]
            logits = self.model.step_logits(h, prev)
        labels, weights = batch.labels[scored], batch.weights[scored]
        soft_ids = batch.soft_ids[scored] if batch.soft_ids is not None else None
        soft_logits = batch.soft_logits[scored] if batch.soft_logits is not None else None
        rows = ScoredRows(h, prev, logits, labels, weights, batch.truth[scored], soft_ids, soft_logits)
        return self.kind_training.loss(
            self.model, rows, cfg, lambda: distill_loss(logits, labels, weights, soft_ids, soft_logits, cfg.soft_labels))

    def _train_batch(self) -> Batch:
        records = self.data.train.records
        picks = self.rng.integers(0, len(records), size=self.cfg.batch_sequences)
        chosen = [records[i] for i in picks]
        anchors = [draw_anchors(r, self.cfg.blocks_per_sequence, self.rng) for r in chosen]
        keep = [i for i, a in enumerate(anchors) if len(a)]
        if not keep:
            raise TrainError("the cached sequences have no response tokens to train on")
        return make_batch(
            self.data.train, [chosen[i] for i in keep], [anchors[i] for i in keep],
            block_size=self.cfg.block_size, mask_token_id=self.data.spec.mask_token_id, gamma=self.gamma, t2d=self.t2d,
            shift=self.shift, soft=self.soft,
        ).to(self.device)

    # -- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def evaluate(self) -> dict:
        """Held-out τ per category, replaying greedy verification on the cached target responses.

        At greedy decoding the target's continuation is its cached response, so a block drafted at
        anchor a commits 1 + (leading slots that match tokens[a+1..]) tokens: that mean over
        evenly spaced anchors is τ without running the target.
        """
        self.model.eval()
        cache: FeatureCache = self.data.eval
        hits: dict[str, list[np.ndarray]] = {}
        losses = []
        b = self.cfg.block_size
        for r in cache.records:
            anchors = spread_anchors(r, EVAL_BLOCKS)
            if not len(anchors):
                continue
            batch = make_batch(
                cache, [r], [anchors], block_size=b, mask_token_id=self.data.spec.mask_token_id,
                gamma=self.gamma, t2d=self.t2d, shift=self.shift,
            ).to(self.device)
            with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype != torch.float32):
                hidden = self.model.hidden(batch.features, batch.ctx_pos, batch.block_ids, batch.block_pos, batch.mask)[0]
                logits = self.model.step_logits(hidden, batch.prev[0]).float()
                # the greedy draft as the runtime makes it: b - 1 drafted slots per block
                hb = hidden.reshape(len(anchors), b, -1)
                hb = hb[:, 1:] if self.shift == 0 else hb[:, : b - 1]
                pred = self.model.draft(hb.float(), batch.block_ids[0].reshape(len(anchors), b)[:, 0]).cpu().numpy()
            tokens, _ = cache.load(r)
            truth = block_labels(tokens, anchors, b).reshape(len(anchors), b)[:, 1:]  # target ids of anchor+1 ..
            if self.d2t is not None:
                pred = self.d2t[pred]
            hits.setdefault(r.category, []).append(pred == truth)
            ok = batch.labels[0] != IGNORE
            if ok.any():
                loss, _ = weighted_loss(logits[ok], batch.labels[0][ok], batch.weights[0][ok])
                losses.append(float(loss))
        self.model.train()
        tau = {c: expected_acceptance(np.concatenate(h)) for c, h in hits.items()}
        all_hits = [x for h in hits.values() for x in h]
        result = {
            "tau": tau,
            "tau_all": expected_acceptance(np.concatenate(all_hits)) if all_hits else math.nan,
            "slot_accuracy": np.concatenate(all_hits).mean(axis=0).round(4).tolist() if all_hits else [],
            "loss": float(np.mean(losses)) if losses else math.nan,
        }
        return result

    def _log(self, row: dict) -> None:
        with (self.out / METRICS_FILE).open("a") as f:
            f.write(json.dumps(row) + "\n")

    def _refresh_data(self) -> None:
        """Pick up sequences a concurrent data stage has added since the last look."""
        self.data.train = FeatureCache.open(self.data.train.directory)

    # -- the loop ----------------------------------------------------------------------------
    def run(self) -> TrainReport:
        cfg = self.cfg
        if self.step >= cfg.steps:
            return self._report(0.0)
        if self._vocab_note:
            tqdm.write(self._vocab_note)
        self.model.train()
        bar = tqdm(total=cfg.steps, initial=self.step, desc="train", unit="step", disable=not self.progress, dynamic_ncols=True)
        t_run = self._mark = time.time()
        window_tokens, window_t = 0, time.time()
        try:
            with sigterm_as_interrupt():
                while self.step < cfg.steps:
                    for g in self.opt.param_groups:
                        g["lr"] = lr_at(self.step, cfg)
                    batch = self._train_batch()
                    loss, acc = self._forward(batch)
                    self.opt.zero_grad(set_to_none=True)
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
                    self.opt.step()
                    self.step += 1
                    n = batch.n_scored
                    self.n_trained_tokens += n
                    window_tokens += n
                    now = time.time()
                    bar.set_postfix(loss=f"{loss.item():.3f}", acc=f"{acc.item():.3f}", tok_s=f"{window_tokens / max(now - window_t, 1e-9):.0f}", refresh=False)
                    bar.update(1)
                    if now - window_t > 30:
                        window_tokens, window_t = 0, now
                    if self.step % cfg.eval_every == 0 or self.step == cfg.steps:
                        self._eval_and_log(loss.item(), acc.item())
                        self._refresh_data()
                    if self.step % cfg.save_every == 0 or self.step == cfg.steps:
                        self.save("last")
        except KeyboardInterrupt:
            self.save("last")
            bar.close()
            raise
        bar.close()
        return self._report(time.time() - t_run)

    def _tick(self) -> None:
        """Add the time since the last tick to the run's total training time (kept across resumes)."""
        now = time.time()
        self.elapsed += now - self._mark
        self._mark = now

    def _eval_and_log(self, loss: float, acc: float) -> None:
        ev = self.evaluate()
        self._tick()
        row = {
            "step": self.step, "train_loss": loss, "train_acc": acc, "eval_loss": ev["loss"],
            "tau": ev["tau"], "tau_all": ev["tau_all"], "slot_accuracy": ev["slot_accuracy"], "trained_tokens": self.n_trained_tokens,
            "data_sequences": len(self.data.train.records), "data_tokens": self.data.train.n_tokens,
            "train_seconds": round(self.elapsed, 1), "lr": lr_at(self.step, self.cfg),
        }
        self._log(row)
        self.last_eval = ev
        tqdm.write(f"step {self.step}: eval loss {ev['loss']:.3f}, τ {ev['tau_all']:.3f} " + " ".join(f"{k}={v:.2f}" for k, v in sorted(ev["tau"].items())))
        if ev["tau_all"] > self.best_tau:
            self.best_tau, self.best_step = ev["tau_all"], self.step
            self.save("best", with_state=False)

    def _report(self, seconds: float) -> TrainReport:
        best = self.ckpt_dir / "best"
        return TrainReport(
            step=self.step, best_tau=self.best_tau, best_step=self.best_step,
            best_checkpoint=best if best.exists() else None, last_eval=self.last_eval, seconds=seconds,
        )


def train(cfg: TrainConfig, data: RunData, *, progress: bool = True) -> TrainReport:
    """Train (or resume training) the drafter of this run up to `cfg.steps`."""
    return Trainer(cfg, data, progress=progress).run()
