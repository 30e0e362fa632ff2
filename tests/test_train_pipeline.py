"""A tiny end-to-end dflash-train run on the embedded target, and what it must produce.

Three training prompts, short responses, one draft layer, a handful of steps: the checkpoint must
load in the z-lab reference, the GGUF must run in the Session, the cached features must be what
the runtime's Target captures, training must lower the loss, and an interrupted run must resume.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_gguf.schema import hf_layer_to_gguf
from dflash_gguf.target import Target
from dflash_gguf.train.config import TrainConfig
from dflash_gguf.train.pipeline import load_data, run
from dflash_gguf.train.trainer import STATE_FILE, Trainer

pytestmark = pytest.mark.slow  # a tiny dflash-train run end to end

PROMPTS = [
    ("m0", "math", "What is 12 times 7?"),
    ("m1", "math", "Tom has 3 apples and buys 5 more. How many apples does he have?"),
    ("c0", "code", "Write a Python function that returns the square of a number."),
    ("c1", "code", "Write a Python function that reverses a string."),
    ("h0", "chat", "Say hello to a new friend."),
    ("h1", "chat", "Name three colours."),
]


def tiny_config(out: Path, target: Path, prompts: Path, **kw) -> TrainConfig:
    base = dict(
        target=target, prompts=prompts, out=out, test_per_category=1, eval_prompts_per_category=1,
        max_new_tokens=12, max_seq_len=160, parallel=4, threads=1, draft_layers=1, draft_vocab=256,
        steps=6, warmup=2, batch_sequences=2, blocks_per_sequence=4, eval_every=3, save_every=3,
        tau_prompts_per_category=1, tau_max_tokens=8,
    )
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def tiny(embedded_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_train")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n" for i, c, p in PROMPTS))
    cfg = tiny_config(root / "run", embedded_target, prompts)
    result = run(cfg, stage="all", progress=False)
    return cfg, result


def test_run_writes_checkpoint_metrics_and_gguf(tiny):
    cfg, result = tiny
    out = Path(cfg.out)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [3, 6]
    assert set(rows[-1]["tau"]) == {"math", "code", "chat"} and all(t >= 1.0 for t in rows[-1]["tau"].values())
    assert (out / "checkpoints" / "last" / STATE_FILE).is_file()
    assert result.gguf == cfg.gguf_path and cfg.gguf_path.stat().st_size > 0
    assert (out / "session_tau.json").is_file()


def test_checkpoint_loads_in_the_reference(tiny, embedded_target):
    from dflash.model import DFlashDraftModel

    cfg, result = tiny
    ref = DFlashDraftModel.from_pretrained(result.checkpoint, torch_dtype=torch.float32)
    assert ref.target_layer_ids == [1, 8, 14, 20, 27]
    assert ref.block_size == 16 and ref.mask_token_id == 16  # <empty_output>
    assert len(ref.layers) == 1


def test_gguf_runs_in_the_session_and_keeps_greedy_output(tiny, embedded_target):
    from dflash_gguf.session import Session

    cfg, _ = tiny
    messages = [{"role": "user", "content": "What is 2 plus 2?"}]
    with Session(embedded_target, cfg.gguf_path, n_ctx=512, n_threads=1) as s:
        fast = s.chat(messages, max_tokens=12, temperature=0.0, block_size=16)
        plain = s.chat(messages, max_tokens=12, temperature=0.0, speculative=False)
    assert fast.stats.cycles > 0 and fast.stats.acceptance_length >= 1.0
    assert fast.tokens == plain.tokens


def test_cached_features_equal_what_the_runtime_captures(tiny, embedded_target):
    cfg, _ = tiny
    data = load_data(cfg)
    record = data.train.records[0]
    tokens, cached = data.train.load(record)
    layers = hf_layer_to_gguf(data.layer_ids)
    with Target.open(embedded_target, n_ctx=256, n_batch=256, n_threads=1, flash_attn=cfg.flash_attn) as t:
        t.capture(layers)
        t.decode(tokens[:-1], 0, 0, logits=False)
        fresh = t.features(len(tokens) - 1)
    cached = cached.astype(np.float32)
    err = np.linalg.norm(cached - fresh, axis=1) / np.linalg.norm(fresh, axis=1)
    assert err.max() < 5e-3  # fp16 storage, batch-composition rounding
    shifted = np.linalg.norm(cached[1:] - fresh[:-1], axis=1) / np.linalg.norm(fresh[:-1], axis=1)
    assert shifted.min() > 5e-2  # a one-position misalignment would not pass


def test_a_few_steps_on_a_fixed_batch_lower_the_loss(tiny):
    cfg, _ = tiny
    data = load_data(cfg)
    trainer = Trainer(replace(cfg, out=Path(cfg.out) / "learning", lr=3e-3, warmup=0, steps=30), data, progress=False)
    batch = trainer._train_batch()
    losses = []
    for _ in range(25):
        loss, _ = trainer._forward(batch)
        trainer.opt.zero_grad()
        loss.backward()
        trainer.opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]


def test_interrupted_training_resumes_where_it_stopped(tiny, tmp_path):
    cfg, _ = tiny
    out = Path(cfg.out)
    run_dir = tmp_path / "resume"
    run_dir.mkdir()
    for name in ("data", "eval_data", "split.json"):  # the tiny run's caches, shared read-only
        (run_dir / name).symlink_to(out / name)
    base = [
        sys.executable, "-m", "dflash_gguf.train.cli", str(cfg.target), str(cfg.prompts), "--out", str(run_dir),
        "--stage", "train", "--test-per-category", "1", "--eval-prompts", "1", "--threads", "1", "--draft-vocab", "256",
        "--batch-sequences", "1", "--blocks", "2", "--save-every", "2", "--eval-every", "1000", "--quiet",
    ]
    proc = subprocess.Popen(base + ["--steps", "100000"], stderr=subprocess.PIPE, text=True)
    state = run_dir / "checkpoints" / "last" / STATE_FILE
    deadline = time.time() + 120
    while not state.is_file() and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "rerun the same command to resume" in err
    stopped = torch.load(state, weights_only=False)["step"]
    assert 2 <= stopped < 100000
    again = subprocess.run(base + ["--steps", str(stopped + 3)], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    resumed = torch.load(state, weights_only=False)
    assert resumed["step"] == stopped + 3
    assert f"step {stopped + 3}" in again.stdout


def test_interrupted_generation_keeps_finished_answers_and_resumes(tiny, tmp_path):
    from dflash_gguf.train.data import FeatureCache, GenerationSettings, generate
    from dflash_gguf.train.prompts import load_prompts

    cfg, _ = tiny
    prompts = load_prompts(cfg.prompts)
    settings = GenerationSettings(max_new_tokens=6, max_seq_len=160, n_parallel=1)
    layers = hf_layer_to_gguf(load_data(cfg).layer_ids)

    def stop_after_two(n_seq: int, n_tok: int, seconds: float) -> None:
        if n_seq >= 2:
            raise KeyboardInterrupt

    with Target.open(cfg.target, n_ctx=160, n_batch=160, n_threads=1, flash_attn=True) as t:
        t.capture(layers)
        cache = FeatureCache.open_or_create(tmp_path, fingerprint="f", layers=layers, n_embd=t.n_embd, settings=settings)
        with pytest.raises(KeyboardInterrupt):
            generate(t, cache, prompts, settings, progress=stop_after_two)
        assert len(FeatureCache.open(tmp_path).records) == 2
        generate(t, FeatureCache.open(tmp_path), prompts, settings)
    ids = [r.id for r in FeatureCache.open(tmp_path).records]
    assert sorted(ids) == sorted(p.id for p in prompts)  # every prompt once, none twice
