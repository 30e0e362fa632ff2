"""Why a shared target context keeps one KV stream per sequence: a sequence's logits in a unified KV cache
depend on how many cells other sequences hold before its own, never on what those cells hold.

For each offset (cells another sequence fills first) the same prompt is decoded in a unified context after
them and alone in a fresh one, and the largest logit difference is printed, for two contents of the other
sequence (equal differences: no leak between sequences) and for the target as given and, with --f32, the
same weights re-saved as F32 (where the difference is float re-association only; in a quantized model every
matmul rounds its activations to 8 bits, and a re-associated sum that crosses a rounding edge grows through
the layers). docs/DESIGN.md ("A KV stream per sequence") quotes the figures.

    python scripts/measure_unified_kv.py [--target T.gguf] [--f32] [--flash-attn]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import numpy as np
from llama_cpp import llama_cpp as capi

from dflash_gguf.defaults import embedded_target
from dflash_gguf.target import init_backend, load_model, new_context

PROMPT_TOKENS = 200
N_CTX = 1024


def decode(ctx: capi.llama_context_p, tokens: list[int], seq: int, n_vocab: int, pos0: int = 0) -> np.ndarray:
    batch = capi.llama_batch_init(len(tokens), 0, 1)
    try:
        for i, t in enumerate(tokens):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, pos0 + i, 1, 1
            batch.seq_id[i][0] = seq
        batch.n_tokens = len(tokens)
        if capi.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")
        return np.ctypeslib.as_array(capi.llama_get_logits(ctx), shape=(len(tokens), n_vocab)).copy()
    finally:
        capi.llama_batch_free(batch)


def measure(path: Path, flash_attn: bool) -> None:
    model = load_model(path)
    n_vocab = capi.llama_vocab_n_tokens(capi.llama_model_get_vocab(model))
    rng = np.random.default_rng(0)
    prompt = [int(t) for t in rng.integers(100, n_vocab - 100, PROMPT_TOKENS)]

    def context() -> capi.llama_context_p:
        return new_context(model, n_ctx=N_CTX, n_batch=N_CTX // 2, n_seq_max=2, n_threads=1, flash_attn=flash_attn,
                           kv_unified=True)

    for split in (0, PROMPT_TOKENS - 10):  # the prompt in one decode (200 rows); all but 10, then those 10
        def run(ctx: capi.llama_context_p) -> np.ndarray:
            if split:
                decode(ctx, prompt[:split], 0, n_vocab)
            out = decode(ctx, prompt[split:], 0, n_vocab, pos0=split)
            capi.llama_free(ctx)
            return out

        alone = run(context())
        for offset in (20, 60):
            moves = []
            for _ in range(2):  # two contents of the other sequence
                ctx = context()
                decode(ctx, [int(t) for t in rng.integers(100, n_vocab - 100, offset)], 1, n_vocab)
                moves.append(float(np.abs(run(ctx) - alone).max()))
            how = f"{split} tokens, then {PROMPT_TOKENS - split} rows" if split else f"{PROMPT_TOKENS} rows in one decode"
            print(f"{path.name}: flash_attn={flash_attn}, {how}, {offset} cells of another sequence first: "
                  f"max |logit move| {moves[0]:.3g} / {moves[1]:.3g} (two contents)", flush=True)
    capi.llama_model_free(model)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", type=Path, default=None, help="target GGUF (default: the embedded SmolLM2)")
    ap.add_argument("--f32", action="store_true", help="also measure the same weights re-saved as F32")
    ap.add_argument("--flash-attn", action="store_true")
    args = ap.parse_args()
    path = args.target or embedded_target()
    if not path.is_file():
        print(f"measure_unified_kv: {path}: no such file", file=sys.stderr)
        return 2
    init_backend()
    try:
        measure(path, args.flash_attn)
    except (ValueError, RuntimeError) as e:  # not a GGUF libllama loads, or a context it cannot make
        print(f"measure_unified_kv: {e}", file=sys.stderr)
        return 1
    if args.f32:
        with tempfile.TemporaryDirectory() as tmp:
            f32 = Path(tmp) / f"{path.stem}.F32.gguf"
            params = capi.llama_model_quantize_default_params()
            params.ftype, params.allow_requantize, params.nthread = capi.LLAMA_FTYPE_ALL_F32, True, 2
            params.token_embedding_type = params.output_tensor_type = capi.GGML_TYPE_F32
            if capi.llama_model_quantize(str(path).encode(), str(f32).encode(), params) != 0:
                print("measure_unified_kv: could not re-save the target as F32", file=sys.stderr)
                return 1
            measure(f32, args.flash_attn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
