"""The sampling surface through the speculative loop: penalties, logit_bias, min_p and logprobs, all lossless.

Greedy: speculative output equals plain (speculative=False) output token for token, with the random drafter
(every block rejected and rolled back), the embedded trained drafter (blocks accepted, so a later row's
penalty counts the drafts before it) and lookup; with penalties it also equals llama-cpp-python's own Llama.
Sampled (slow tier): χ² of the third token of 3-token replies drafted in blocks of 3 against the exact
penalised / biased distribution. logprobs: the target's log-softmax, as a plain evaluation computes it.
"""

from __future__ import annotations

from collections import Counter

import llama_cpp
import numpy as np
import pytest
from chi_square import chi_square_p_value

from dflash_gguf import Session, Target
from dflash_gguf.checks import SettingError
from dflash_gguf.sampling import SamplingParams, adjusted_logits, probabilities

N_CTX = 512
N = 24
PROMPTS = ["Write a list of fruits: apple, banana,", "def add(a, b):\n    return a + b\n\ndef sub(a, b):"]
GREEDY = [
    dict(repeat_penalty=1.5),
    dict(repeat_penalty=0.7, repeat_last_n=8),
    dict(frequency_penalty=1.0, presence_penalty=0.5),
    dict(presence_penalty=-0.5, repeat_last_n=-1),
    dict(logit_bias={28: -100.0, 30: 2.0}),  # "," all but banned, "." favoured
    dict(repeat_penalty=1.3, logit_bias={28: -1.5}, min_p=0.3),  # min_p changes no argmax
]


