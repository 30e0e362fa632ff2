"""The sampling chain against llama.cpp's own samplers, run through llama-cpp-python's bindings.

llama-cpp-python's Llama builds penalties -> top-k -> typical -> top-p -> min-p -> temperature -> dist
(Llama._init_sampler) and adds logit_bias before them; the same chain is built here from its LlamaSampler,
fed the same history through accept(), applied to random logits, and its survivors' softmax compared with
probabilities(adjusted_logits(...)). Greedy compares the argmax after bias and penalties.
"""

from __future__ import annotations

import ctypes
import math

import llama_cpp
import numpy as np
import pytest
from llama_cpp import _internals

from dflash_gguf.checks import SettingError
from dflash_gguf.sampling import SamplingParams, adjusted_logits, greedy_tokens, probabilities, token_logprobs

V = 4096


def llama_chain(params: SamplingParams, history: list[int]) -> _internals.LlamaSampler:
    """llama-cpp-python's chain for these params (Llama._init_sampler's order), history accepted."""
    s = _internals.LlamaSampler()
    if params.logit_bias:
        biases = (llama_cpp.llama_logit_bias * len(params.logit_bias))(
            *[llama_cpp.llama_logit_bias(t, b) for t, b in params.logit_bias])
        llama_cpp.llama_sampler_chain_add(s.sampler, llama_cpp.llama_sampler_init_logit_bias(V, len(biases), biases))
    # llama.cpp's C sampler takes -1 as 0 (off); its command line turns -1 into the context size
    last_n = params.repeat_last_n if params.repeat_last_n >= 0 else len(history)
    s.add_penalties(V, last_n, params.repeat_penalty, params.frequency_penalty, params.presence_penalty)
    if not params.greedy:
        s.add_top_k(params.top_k)
        s.add_typical(1.0, 1)
        s.add_top_p(params.top_p, 1)
        s.add_min_p(params.min_p, 1)
        s.add_temp(params.temperature)
    for t in history:
        llama_cpp.llama_sampler_accept(s.sampler, t)
    return s


def llama_apply(params: SamplingParams, history: list[int], logits: np.ndarray) -> np.ndarray:
    """What llama.cpp's chain leaves of one row: the candidates' final logits, -inf for the cut ones."""
    chain = llama_chain(params, history)
    data = (llama_cpp.llama_token_data * V)(*[llama_cpp.llama_token_data(i, float(x), 0.0) for i, x in enumerate(logits)])
    arr = llama_cpp.llama_token_data_array(data=data, size=V, selected=-1, sorted=False)
    llama_cpp.llama_sampler_apply(chain.sampler, ctypes.byref(arr))
    out = np.full(V, -np.inf)
    for i in range(arr.size):
        out[arr.data[i].id] = arr.data[i].logit
    chain.close()
    return out


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def ours(params: SamplingParams, history: list[int], logits: np.ndarray) -> np.ndarray:
    row = adjusted_logits(logits[None], params, [params.window(history, 1 << 20)])
    return row if params.greedy else probabilities(row, params)


HISTORY = [5, 9, 9, 17, 3, 9, 200, 5, 4000, 17, 17, 17, 1, 2, 3, 4, 5, 6, 7, 8]
CASES = [
    SamplingParams(temperature=1.0, repeat_penalty=1.3),
    SamplingParams(temperature=0.7, repeat_penalty=0.8, frequency_penalty=0.4, presence_penalty=-0.3),
    SamplingParams(temperature=0.8, repeat_penalty=1.2, repeat_last_n=5),  # only the last 5 count
    SamplingParams(temperature=0.5, top_p=0.9, min_p=0.05),  # top-p and min-p judge the untempered distribution
    SamplingParams(temperature=1.7, top_p=0.6),
    SamplingParams(temperature=2.0, top_k=50, top_p=0.8, min_p=0.1, frequency_penalty=1.5),
    SamplingParams(temperature=0.9, min_p=0.2, logit_bias=((9, 5.0), (17, -math.inf), (3000, -2.5))),
    SamplingParams(temperature=1.1, top_k=40, top_p=0.95, min_p=0.05, repeat_penalty=1.1, repeat_last_n=-1),
]


@pytest.mark.parametrize("params", CASES)
def test_the_chain_matches_llama_cpp(params):
    rng = np.random.default_rng(7)
    for scale in (1.0, 4.0):
        logits = (rng.standard_normal(V) * scale).astype(np.float32)
        logits[HISTORY[:6]] += 3.0  # repeated tokens among the likely ones, so the penalties matter
        expected_logits = llama_apply(params, HISTORY, logits)
        kept = np.isfinite(expected_logits)
        expected = np.zeros(V)
        expected[kept] = softmax(expected_logits[kept])
        got = ours(params, HISTORY, logits)[0]
        np.testing.assert_array_equal(got > 0, kept)
        np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-12)


