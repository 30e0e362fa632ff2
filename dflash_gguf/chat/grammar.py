"""Lark grammars for llguidance built from rules, never by editing grammar text.

A LarkGrammar is the grammar's text (a str, so it goes wherever a grammar goes: GenerationConfig.grammar,
compile_grammar) that remembers the rules it was built from: the body of its `start` rule and the others. So
a grammar can be put after a thought (reasoning.Thinking.constrain_after) by adding rules and renaming the
start, and a tool-call family writes its grammar as a start rule, its calls, a lazy trigger and its lexemes.
"""

from __future__ import annotations

from typing import Sequence

HEADER = "%llguidance {}"


class LarkGrammar(str):
    """`%llguidance {}`, `start: <start>`, then each rule (`name: body`, `NAME: /regex/`), one a line."""

    start: str
    rules: tuple[str, ...]

    def __new__(cls, start: str, rules: Sequence[str] = ()) -> "LarkGrammar":
        self = super().__new__(cls, "\n".join([HEADER, f"start: {start}", *rules, ""]))
        self.start, self.rules = start, tuple(rules)
        return self

    def __reduce__(self) -> tuple:  # pickled (a config sent to the chat's worker process) as its rules
        return LarkGrammar, (self.start, self.rules)

    def renamed_start(self, name: str, start: str, rules: Sequence[str] = ()) -> "LarkGrammar":
        """This grammar under a new start rule: its own start becomes rule `name`, after the new `rules`."""
        return LarkGrammar(start, [*rules, f"{name}: {self.start}", *self.rules])
