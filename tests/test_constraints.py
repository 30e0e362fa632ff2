"""Constrained decoding on the embedded pair: grammars, JSON schemas and regexes, lossless under speculation.

Greedy: every speculative mode (DFlash fixed and adaptive, lookup) gives exactly the tokens of plain
constrained decoding of the same target, and the reply parses and validates. Sampled: the reply still
follows the constraint, and the first token's frequencies follow the masked target distribution (χ²).
"""

from __future__ import annotations

import json
import warnings
from collections import Counter

import jsonschema
import numpy as np
import pytest

from chi_square import chi_square_p_value

from dflash_gguf import GenerationConfig, Session, SettingError
from dflash_gguf.constraints import Constraint
from dflash_gguf.sampling import SamplingParams, probabilities
from dflash_gguf.steps import TokenSource

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
CAPITAL = "The capital of France is"
ASK = [{"role": "user", "content": "Give me a JSON object describing a person named Anna, 31, from Oslo."}]


@pytest.fixture(scope="module")
def pair():
    with Session(n_ctx=1024, n_threads=1) as s:
        yield s


@pytest.fixture(scope="module")
def lookup_only(embedded_target):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with Session(embedded_target, n_ctx=1024, n_threads=1) as s:
            yield s


@pytest.fixture(scope="module")
def plain_person(pair):
    return pair.chat(ASK, max_tokens=64, json_schema=PERSON, speculative=False)


def test_a_schema_reply_parses_and_validates(plain_person):
    assert plain_person.finish_reason == "stop"
    jsonschema.validate(json.loads(plain_person.text), PERSON)


@pytest.mark.parametrize("block_size", [4, 16, None], ids=["block4", "block16", "adaptive"])
def test_speculative_schema_decoding_equals_plain_constrained_decoding(pair, plain_person, block_size):
    r = pair.chat(ASK, max_tokens=64, json_schema=PERSON, block_size=block_size)
    assert r.tokens == plain_person.tokens
    if block_size is not None:
        assert r.stats.n_drafted > 0  # the drafter ran under the constraint, and its drafts were judged


@pytest.mark.parametrize("block_size", [4, None], ids=["block4", "adaptive"])
def test_what_the_schema_forces_is_drafted_for_free_and_commits(pair, plain_person, block_size):
    """The keys and punctuation the schema fixes come from the grammar source, every one accepted. A fixed
    block drafts them first; the adaptive policy prices them against the drafter's block with the measured
    verify costs (where a long verify costs little, as on a GPU or a busy CPU's noisy timings, the drafter's
    block may be worth more), so there only the cycles it gave them are checked."""
    steps = list(pair.stream_chat(ASK, max_tokens=64, json_schema=PERSON, block_size=block_size))
    assert [t for s in steps for t in s.tokens] == plain_person.tokens
    forced = [s for s in steps if s.source == "grammar"]
    assert all(s.n_accepted == s.n_drafted for s in forced)
    assert pair.last_stats.tokens_by_provenance.get("grammar", 0) >= sum(s.n_accepted for s in forced)
    if block_size is not None:
        assert forced and TokenSource.GRAMMAR in {p for s in forced for p in s.provenance}
        assert sum(s.n_accepted for s in forced) > 0


def test_forced_drafts_off_leaves_the_drafting_to_the_other_sources(pair, plain_person):
    r = pair.chat(ASK, max_tokens=64, json_schema=PERSON, block_size=4, forced_drafts=False)
    assert r.tokens == plain_person.tokens
    assert "grammar" not in r.stats.per_source and r.stats.tokens_by_provenance.get("grammar", 0) == 0
    assert r.stats.n_drafted > 0  # the drafter still drafts, under the constraint


def test_lookup_under_a_schema_equals_plain_constrained_decoding(lookup_only, plain_person):
    r = lookup_only.chat(ASK, max_tokens=64, json_schema=PERSON, block_size=4)
    assert r.tokens == plain_person.tokens


@pytest.mark.parametrize("kind, source, check", [
    ("grammar", 'root ::= "yes" | "no"', lambda t: t in ("yes", "no")),
    ("regex", r" [0-9]{4}\.", lambda t: len(t) == 6 and t[1:5].isdigit() and t.endswith(".")),
])
def test_grammars_and_regexes_hold_under_speculation(pair, kind, source, check):
    prompt = "Is the sky blue? Answer yes or no." if kind == "grammar" else "The year is"
    plain = pair.generate(prompt, max_tokens=12, speculative=False, **{kind: source})
    fast = pair.generate(prompt, max_tokens=12, block_size=4, **{kind: source})
    assert check(plain.text) and fast.tokens == plain.tokens and plain.finish_reason == "stop"


def test_sampled_replies_follow_the_schema(pair):
    for seed in range(3):
        r = pair.chat(ASK, max_tokens=64, json_schema=PERSON, temperature=1.0, seed=seed, block_size=4)
        jsonschema.validate(json.loads(r.text), PERSON)


