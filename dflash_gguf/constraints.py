"""Constrained decoding: a GBNF grammar, a JSON schema or a regex, as a token mask per position.

Built on llguidance, the matcher llama.cpp, vLLM and SGLang use: it compiles a grammar lazily against the
target's vocabulary, computes a mask in microseconds, rolls back tokens, and tells which tokens the grammar
forces. That is all a speculative loop needs: a verify batch masks each of its rows with the state after
the drafts before it, a draft the grammar forbids ends the block, and only committed tokens advance the
matcher. Under the mask, greedy output equals plain constrained decoding and sampling follows the
constrained target distribution.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Sequence

import llguidance
import numpy as np

from .checks import nesting_depth
from .sampling import SamplingParams
from .sources import Candidate, Commit, DraftSource, Offer

# what a GenerationConfig may carry, each compiled by llguidance's own front end
KINDS = ("grammar", "json_schema", "regex")
# The blank space a JSON reply may put between its tokens: one space, or one or two line breaks and an indent of
# up to 20 (upstream llama.cpp's json-schema-to-grammar SPACE_RULE). llguidance's default admits any run of it,
# in which a small sampled model can loop until max_tokens. A schema's own x-guidance options come first.
JSON_WHITESPACE = r"( |\n{1,2}[ \t]{0,20})?"
# llguidance refuses a JSON schema nested deeper than this (and Python's json module recurses on its way there)
MAX_SCHEMA_DEPTH = 128


class ConstraintError(ValueError):
    """The grammar, schema or regex does not compile, or the model reached a state the grammar rejects."""


def _json_defaults(spec: Any) -> dict[str, Any]:
    """The compile options a schema gets unless it says otherwise: the bounded blank space, where its own
    x-guidance sets no whitespace option (llguidance's pattern would outrank a schema's whitespace_flexible)."""
    own = spec.get("x-guidance") if isinstance(spec, dict) else None
    if isinstance(own, dict) and ("whitespace_pattern" in own or "whitespace_flexible" in own):
        return {}
    return {"whitespace_pattern": JSON_WHITESPACE}


def json_rule(schema: str) -> str:
    """A JSON schema's text as a Lark `%json` rule body, with the options compile_grammar gives a json_schema
    constraint (the bounded blank space, unless the schema sets its own)."""
    spec = json.loads(schema)
    defaults = _json_defaults(spec)
    if defaults:
        own = spec.get("x-guidance")
        spec["x-guidance"] = {**defaults, **own} if isinstance(own, dict) else defaults
    return "%json " + json.dumps(spec, separators=(",", ":"))


def schema_text(schema: Any) -> str:
    """A JSON schema (a dict, or JSON text of an object) as compact JSON text, its key order kept (the order
    of `properties` is the order the reply writes them in)."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as e:
            raise ValueError(f"not valid JSON: {e}") from None
    if not isinstance(schema, dict):
        raise TypeError(f"must be a JSON schema object (a dict or its JSON text), got {type(schema).__name__}")
    check_schema_depth(schema)
    return json.dumps(schema, separators=(",", ":"))


