"""dflash-train's data stage on a hybrid (recurrent + attention) target (issue 10).

Generation decodes several sequences per batch and only ever clears whole sequences, so a hybrid
target needs no rollback. What it must still get right is the features: the cache has to hold what a
fresh Target capture of the same tokens gives, and the responses must be the target's own greedy ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dflash_gguf.target import Target
from dflash_gguf.train.config import TrainConfig
from dflash_gguf.train.data import FeatureCache
from dflash_gguf.train.pipeline import run

from hybrid_fixtures import HIDDEN

pytestmark = pytest.mark.slow  # data capture on the hybrid targets, which upstream's converter builds first

PROMPTS = [
    ("m0", "math", "What is 12 times 7?"),
    ("m1", "math", "Tom has 3 apples and buys 5 more."),
    ("h0", "chat", "Say hello to a new friend."),
    ("h1", "chat", "Name three colours."),
]


@pytest.mark.parametrize("arch", ["qwen35", "lfm2"])
def test_data_stage_on_a_hybrid_target_caches_what_a_fresh_capture_gives(hybrid_models, tmp_path, arch):
    target = hybrid_models.target(arch)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "category": c, "prompt": p}) + "\n" for i, c, p in PROMPTS))
    cfg = TrainConfig(
        target=target, prompts=prompts, out=tmp_path / "run", test_per_category=1, eval_prompts_per_category=1,
        max_new_tokens=8, max_seq_len=96, parallel=2, threads=1, target_layer_ids=[0, 2],
    )
    run(cfg, stage="data", progress=False)
    n_checked = 0
    with Target.open(target, n_ctx=128, n_batch=128, n_threads=1) as fresh:
        for name in ("data", "eval_data"):
            cache = FeatureCache.open(Path(cfg.out) / name)
            assert cache.manifest.n_embd == HIDDEN and cache.records
            fresh.capture(cache.manifest.target_layers)
            for r in cache.records:
                tokens, feats = cache.load(r)
                assert r.n_tokens > r.response_start  # a response was generated
                fresh.clear()
                fresh.decode(tokens[:-1], 0, logits=True)
                want = fresh.features(len(tokens) - 1)
                got = np.asarray(feats, dtype=np.float32)
                assert got.shape == want.shape
                # fp16 storage, and generation decoded the response a token at a time beside other sequences
                np.testing.assert_allclose(got, want, rtol=2e-2, atol=2e-2 * np.abs(want).max())
                ids, _ = cache.load_topk(r)
                greedy = fresh.output_logits()[r.response_start - 1 :].argmax(axis=1)
                assert (ids[r.response_start - 1 :, 0] == tokens[r.response_start :]).all()
                # the cached response is the target's greedy continuation (ties aside: random tiny weights)
                assert np.mean(greedy == tokens[r.response_start :]) >= 0.75
                n_checked += 1
    assert n_checked == 4
