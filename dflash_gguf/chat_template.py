"""What a chat template does with a system message that is not the first: learned once per template.

Claude Code sends system messages inside the conversation (its mid-conversation-system beta). Templates of
the ChatML family render them where they stand; others raise ("System message must be at the beginning")
or silently drop them. A template is asked once, with a probe conversation, and where it does not render a
late system message in place, such messages are joined to the leading system message instead: the model
still reads every instruction, and a conversation whose late system messages stay the same keeps one
prefix from turn to turn (the prompt cache's reuse).
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Mapping, Sequence

from llama_cpp import llama_chat_format

_PROBE = "dflash-probe-late-system"

@lru_cache(maxsize=16)
def renders_late_system(template: str, bos: str, eos: str) -> bool:
    """Whether the template renders a system message after the first turn, in place and with its text."""
    formatter = llama_chat_format.Jinja2ChatFormatter(template=template, eos_token=eos, bos_token=bos)
    probe = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
             {"role": "assistant", "content": "a"}, {"role": "system", "content": _PROBE},
             {"role": "user", "content": "v"}]
    try:
        prompt = formatter(messages=probe).prompt
    except Exception:  # noqa: BLE001 - a template that raises on the probe refuses late system messages
        return False
    return _PROBE in prompt and prompt.index(_PROBE) > prompt.index("a")

def place_system_messages(messages: Sequence[Mapping[str, Any]], in_place: bool) -> list[dict[str, Any]]:
    """The messages as the template can take them: unchanged where late system messages render in place,
    else each late one's text joined (a blank line apart) to the leading system message, made if absent."""
    out = [dict(m) for m in messages]
    late = [i for i, m in enumerate(out) if m.get("role") == "system" and i > 0]
    if in_place or not late:
        return out
    texts = [_text(out[i].get("content")) for i in late]
    rest = [m for i, m in enumerate(out) if i not in set(late)]
    if rest and rest[0].get("role") == "system":
        lead = rest[0]
        lead["content"] = "\n\n".join([_text(lead.get("content")), *texts])
        return rest
    return [{"role": "system", "content": "\n\n".join(texts)}, *rest]

def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI text parts
        return "".join(p.get("text", "") for p in content if isinstance(p, Mapping))
    return "" if content is None else str(content)
