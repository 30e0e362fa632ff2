"""GGUF targets that carry a tool-capable chat template of each family: copies of the embedded SmolLM2 target
with its `tokenizer.chat_template` replaced (gguf-py's gguf-new-metadata), built once per test session.

The templates under tests/tool_templates/ are the real families' templates as upstream llama.cpp ships them
(models/templates/): hermes = Qwen2.5-7B-Instruct, qwen3-coder = Qwen3-Coder, llama3 = Llama-3.2-3B-Instruct,
mistral = Mistral-Nemo-Instruct-2407; a thinking target carries Qwen3.5-4B's, read from upstream's directory.
The weights are SmolLM2's: the calls are valid because the grammar holds them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from upstream import LLAMA_CPP_SRC

TEMPLATES = Path(__file__).parent / "tool_templates"
THINKING_TEMPLATE = LLAMA_CPP_SRC / "models/templates/Qwen3.5-4B.jinja"
FAMILIES = ("hermes", "qwen3-coder", "llama3", "mistral")


class ToolTargets:
    def __init__(self, root: Path, embedded: Path) -> None:
        self.root, self.embedded = root, embedded
        self._built: dict[str, Path] = {}

    def template(self, family: str) -> str:
        return (TEMPLATES / f"{family}.jinja").read_text()

    def path(self, family: str) -> Path:
        """The target GGUF with `family`'s template (built on first use)."""
        return self._build(family, TEMPLATES / f"{family}.jinja")

    def thinking(self) -> Path:
        """The target GGUF with Qwen3.5's template, read from upstream's models/templates: a thinking template
        (its prompt ends inside `<think>` unless enable_thinking is false) whose tool calls are Qwen3-Coder's."""
        return self._build("qwen3.5", THINKING_TEMPLATE)

    def _build(self, name: str, template: Path) -> Path:
        if name not in self._built:
            out = self.root / f"smollm2-{name}.gguf"
            tmp = out.with_suffix(".tmp")
            subprocess.run([sys.executable, "-m", "gguf.scripts.gguf_new_metadata", "--chat-template-file",
                            str(template), str(self.embedded), str(tmp)],
                           check=True, capture_output=True)
            tmp.rename(out)
            self._built[name] = out
        return self._built[name]
