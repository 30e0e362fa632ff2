"""How often greedy DFlash output differs from plain greedy decoding of the same target, and where.

    python scripts/measure_divergence.py [--drafter D.gguf] [--flash-attn 0|1] [--block-size 16] [--max-tokens 48]

Both modes start each prompt from a cold cache (Session.reset), so that they split the prompt the same way.
"""

from __future__ import annotations

import argparse

from dflash_gguf import Session
from dflash_gguf.defaults import embedded_target

PROMPTS = [
    "The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are",
    "Q: What is 12 times 7?\nA:", "import numpy as np\n\ndef mean(xs):", "Dear hiring manager,",
    "The best way to learn a language is", "for i in range(10):", "Photosynthesis is the process",
    "SELECT name FROM users WHERE", "In 1492, Columbus", "Water boils at", "The derivative of x^2 is",
    "class Stack:\n    def __init__(self):", "My favourite book is", "The mitochondria is",
    "To make a cup of tea,", "The square root of 144 is", "Rain is caused by",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--drafter", help="drafter GGUF for the embedded target (default: the shipped one)")
    p.add_argument("--flash-attn", type=int, choices=(0, 1), default=1)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=48)
    a = p.parse_args()
    target = None if a.drafter is None else embedded_target()
    with Session(target, a.drafter, n_ctx=512, n_batch=64, n_threads=2, flash_attn=bool(a.flash_attn)) as s:
        diverged = []
        for prompt in PROMPTS:
            s.reset()
            plain = s.generate(prompt, max_tokens=a.max_tokens, speculative=False).tokens
            s.reset()
            spec = s.generate(prompt, max_tokens=a.max_tokens, block_size=a.block_size).tokens
            if spec != plain:
                at = next((i for i, (x, y) in enumerate(zip(spec, plain)) if x != y), min(len(spec), len(plain)))
                diverged.append((prompt, at))
    print(
        f"flash_attn={a.flash_attn} block={a.block_size} max_tokens={a.max_tokens}: "
        f"{len(diverged)}/{len(PROMPTS)} prompts diverge {diverged}"
    )


if __name__ == "__main__":
    main()