def check_schema_depth(schema: Any) -> None:
    """ValueError for a schema nested deeper than llguidance takes, before anything recurses into it."""
    if nesting_depth(schema) > MAX_SCHEMA_DEPTH:
        raise ValueError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels (the grammar engine's limit)")


@lru_cache(maxsize=64)
def compile_grammar(kind: str, source: str) -> str:
    """llguidance's grammar definition for a GBNF (or Lark) grammar, a JSON schema's text or a regex; ValueError
    if it does not compile. Checked without a vocabulary, so a config is validated before any model loads."""
    try:
        if kind == "grammar":
            grammar = llguidance.grammar_from("grammar", source)
        elif kind == "json_schema":
            grammar = llguidance.LLMatcher.grammar_from_json_schema(source, defaults=_json_defaults(json.loads(source)))
        elif kind == "regex":
            grammar = llguidance.LLMatcher.grammar_from_regex(source)
        else:
            raise ValueError(f"unknown constraint kind {kind!r}: one of {', '.join(KINDS)}")
    except Exception as e:  # noqa: BLE001 - the front ends raise their own types for bad input; one line each
        raise ValueError(str(e).splitlines()[0] if str(e) else type(e).__name__) from None
    error = llguidance.LLMatcher.validate_grammar(grammar, None)
    if error:
        raise ValueError(error.splitlines()[0])
    return grammar


@dataclass(frozen=True)
class ConstraintSpec:
    """Which constraint a generation carries: kind and source, compiled once when the config is built."""

    kind: str
    grammar: str  # llguidance's definition, from compile_grammar


class Constraint:
    """One generation's matcher over the target's vocabulary; it holds exactly the committed tokens."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, spec: ConstraintSpec, n_vocab: int) -> None:
        self._matcher = llguidance.LLMatcher(tokenizer, spec.grammar, log_level=0)
        self._check()
        self._n_vocab = n_vocab
        self._words = (tokenizer.vocab_size + 31) // 32

    def _check(self) -> None:
        if self._matcher.is_error():
            raise ConstraintError(f"constraint: {self._matcher.get_error().splitlines()[0]}")

    def probe(self) -> None:
        """ConstraintError where the grammar fails before its first token is chosen: a language with no finite
        word (`root ::= "a" root`, a schema that is only a reference to itself), which llguidance finds only
        once it computes a mask or what the grammar forces. A server calls it on a fresh matcher before it takes
        a request, so such a grammar is refused up front, not during the generation. The matcher is spent."""
        self.allowed()
        self._check()
        forced = self.forced()
        self._check()
        if forced:
            self.commit(forced[:1])
            self._check()

    def allowed(self) -> np.ndarray:
        """(n_vocab,) bool: the tokens the grammar admits next."""
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self._n_vocab].astype(bool)

    def valid_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading drafts the grammar admits; the matcher is left as it was."""
        return self._matcher.validate_tokens(list(map(int, drafts)))

    def mask_block(self, logits: np.ndarray, drafts: Sequence[int]) -> np.ndarray:
        """A copy of a verify block's logits (k+1, V), row i masked with the state after drafts[:i].

        Rows after the first draft the grammar forbids are left unmasked: that draft is rejected (its
        target probability is 0 under its row's mask), so no row after it is read.
        """
        out = np.array(logits, dtype=np.float32)
        n_ok = self.valid_prefix(drafts)
        for i in range(min(n_ok + 1, out.shape[0])):
            out[i, ~self.allowed()] = -np.inf
            if i < n_ok:
                self._matcher.consume_token(int(drafts[i]))
        self._check()
        if n_ok:
            self._matcher.rollback(n_ok)
        return out

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance past committed tokens (each chosen under the mask, so each is admitted). Once the grammar
        is complete the mask admits only an end-of-generation token, which ends the reply: nothing to consume."""
        for token in tokens:
            if self._matcher.is_stopped():
                return
            if not self._matcher.consume_token(int(token)):
                error = self._matcher.get_error().splitlines()[0]
                raise ConstraintError(f"constraint: a committed token was refused ({error})")

    def forced(self) -> list[int]:
        """The tokens the grammar admits as the only continuation from here (none: a choice remains)."""
        return list(self._matcher.compute_ff_tokens())

    @property
    def finished(self) -> bool:
        """The grammar admits nothing more (not even an end-of-generation token)."""
        return self._matcher.is_stopped()


class ForcedTokenSource(DraftSource):
    """The tokens a constraint leaves no choice about (a schema's keys and punctuation, closing brackets), as
    drafts that cost no drafter pass. Under the mask each is the target's only admitted token, so each is
    accepted: its offer expects every drafted token to commit. One per generation, beside the Session's own."""

    name = "grammar"

    def __init__(self, constraint: Constraint, max_draft: int) -> None:
        self._constraint = constraint
        self.max_draft = max_draft
        self._forced: list[int] | None = None  # computed once per state: available() and propose() share it

    def cached(self) -> int:
        return 1 << 62  # it holds no positions: whatever prefix the others reuse

    def truncate(self, n: int) -> None:
        self._forced = None

    def available(self, last: int, n_past: int) -> int:
        if self._forced is None:
            self._forced = self._constraint.forced()[: self.max_draft]
        return len(self._forced)

    def offer(self, last: int, n_past: int, n_max: int) -> Offer:
        return Offer(self.name, n_max, [float(n + 1) for n in range(n_max + 1)])

    def propose(self, last: int, n_past: int, n_draft: int, params: SamplingParams,
                rng: np.random.Generator) -> Candidate:
        self.available(last, n_past)
        return Candidate(self.name, np.asarray(self._forced[:n_draft], dtype=np.int64), point_mass=True)

    def observe(self, commit: Commit) -> None:
        self._forced = None  # the matcher moved on with the commit