@pytest.fixture(scope="module")
def random_drafter(dflash_gguf_path):
    with Session(drafter=dflash_gguf_path, n_ctx=N_CTX, n_batch=64, n_threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def trained(embedded_target):
    with Session(n_ctx=N_CTX, n_batch=64, n_threads=1) as s:  # the embedded pair
        assert s.drafter is not None
        yield s


@pytest.fixture(scope="module")
def lookup(embedded_target):
    with Session(embedded_target, n_ctx=N_CTX, n_batch=64, n_threads=1) as s:
        assert s.lookup and s.drafter is None
        yield s


@pytest.fixture(scope="module")
def plain(embedded_target):
    """A separate plain Target: exact rows to compare with."""
    with Target.open(embedded_target, n_ctx=N_CTX, n_batch=64, n_threads=1) as t:
        yield t


def _greedy_cases() -> list:
    """Every setting with every source. The quick tier runs the trained drafter with each setting and lookup with
    two (a penalty, a bias); the slow tier adds the random drafter and lookup's other settings."""
    quick = {("trained", i) for i in range(len(GREEDY))} | {("lookup", 0), ("lookup", 4)}
    return [pytest.param(which, settings, id=f"{which}-{','.join(settings)}",
                         marks=() if (which, i) in quick else pytest.mark.slow)
            for which in ("random_drafter", "trained", "lookup") for i, settings in enumerate(GREEDY)]


@pytest.mark.parametrize("which, settings", _greedy_cases())
def test_greedy_speculative_equals_plain_with_each_setting(request, which, settings):
    s = request.getfixturevalue(which)
    drafted = accepted = 0
    for prompt in PROMPTS:
        want = s.generate(prompt, max_tokens=N, speculative=False, **settings)
        got = s.generate(prompt, max_tokens=N, block_size=5, **settings)
        assert got.tokens == want.tokens, (which, prompt)
        drafted, accepted = drafted + got.stats.n_drafted, accepted + got.stats.n_accepted
    assert drafted > 0
    if which == "trained":
        assert accepted > 0  # accepted drafts: later rows counted them


def test_the_settings_change_the_output(trained):
    """Each setting acts (else the equalities above prove nothing)."""
    base = trained.generate(PROMPTS[0], max_tokens=N, speculative=False).tokens
    for settings in GREEDY:
        assert trained.generate(PROMPTS[0], max_tokens=N, speculative=False, **settings).tokens != base, settings
    banned = trained.generate(PROMPTS[0], max_tokens=N, block_size=5, logit_bias={28: -float("inf")}).tokens
    assert 28 not in banned and 28 in base  # ","


def llama_penalised_greedy(path, prompt: str, n: int, **penalties) -> list[int]:
    """llama-cpp-python's own greedy decoding with its penalties sampler (last 64 sampled tokens)."""
    llm = llama_cpp.Llama(str(path), n_ctx=N_CTX, n_batch=64, n_threads=1, flash_attn=True, verbose=False)
    try:
        out = []
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        for tok in llm.generate(llm.tokenize(prompt.encode(), special=True), temp=0.0, **penalties):
            if llama_cpp.llama_vocab_is_eog(vocab, tok) or len(out) == n:
                break
            out.append(tok)
        return out
    finally:
        llm.close()


@pytest.mark.parametrize("penalties", [dict(repeat_penalty=1.5), dict(frequency_penalty=1.0, presence_penalty=0.5)])
def test_penalised_greedy_equals_llama_cpp_python(embedded_target, trained, penalties):
    want = llama_penalised_greedy(embedded_target, PROMPTS[0], N, **penalties)
    assert trained.generate(PROMPTS[0], max_tokens=N, block_size=5, **penalties).tokens == want


def test_greedy_with_penalties_under_a_grammar(trained):
    grammar = 'root ::= "[" item ("," item)* "]"\nitem ::= [a-z]+'
    settings = dict(grammar=grammar, repeat_penalty=1.4, max_tokens=24)
    want = trained.generate(PROMPTS[0], speculative=False, **settings)
    got = trained.generate(PROMPTS[0], block_size=5, **settings)
    assert got.tokens == want.tokens and got.text.startswith("[")


def test_logprobs_are_the_targets_log_softmax(trained, plain):
    r = trained.generate(PROMPTS[0], max_tokens=12, block_size=5, logprobs=3, repeat_penalty=1.3)
    assert len(r.logprobs) == len(r.tokens) and r.stats.n_accepted > 0
    prompt = plain.vocab.tokenize(PROMPTS[0])
    plain.clear()
    plain.decode(prompt + r.tokens[:-1], 0, logits=True)
    x = plain.output_logits()[len(prompt) - 1 :].astype(np.float64)
    rows = x - x.max(axis=1, keepdims=True)
    rows -= np.log(np.exp(rows).sum(axis=1, keepdims=True))  # the log-softmax, by hand
    for entry, token, row in zip(r.logprobs, r.tokens, rows):
        assert entry.token == token
        assert entry.logprob == pytest.approx(row[token], abs=2e-3)
        assert [t for t, _ in entry.top] == list(np.argsort(-row)[:3])
        assert [lp for _, lp in entry.top] == pytest.approx(sorted(row, reverse=True)[:3], abs=2e-3)
    again = trained.generate(PROMPTS[0], max_tokens=12, speculative=False, logprobs=3, repeat_penalty=1.3)
    assert again.tokens == r.tokens
    assert [e.logprob for e in again.logprobs] == pytest.approx([e.logprob for e in r.logprobs], abs=1e-4)
    assert trained.generate(PROMPTS[0], max_tokens=4).logprobs == ()


def test_llama_cpp_shaped_logprobs(trained):
    prompt = PROMPTS[0]
    out = trained.create_completion(prompt, max_tokens=6, temperature=0.0, logprobs=2)
    lp = out["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 6
    assert "".join(lp["tokens"]) == out["choices"][0]["text"]
    assert lp["text_offset"][0] == len(prompt)
    for token, value, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert top[token] == value and len(top) >= 2  # greedy: the chosen token is the likeliest
        assert value == max(top.values())
    chunks = list(trained.create_completion(prompt, max_tokens=6, temperature=0.0, logprobs=2, stream=True))
    streamed = [t for c in chunks if c["choices"][0]["logprobs"] for t in c["choices"][0]["logprobs"]["tokens"]]
    assert streamed == lp["tokens"]
    chat = trained.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=5, temperature=0.0,
                                          logprobs=True, top_logprobs=2)
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == chat["usage"]["completion_tokens"] and len(content[0]["top_logprobs"]) == 2
    assert trained.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=2)["choices"][0]["logprobs"] is None
    with pytest.raises(SettingError, match="top_logprobs"):
        trained.create_chat_completion([{"role": "user", "content": "Hi"}], max_tokens=2, top_logprobs=2)