@pytest.mark.parametrize("params", [
    SamplingParams(repeat_penalty=1.5),
    SamplingParams(frequency_penalty=2.0, presence_penalty=1.0, repeat_last_n=8),
    SamplingParams(logit_bias=((8, -100.0),), repeat_penalty=1.1),
])
def test_greedy_takes_the_argmax_after_bias_and_penalties(params):
    rng = np.random.default_rng(3)
    for _ in range(20):
        logits = (rng.standard_normal(V) * 2).astype(np.float32)
        logits[8] = logits.max() + 0.3  # the raw argmax is the last token of the history
        final = llama_apply(params, HISTORY, logits)
        assert int(greedy_tokens(ours(params, HISTORY, logits))[0]) == int(np.argmax(final))
        assert int(np.argmax(final)) != 8


def test_penalties_change_only_the_window_and_leave_the_input_alone():
    logits = np.array([[2.0, -1.0, 0.5, 3.0]], dtype=np.float32)
    params = SamplingParams(repeat_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25, repeat_last_n=3)
    out = adjusted_logits(logits, params, [params.window([3, 0, 1, 1], 100)])  # window [0, 1, 1]
    np.testing.assert_allclose(out, [[2.0 / 2 - 0.75, -1.0 * 2 - 1.25, 0.5, 3.0]])
    np.testing.assert_array_equal(logits, [[2.0, -1.0, 0.5, 3.0]])
    assert adjusted_logits(logits, SamplingParams(), [[0]]) is logits  # nothing to do: no copy


def test_window_semantics_follow_repeat_last_n():
    h = list(range(10))
    assert list(SamplingParams(repeat_last_n=3).window(h, 100)) == [7, 8, 9]
    assert list(SamplingParams(repeat_last_n=0).window(h, 100)) == []
    assert list(SamplingParams(repeat_last_n=-1).window(h, 4)) == [6, 7, 8, 9]
    assert not SamplingParams(repeat_last_n=0, repeat_penalty=1.5).penalizes
    assert not SamplingParams(repeat_penalty=1.0).penalizes


@pytest.mark.parametrize(("field", "value"), [
    ("min_p", -0.1), ("min_p", 1.5), ("repeat_penalty", 0.0), ("repeat_penalty", math.inf),
    ("repeat_last_n", -2), ("presence_penalty", math.nan), ("frequency_penalty", "1"),
    ("logit_bias", {"x": 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {3: math.inf}), ("logit_bias", [1, 2]),
])
def test_bad_values_are_named(field, value):
    with pytest.raises(SettingError, match=f"^{field}: "):
        SamplingParams(**{field: value})


def test_logit_bias_is_normalised_and_checked_against_the_vocabulary():
    p = SamplingParams(logit_bias={"7": 1, 3: -math.inf})
    assert p.logit_bias == ((3, -math.inf), (7, 1.0))
    assert SamplingParams(logit_bias=p.logit_bias) == p
    p.check_vocab(8)
    with pytest.raises(SettingError, match="^logit_bias: token id 7 is outside the vocabulary of 7"):
        p.check_vocab(7)


def test_logprobs_are_the_log_softmax_with_the_likeliest_first():
    logits = np.log(np.array([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])) + 7.0
    [(chosen, top), (other, _)] = token_logprobs(logits, [1, 1], 2)
    assert chosen == pytest.approx(math.log(0.2)) and other == pytest.approx(math.log(0.3))
    assert [t for t, _ in top] == [3, 2] and top[0][1] == pytest.approx(math.log(0.4))
    assert token_logprobs(logits, [0], 0) == [(pytest.approx(math.log(0.1)), ())]  # rows past the tokens: unread
    big = np.random.default_rng(0).standard_normal((3, 49152)).astype(np.float32) * 5
    want = torch_log_softmax(big)
    for i, (lp, top) in enumerate(token_logprobs(big, [0, 1, 2], 5)):
        assert lp == pytest.approx(want[i, i], abs=1e-5)
        assert [t for t, _ in top] == list(np.argsort(-want[i])[:5])


def torch_log_softmax(x: np.ndarray) -> np.ndarray:
    import torch

    return torch.log_softmax(torch.from_numpy(x).double(), dim=-1).numpy()