@pytest.mark.slow
def test_sampling_follows_the_masked_target_distribution(pair):
    """A regex-constrained reply sampled speculatively: the second token, which goes through a drafted block
    and rejection sampling against the drafter's q, follows the target's probabilities renormalised over
    what the regex admits after the first (χ²)."""
    regex = r" [A-Za-z]+( [A-Za-z]+)*\."
    prompt = pair.tokenize(CAPITAL)
    params = SamplingParams(temperature=1.0)
    pairs = []
    for seed in range(200):
        # three tokens at most: the cycle after the prefill has room for one draft, which decides the second
        r = pair.generate(CAPITAL, max_tokens=3, regex=regex, temperature=1.0, seed=seed, block_size=4)
        assert len(r.tokens) >= 2
        pairs.append(tuple(r.tokens[:2]))
    assert pair.last_stats.n_drafted > 0
    first = Counter(p[0] for p in pairs).most_common(1)[0][0]
    second = [p[1] for p in pairs if p[0] == first]
    constraint = Constraint(pair.target.vocab.constraint_tokenizer(), GenerationConfig(regex=regex).constraint,
                            pair.target.n_vocab)
    constraint.commit([first])
    pair.reset()
    pair.target.decode(prompt + [first], 0, logits="last")
    exact = probabilities(constraint.mask_block(pair.target.output_logits()[-1:], ()), params)[0]
    pair.reset()
    assert len(second) >= 40 and chi_square_p_value(second, exact) > 1e-3


@pytest.mark.parametrize("kwargs, field", [
    (dict(grammar="root ::= (("), "grammar"),
    (dict(regex="a(("), "regex"),
    (dict(json_schema="{not json"), "json_schema"),
    (dict(json_schema=PERSON, regex="a"), "regex"),
])
def test_a_bad_constraint_is_refused_before_anything_runs(pair, kwargs, field):
    with pytest.raises(SettingError) as raised:
        pair.chat(ASK, max_tokens=4, **kwargs)
    assert raised.value.field == field


def test_masking_a_block_leaves_the_matcher_where_it_was(pair):
    spec = GenerationConfig(json_schema=PERSON).constraint
    c = Constraint(pair.target.vocab.constraint_tokenizer(), spec, pair.target.n_vocab)
    opening = pair.target.vocab.tokenize('{"name": "A', add_special=False, parse_special=False)
    before = c.allowed()
    logits = np.zeros((len(opening) + 1, pair.target.n_vocab), dtype=np.float32)
    masked = c.mask_block(logits, opening)
    assert np.array_equal(c.allowed(), before)
    assert np.array_equal(np.isfinite(masked[0]), before)  # row 0: the state before any draft
    assert c.valid_prefix(opening) == len(opening)
    c.commit(opening[:1])
    assert not np.array_equal(c.allowed(), before)


@pytest.mark.parametrize("source", ["json_schema", "thought"])
def test_a_json_reply_cannot_run_on_in_blank_space(pair, source):
    """Between a JSON reply's tokens: one space, or up to two line breaks and an indent of 20 (upstream's
    json-schema-to-grammar rule), never an endless run a sampled small model can loop in. The same bound holds
    for a schema that follows a thought (reasoning.json_answer)."""
    from dflash_gguf.constraints import ConstraintSpec, compile_grammar, schema_text
    from dflash_gguf.chat.reasoning import Thinking, json_answer

    if source == "json_schema":
        spec = GenerationConfig(json_schema=PERSON).constraint
        head = "{"
    else:
        thinking = Thinking("<think>", "</think>", opened=True)
        spec = ConstraintSpec("grammar", compile_grammar("grammar", thinking.constrain_after(json_answer(schema_text(PERSON)))))
        head = "Fine.</think>\n\n{"
    c = Constraint(pair.target.vocab.constraint_tokenizer(), spec, pair.target.n_vocab)
    tokenize = lambda text: pair.target.vocab.tokenize(text, add_special=False, parse_special=False)  # noqa: E731
    c.commit(tokenize(head + "\n\n" + " " * 20))
    assert c.valid_prefix(tokenize(" ")) == 0 and c.valid_prefix(tokenize("\n")) == 0
    assert c.valid_prefix(tokenize('"name"')) > 0


@pytest.mark.parametrize("source", ["json_schema", "thought"])
def test_a_schemas_own_whitespace_options_win(pair, source):
    """A schema that asks for compact JSON (x-guidance whitespace_flexible false) gets it on both paths; one
    whose x-guidance is not an object compiles as llguidance reads it, never a crash."""
    from dflash_gguf.constraints import ConstraintSpec, compile_grammar, schema_text
    from dflash_gguf.chat.reasoning import Thinking, json_answer

    def constraint(schema):
        if source == "json_schema":
            return GenerationConfig(json_schema=schema).constraint
        thinking = Thinking("<think>", "</think>", opened=True)
        return ConstraintSpec("grammar", compile_grammar("grammar", thinking.constrain_after(json_answer(schema_text(schema)))))

    c = Constraint(pair.target.vocab.constraint_tokenizer(), constraint({**PERSON, "x-guidance": {"whitespace_flexible": False}}),
                   pair.target.n_vocab)
    tokenize = lambda text: pair.target.vocab.tokenize(text, add_special=False, parse_special=False)  # noqa: E731
    c.commit(tokenize("{" if source == "json_schema" else "ok</think>{"))
    assert c.valid_prefix(tokenize(" ")) == 0 and c.valid_prefix(tokenize('"name"')) > 0
    assert constraint({**PERSON, "x-guidance": None}) is not None
