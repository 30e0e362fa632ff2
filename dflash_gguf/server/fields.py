"""A request field declared once: the generation setting it sets, and how each protocol spells it.

Each `RequestField` names a GenerationConfig setting (where the field acts) and, per protocol (OpenAI
chat, OpenAI completions, Anthropic Messages, Responses), the field's own name, type and default with its
bounds. From `FIELDS` come each protocol's request-model fields (`declared`), the settings a request gives
(`settings_of`), and the rename table that names a refused setting by the request's own field
(`renames`, read by errors.Terms). Adding a field on every API is one entry of FIELDS.

A protocol may take a field under several names (OpenAI chat's max_completion_tokens, then its older
max_tokens: `Spelling.also`), and a field may read the request's value its own way (`RequestField.read`:
OpenAI's stop string or list as a list, max_tokens 0 as "the server's"); a value it refuses is a
SettingError naming the request's own field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

from pydantic import BaseModel, Field, create_model
from pydantic.fields import FieldInfo

from ..checks import SettingError

PROTOCOLS = ("chat", "completions", "anthropic", "responses")
KEEP = object()  # a setting left at the server's default


@dataclass(frozen=True)
class Spelling:
    """How one protocol writes a field: its name in the request, its type, and its pydantic Field (default,
    bounds); `also`: the protocol's other names for it, read in order where this one is null."""

    name: str
    annotation: Any
    info: FieldInfo = field(default_factory=lambda: Field(default=None))
    also: tuple["Spelling", ...] = ()

    def given(self, request: BaseModel) -> tuple[str, Any]:
        """(the name the request gave the field under, its value): the first of this name and `also` that is
        not null (all null: this name and None)."""
        for spelling in (self, *self.also):
            value = getattr(request, spelling.name)
            if value is not None:
                return spelling.name, value
        return self.name, None


@dataclass(frozen=True)
class RequestField:
    """One generation setting as the APIs take it. `absent`: the setting where a protocol has no such field
    (KEEP: the server's default). `read`: the request's value (null included) as the setting, a ValueError
    refusing it; without one, a null is `absent` and a value is the setting as it stands."""

    setting: str
    spellings: Mapping[str, Spelling]
    absent: Any = KEEP
    read: Optional[Callable[[Any], Any]] = None

    def __post_init__(self) -> None:
        unknown = set(self.spellings) - set(PROTOCOLS)
        if unknown:  # a misspelt protocol would leave its field undeclared without a word
            raise ValueError(f"{self.setting}: no protocol {sorted(unknown)[0]!r}; the protocols are {PROTOCOLS}")

    def setting_of(self, request: BaseModel, protocol: str) -> Any:
        spelling = self.spellings.get(protocol)
        if spelling is None:
            return self.absent
        name, value = spelling.given(request)
        if self.read is None:
            return self.absent if value is None else value
        try:
            return self.read(value)
        except ValueError as e:
            raise SettingError(name, str(e)) from None

    def names(self, protocol: str) -> tuple[str, ...]:
        """The protocol's names for the field, the one it prefers first (none: it has no such field)."""
        spelling = self.spellings.get(protocol)
        return () if spelling is None else tuple(s.name for s in (spelling, *spelling.also))


def openai(name: str, annotation: Any, info: FieldInfo) -> dict[str, Spelling]:
    """The same spelling on both OpenAI endpoints (chat and completions)."""
    return {p: Spelling(name, annotation, info) for p in ("chat", "completions")}


def _reply_length(n: Optional[int]) -> Any:
    """None or 0 (llama_cpp's "no limit") leaves the server's --max-tokens; the engine clamps the length to
    what the context has left."""
    return n or KEEP


def _stop_strings(stop: Union[str, List[str], None]) -> list[str]:
    """OpenAI's one string or list (Anthropic's list) as the list of stop strings."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if any(not s for s in stops):
        raise ValueError("stop strings must be non-empty")
    return stops


def _penalty(p: Optional[float]) -> float:
    return 0.0 if p is None else p  # a null penalty is off, not the server's


def _token_biases(bias: Optional[Dict[str, float]]) -> dict[str, float]:
    return dict(bias or {})  # token ids as strings, checked against the vocabulary by GenerationConfig


_PENALTY = Field(default=0.0, ge=-2.0, le=2.0)  # OpenAI's bounds

# the sampling fields are bounded where the Session's sampler is; OpenAI's min_p and repeat_penalty default
# to off, as OpenAI clients expect, not to llama_cpp.server's 0.05 and 1.1
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
    RequestField("presence_penalty", openai("presence_penalty", Optional[float], _PENALTY), read=_penalty),
    RequestField("frequency_penalty", openai("frequency_penalty", Optional[float], _PENALTY), read=_penalty),
    RequestField("logit_bias", openai("logit_bias", Optional[Dict[str, float]], Field(default=None)),
                 read=_token_biases),
    RequestField("stop", {**openai("stop", Union[str, List[str], None], Field(default=None)),
                          "anthropic": Spelling("stop_sequences", Optional[List[str]])}, read=_stop_strings),
    # the reply's length; OpenAI chat's max_completion_tokens wins over its older max_tokens, and llama_cpp's
    # completions default to 16 tokens
    RequestField("max_tokens", {
        "chat": Spelling("max_completion_tokens", Optional[int], Field(default=None, ge=1),
                         also=(Spelling("max_tokens", Optional[int], Field(default=None, ge=0)),)),
        "completions": Spelling("max_tokens", Optional[int], Field(default=16, ge=0)),
        "anthropic": Spelling("max_tokens", int, Field(ge=1)),
        "responses": Spelling("max_output_tokens", Optional[int], Field(default=None, ge=1)),
    }, read=_reply_length),
)


def declared(base: type[BaseModel], protocol: str) -> type[BaseModel]:
    """`base` with every field FIELDS spells for `protocol` (a subclass of the same name)."""
    spelled = {s.name: (s.annotation, s.info) for f in FIELDS if protocol in f.spellings
               for s in (f.spellings[protocol], *f.spellings[protocol].also)}
    return create_model(base.__name__, __base__=base, __module__=base.__module__, __doc__=base.__doc__, **spelled)


def settings_of(request: BaseModel, protocol: str) -> dict[str, Any]:
    """The generation settings a request gives through FIELDS (settings it leaves to the server left out); a
    value a field's `read` refuses is a SettingError naming the request's field."""
    out = {f.setting: f.setting_of(request, protocol) for f in FIELDS}
    return {name: value for name, value in out.items() if value is not KEEP}


def renames(protocol: str) -> dict[str, str]:
    """Setting name -> the protocol's field, where the protocol has none of the setting's name: a refused
    setting named in the request's terms."""
    return {f.setting: f.names(protocol)[0] for f in FIELDS
            if f.names(protocol) and f.setting not in f.names(protocol)}
