"""A request field declared once: the generation setting it sets, and how each protocol spells it.

Each `RequestField` names a GenerationConfig setting (where the field acts) and, per protocol (OpenAI
chat, OpenAI completions, Anthropic Messages, Responses), the field's own name, type and default with its
bounds. From `FIELDS` come each protocol's request-model fields (`declared`), the settings a request gives
(`settings_of`), and the rename table that names a refused setting by the request's own field
(`renames`, read by errors.Terms). Adding a sampling field on every API is one line in FIELDS.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from pydantic import BaseModel, Field, create_model
from pydantic.fields import FieldInfo

PROTOCOLS = ("chat", "completions", "anthropic", "responses")
KEEP = object()  # a setting left at the server's default


@dataclass(frozen=True)
class Spelling:
    """How one protocol writes a field: its name in the request, its type, and its pydantic Field (default, bounds)."""

    name: str
    annotation: Any
    info: FieldInfo = field(default_factory=lambda: Field(default=None))


@dataclass(frozen=True)
class RequestField:
    """One generation setting as the APIs take it. `absent`: the setting where a protocol has no such field
    or the request leaves it null (KEEP: the server's default)."""

    setting: str
    spellings: Mapping[str, Spelling]
    absent: Any = KEEP

    def __post_init__(self) -> None:
        unknown = set(self.spellings) - set(PROTOCOLS)
        if unknown:  # a misspelt protocol would leave its field undeclared without a word
            raise ValueError(f"{self.setting}: no protocol {sorted(unknown)[0]!r}; the protocols are {PROTOCOLS}")

    def setting_of(self, request: BaseModel, protocol: str) -> Any:
        spelling = self.spellings.get(protocol)
        value = None if spelling is None else getattr(request, spelling.name)
        return self.absent if value is None else value


def openai(name: str, annotation: Any, info: FieldInfo) -> dict[str, Spelling]:
    """The same spelling on both OpenAI endpoints (chat and completions)."""
    return {p: Spelling(name, annotation, info) for p in ("chat", "completions")}


# the sampling fields, bounded where the Session's sampler is; OpenAI's min_p and repeat_penalty default to
# off, as OpenAI clients expect, not to llama_cpp.server's 0.05 and 1.1
FIELDS: tuple[RequestField, ...] = (
    RequestField("temperature", {**openai("temperature", float, Field(default=0.8, ge=0.0, le=2.0)),
                                 "anthropic": Spelling("temperature", float, Field(default=1.0, ge=0.0, le=1.0)),
                                 "responses": Spelling("temperature", float, Field(default=1.0, ge=0.0, le=2.0))}),
    RequestField("top_p", {**openai("top_p", float, Field(default=0.95, ge=0.0, le=1.0)),
                           "anthropic": Spelling("top_p", Optional[float], Field(default=None, gt=0.0, le=1.0)),
                           "responses": Spelling("top_p", float, Field(default=1.0, gt=0.0, le=1.0))}, absent=1.0),
    RequestField("top_k", {**openai("top_k", int, Field(default=40, ge=0)),
                           "anthropic": Spelling("top_k", Optional[int], Field(default=None, ge=0))}, absent=0),
    RequestField("seed", openai("seed", Optional[int], Field(default=None)), absent=None),
    RequestField("min_p", openai("min_p", float, Field(default=0.0, ge=0.0, le=1.0))),
    RequestField("repeat_penalty", openai("repeat_penalty", float, Field(default=1.0, gt=0.0))),
    # llama.cpp's: the last n reply tokens count; -1 = all, 0 = off
    RequestField("repeat_last_n", openai("repeat_last_n", int, Field(default=64, ge=-1))),
)


def declared(base: type[BaseModel], protocol: str) -> type[BaseModel]:
    """`base` with every field FIELDS spells for `protocol` (a subclass of the same name)."""
    spelled = {f.spellings[protocol].name: (f.spellings[protocol].annotation, f.spellings[protocol].info)
               for f in FIELDS if protocol in f.spellings}
    return create_model(base.__name__, __base__=base, __module__=base.__module__, __doc__=base.__doc__, **spelled)


def settings_of(request: BaseModel, protocol: str) -> dict[str, Any]:
    """The generation settings a request gives through FIELDS (settings it leaves to the server left out)."""
    out = {f.setting: f.setting_of(request, protocol) for f in FIELDS}
    return {name: value for name, value in out.items() if value is not KEEP}


def renames(protocol: str) -> dict[str, str]:
    """Setting name -> the protocol's field, where they differ: a refused setting named in the request's terms."""
    return {f.setting: f.spellings[protocol].name for f in FIELDS
            if protocol in f.spellings and f.spellings[protocol].name != f.setting}
