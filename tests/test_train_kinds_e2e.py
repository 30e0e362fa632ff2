"""Tiny end-to-end runs on the embedded target: top-k logits in the cache, the token archive and
the cache rebuilt from it, every drafter kind learning, DFlash 2 and DSpark through the converter into
the Session, and the target-initialised drafter."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_gguf.train.archive import read_archive
from dflash_gguf.train.config import TrainConfig
from dflash_gguf.train.data import FeatureCache
from dflash_gguf.train.errors import TrainError
from dflash_gguf.train.pipeline import load_data, run
from dflash_gguf.train.trainer import Trainer

pytestmark = pytest.mark.slow  # tiny training runs of every drafter kind, converted and run in the Session

PROMPTS = [
    ("m0", "math", "What is 12 times 7?"),
    ("m1", "math", "Tom has 3 apples and buys 5 more. How many apples does he have?"),
    ("c0", "code", "Write a Python function that returns the square of a number."),
    ("c1", "code", "Write a Python function that reverses a string."),
    ("h0", "chat", "Say hello to a new friend."),
    ("h1", "chat", "Name three colours."),
]


@pytest.fixture(scope="module")
def tiny(embedded_target, tmp_path_factory):
    root = tmp_path_factory.mktemp("kinds")
    prompts = root / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n" for i, c, p in PROMPTS))
    cfg = TrainConfig(
        target=embedded_target, prompts=prompts, out=root / "run", test_per_category=1, eval_prompts_per_category=1,
        max_new_tokens=16, max_seq_len=160, parallel=4, threads=1, draft_layers=1, draft_vocab=256,
        steps=6, warmup=0, lr=3e-3, batch_sequences=2, blocks_per_sequence=4, eval_every=3, save_every=3,
        tau_prompts_per_category=1, tau_max_tokens=8, selector_rank=8, markov_rank=8,
    )
    run(cfg, stage="data", progress=False)
    return cfg


def test_generation_keeps_the_targets_top_k_for_every_response_token(tiny):
    cache = FeatureCache.open(Path(tiny.out) / "data")
    assert cache.manifest.top_k == 16
    for r in cache.records:
        tokens, feats = cache.load(r)
        ids, logits = cache.load_topk(r)
        assert ids.shape == (len(feats), 16) == logits.shape
        first = r.response_start - 1  # the prompt's last row predicts the first response token
        assert (ids[:first] == -1).all() and (ids[first:] >= 0).all()
        assert (ids[first:, 0] == tokens[r.response_start :]).all()  # greedy: the top-1 is what came next
        assert (np.diff(logits[first:], axis=1) <= 0).all()  # largest first


def test_archive_round_trips_and_rebuilds_the_cache_a_fresh_capture_made(tiny):
    result = run(replace(tiny, archive=Path(tiny.out) / "tokens.npz"), stage="archive", progress=False)
    path = Path(tiny.out) / "tokens.npz"
    assert "archive:" in result.lines[0] and path.is_file()
    archive = read_archive(path)
    assert archive.provenance["target_file"] == Path(tiny.target).name and len(archive.provenance["target_sha256"]) == 64
    assert archive.provenance["held_out_ids"] and archive.provenance["settings"]["max_new_tokens"] == 16
    rebuilt_cfg = replace(tiny, out=Path(tiny.out).with_name("rebuilt"), from_archive=path)
    run(rebuilt_cfg, stage="data", progress=False)
    for name in ("data", "eval_data"):
        fresh, rebuilt = FeatureCache.open(Path(tiny.out) / name), FeatureCache.open(rebuilt_cfg.out / name)
        by_id = {r.id: r for r in rebuilt.records}
        assert set(by_id) == {r.id for r in fresh.records}
        for r in fresh.records:
            (t0, f0), (t1, f1) = fresh.load(r), rebuilt.load(by_id[r.id])
            assert np.array_equal(t0, t1) and by_id[r.id].response_start == r.response_start
            assert np.array_equal(np.asarray(f0), np.asarray(f1))  # flash attention: batch-invariant on CPU
            k0, k1 = fresh.load_topk(r), rebuilt.load_topk(by_id[r.id])
            assert np.array_equal(k0[0], k1[0]) and np.array_equal(k0[1], k1[1])
    rates = [json.loads(line) for line in (rebuilt_cfg.out / "data_rates.jsonl").read_text().splitlines()]
    assert {r["stage"] for r in rates} == {"prefill"} and all(r["rows_per_s"] > 0 for r in rates)


def test_a_file_that_is_no_archive_is_refused(tmp_path):
    bad = tmp_path / "x.npz"
    np.savez(bad, a=np.zeros(3))
    with pytest.raises(TrainError, match="not a dflash-train token archive"):
        read_archive(bad)


@pytest.mark.parametrize("kind,extra", [
    ("dflash", {}),
    ("dflash", {"soft_labels": 0.5}),
    ("dflash2", {"draft_vocab": None}),
    ("dspark", {}),
])
def test_every_kind_halves_its_loss_on_a_fixed_batch(tiny, kind, extra, tmp_path):
    data = load_data(tiny)
    trainer = Trainer(replace(tiny, out=tmp_path, kind=kind, steps=40, **extra), data, progress=False)
    assert trainer.soft == (kind == "dspark" or "soft_labels" in extra)
    batch = trainer._train_batch()
    losses = []
    for _ in range(30):
        loss, _ = trainer._forward(batch)
        trainer.opt.zero_grad()
        loss.backward()
        trainer.opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses


@pytest.mark.parametrize("kind,arch,extra", [
    ("dflash2", "DFlash2DraftModel", {"draft_vocab": None}),
    ("dspark", "DSparkDraftModel", {}),
])
def test_run_converts_and_keeps_greedy_output_in_the_session(tiny, embedded_target, tmp_path, kind, arch, extra):
    import shutil

    from dflash_gguf.session import Session

    out = tmp_path / kind
    out.mkdir()
    for name in ("data", "eval_data", "split.json"):
        shutil.copytree(Path(tiny.out) / name, out / name) if (Path(tiny.out) / name).is_dir() else shutil.copy(Path(tiny.out) / name, out / name)
    cfg = replace(tiny, out=out, kind=kind, steps=4, eval_every=2, save_every=2, **extra)
    result = run(cfg, stage="train", progress=False)
    hf = json.loads((result.checkpoint / "config.json").read_text())
    assert hf["architectures"] == [arch]
    run(cfg, stage="export", progress=False)
    messages = [{"role": "user", "content": "What is 2 plus 2?"}]
    with Session(embedded_target, cfg.gguf_path, n_ctx=512, n_threads=1) as s:
        assert s.drafter.kind == kind
        fast = s.chat(messages, max_tokens=12, temperature=0.0, block_size=16)
        plain = s.chat(messages, max_tokens=12, temperature=0.0, speculative=False)
    assert fast.stats.cycles > 0
    assert fast.tokens == plain.tokens


def test_init_from_target_copies_its_top_layer_and_output_norm(tiny):
    from dflash_gguf.train.target_init import _read, unpermute_llama
    from dflash_gguf.target_gguf import open_gguf

    data = load_data(tiny)
    trainer = Trainer(replace(tiny, out=Path(tiny.out) / "init", init_from_target=True), data, progress=False)
    m = trainer.model
    reader = open_gguf(Path(tiny.target))
    n = m.cfg.num_target_layers
    np.testing.assert_array_equal(m.norm.weight.detach().numpy(), _read(reader, "output_norm.weight"))
    np.testing.assert_array_equal(m.layers[0].mlp.down_proj.weight.detach().numpy(), _read(reader, f"blk.{n - 1}.ffn_down.weight"))
    q = _read(reader, f"blk.{n - 1}.attn_q.weight")
    np.testing.assert_array_equal(m.layers[0].self_attn.q_proj.weight.detach().numpy(), unpermute_llama(q, m.cfg.num_attention_heads))
    # the inverse of convert_hf_to_gguf's permutation: permuting back gives the GGUF rows
    hf = m.layers[0].self_attn.q_proj.weight.detach().numpy()
    h = m.cfg.num_attention_heads
    again = hf.reshape(h, 2, hf.shape[0] // h // 2, hf.shape[1]).swapaxes(1, 2).reshape(hf.shape)
    np.testing.assert_array_equal(again, q)
    assert torch.equal(m.layers[0].self_attn.q_norm.weight, torch.ones_like(m.layers[0].self_attn.q_norm.weight))


def test_the_shipped_token_archive_belongs_to_the_embedded_target(embedded_target):
    from dflash_gguf.target_gguf import read_target_info

    path = Path(__file__).resolve().parents[1] / "data" / "SmolLM2-135M-Instruct-selfdistill.npz"
    archive = read_archive(path)
    assert archive.provenance["target_fingerprint"] == read_target_info(embedded_target).fingerprint
    train, held = archive.split("data"), archive.split("eval_data")
    assert len(train) >= 500 and len(held) == 24
    held_ids = {i for ids in archive.provenance["held_out_ids"].values() for i in ids}
    assert not held_ids & {s.id for s in train}  # nothing held out was trained on
    bench = {json.loads(line)["id"] for line in (Path(__file__).resolve().parents[1] / "dflash_gguf" / "data" / "bench_prompts.jsonl").read_text().splitlines() if line.strip()}
    assert not bench & {s.id for s in archive.sequences}
    for s in archive.sequences[:50]:
        assert 0 < s.response_start < len(s.tokens) <= 512
