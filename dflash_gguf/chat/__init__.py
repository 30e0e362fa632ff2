"""The chat floor: text work above the token loop, and never a call into C.

A ChatTemplate (its tool-call family, thinking markers and what it does with late system messages, learned
once), a typed ChatRequest, one prepare_turn that turns them into a Turn (prompt tokens, the config, a reply
reader), and the reader itself. Below it the core floor (target, sources, the loop) sees only tokens and a
config; above it the server, the terminal chat and the benchmark (docs/DESIGN.md, "Floors").
"""

from .reply import ReplyReader
from .request import ChatRequest
from .template import ChatTemplate
from .turn import Turn, Vocabulary, prepare_turn, turn_config

__all__ = ["ChatRequest", "ChatTemplate", "ReplyReader", "Turn", "Vocabulary", "prepare_turn", "turn_config"]
