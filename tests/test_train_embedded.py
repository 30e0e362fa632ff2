"""The shipped default drafter: made for the embedded target, small, used by Session(), and trained."""

from __future__ import annotations

import json
from pathlib import Path

from dflash_gguf.convert import drafter_info
from dflash_gguf.defaults import embedded_drafter, embedded_target
from dflash_gguf.target_gguf import read_target_info

BENCH_PROMPTS = Path(__file__).resolve().parents[1] / "dflash_gguf" / "data" / "bench_prompts.jsonl"


def test_embedded_drafter_is_a_small_dflash_gguf_for_the_embedded_target():
    path = embedded_drafter()
    info = drafter_info(path)
    assert info.kind == "dflash" and info.block_size == 16 and info.mask_token_id == 16
    assert info.target_layers == [2, 9, 15, 21, 28]
    assert info.fingerprint == read_target_info(embedded_target()).fingerprint
    assert path.stat().st_size < 40 * 2**20


def test_session_defaults_to_it_and_its_drafts_are_accepted():
    from dflash_gguf.session import Session

    # a benchmark prompt: held out of training (dflash-train --hold-out)
    prompt = json.loads(BENCH_PROMPTS.read_text().splitlines()[0])["prompt"]
    messages = [{"role": "user", "content": prompt}]
    with Session(n_ctx=1024, n_threads=1) as s:
        assert s.drafter is not None
        r = s.chat(messages, max_tokens=48, temperature=0.0, block_size=16)
    assert len(r.tokens) == 48 and r.stats.speculative
    # an untrained drafter is accepted almost never (τ = 1.0); the shipped one is
    assert r.stats.n_accepted > 0 and r.stats.acceptance_length > 1.1