@pytest.mark.parametrize("settings, field", [
    (dict(repeat_penalty=0), "repeat_penalty"), (dict(min_p=2), "min_p"), (dict(logit_bias={"a": 1}), "logit_bias"),
    (dict(logit_bias={10**7: 1.0}), "logit_bias"), (dict(logprobs=-1), "logprobs"), (dict(repeat_last_n=-5), "repeat_last_n"),
])
def test_bad_settings_are_named(lookup, settings, field):
    with pytest.raises(SettingError, match=f"^{field}: "):
        lookup.generate(PROMPTS[0], max_tokens=2, **settings)


# -- sampled: the law of the third token -------------------------------------------------------
CHI_PROMPT = "The capital of France is"
ALPHA = 1e-3
NO_EOG = {0: -float("inf"), 2: -float("inf"), 4: -float("inf")}  # the embedded target's end-of-generation ids:
# every reply then has its 3 tokens, so conditioning on length 3 selects nothing
SAMPLED = [
    dict(temperature=1.0, top_k=8, repeat_penalty=2.0, presence_penalty=1.0, logit_bias=NO_EOG),
    dict(temperature=0.8, frequency_penalty=1.5, min_p=0.02, logit_bias={**NO_EOG, 198: 1.0}),
    dict(temperature=1.2, top_k=30, top_p=0.9, min_p=0.05, repeat_penalty=1.6, repeat_last_n=1, logit_bias=NO_EOG),
]


def exact_row(plain: Target, tokens: list[int], history: list[int], settings: dict) -> np.ndarray:
    params = SamplingParams(**settings)
    plain.clear()
    plain.decode(tokens, 0)
    row = adjusted_logits(plain.logits(len(tokens) - 1)[None], params, [params.window(history, N_CTX)])
    return probabilities(row, params)[0]


@pytest.mark.slow
@pytest.mark.parametrize("settings", SAMPLED, ids=lambda d: ",".join(d))
@pytest.mark.parametrize("which", ["random_drafter", "trained", "lookup"])
def test_sampled_third_token_follows_the_penalised_target(request, plain, which, settings):
    """Blocks of 3: the third token's row follows the second, drafted in the same block when the first was."""
    s = request.getfixturevalue(which)
    runs = [s.generate(CHI_PROMPT, max_tokens=3, seed=seed, block_size=3, **settings) for seed in range(300)]
    assert all(len(r.tokens) == 3 for r in runs)
    assert sum(r.stats.n_drafted for r in runs) > 0 or which == "lookup"
    prompt = plain.vocab.tokenize(CHI_PROMPT)
    first = [r.tokens[0] for r in runs]
    assert chi_square_p_value(first, exact_row(plain, prompt, [], settings)) > ALPHA
    head = Counter(tuple(r.tokens[:2]) for r in runs).most_common(1)[0][0]
    third = [r.tokens[2] for r in runs if tuple(r.tokens[:2]) == head]
    assert len(third) >= 60, (head, len(third))
    want = exact_row(plain, prompt + list(head), list(head), settings)
    assert chi_square_p_value(third, want) > ALPHA
    unpenalised = {k: v for k, v in settings.items() if k in ("temperature", "top_k", "top_p", "min_p", "logit_bias")}
    if settings.get("repeat_last_n", 64) > 1:  # a one-token window (".") penalises none of this row's candidates
        assert np.abs(want - exact_row(plain, prompt + list(head), [], unpenalised)).sum() > 0.01  # the history acted
