"""`dflash-train`: train a DFlash drafter for a GGUF target from a prompts JSONL.

Rerunning the same command resumes: answered prompts stay cached, training continues from
OUT/checkpoints/last. Bad input exits 2 with one line on stderr.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Sequence

from ..cli_parser import OneLineParser
from ..kinds import kind_named, kind_names
from .config import TrainConfig
from .errors import TrainError

STAGES = ("all", "data", "train", "export", "tau", "archive")
TRAIN_EXTRA = ("torch", "safetensors", "transformers")


def _weights(text: str) -> dict[str, float]:
    weights = {}
    for item in filter(None, text.split(",")):
        name, sep, value = item.partition("=")
        try:
            weights[name.strip()] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected CATEGORY=WEIGHT, got {item!r}") from None
        if not sep or not name.strip():
            raise argparse.ArgumentTypeError(f"expected CATEGORY=WEIGHT, got {item!r}")
    return weights


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    d = TrainConfig(target=Path(), prompts=Path(), out=Path())
    p = OneLineParser(prog="dflash-train", description=__doc__.splitlines()[0])
    p.add_argument("target", type=Path, help="target model GGUF")
    p.add_argument("prompts", type=Path, help='prompts JSONL: {"prompt", "category", "id"?} per line')
    p.add_argument("--out", type=Path, required=True, help="run directory (caches, checkpoints, metrics, GGUF)")
    p.add_argument("--stage", choices=STAGES, default="all", help="run one stage only (default: all, in order)")
    g = p.add_argument_group("prompts")
    g.add_argument("--test-per-category", type=int, default=d.test_per_category, help="prompts held back per category")
    g.add_argument("--hold-out", type=Path, help="JSONL whose prompt ids are never trained on (e.g. a benchmark)")
    g.add_argument("--weights", type=_weights, default={}, help="category weights, e.g. math=1,code=1,chat=0.6")
    g.add_argument("--max-prompts", type=int, help="training prompts to answer (default: all)")
    g.add_argument("--eval-prompts", type=int, default=d.eval_prompts_per_category, help="held-out prompts per category for the τ evaluation")
    g = p.add_argument_group("generation")
    g.add_argument("--generate-minutes", type=float, help="stop generating after this long (a rerun extends the cache)")
    g.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    g.add_argument("--max-seq-len", type=int, default=d.max_seq_len, help="prompt + response tokens")
    g.add_argument("--parallel", type=int, default=d.parallel, help="sequences per target decode")
    g.add_argument("--temperature", type=float, default=d.temperature, help="0 = greedy responses")
    g.add_argument("--threads", type=int, default=d.threads)
    g.add_argument("--no-flash-attn", dest="flash_attn", action="store_false", help="target decodes without flash attention")
    g.add_argument("--top-k", type=int, default=d.top_k, help="target logits kept per response token for soft labels (0 = none)")
    g.add_argument("--from-archive", type=Path, help="data stage: rebuild the feature caches from this token archive by prefill")
    g.add_argument("--archive", type=Path, help="archive stage: where to write the token archive (default: OUT/tokens.npz)")
    g.add_argument("--prefill-batch", type=int, default=d.prefill_batch, help="rows per prefill decode (--from-archive)")
    g = p.add_argument_group("model")
    g.add_argument("--kind", choices=kind_names(), default=d.kind, help=f"drafter kind (default: {d.kind})")
    g.add_argument("--draft-layers", type=int, default=d.draft_layers)
    g.add_argument("--feature-layers", type=int, default=d.feature_layers, help="number of target layers read")
    g.add_argument("--target-layer-ids", type=_ints, help="HF target layer ids (layer outputs), e.g. 1,8,14,20,27")
    g.add_argument("--block-size", type=int, default=d.block_size)
    g.add_argument("--draft-vocab", type=int, help=f"reduced draft vocabulary size; 0 = full (default: {d.draft_vocab}; full for dflash2)")
    g.add_argument("--mask-token-id", type=int, help="default: an unused control token of the target")
    g.add_argument("--init-from-target", action="store_true", help="draft layers from the target's top layers, final norm from its output norm")
    g.add_argument("--selector-rank", type=int, default=d.selector_rank, help="dflash2: rank of the path selector")
    g.add_argument("--markov-rank", type=int, default=d.markov_rank, help="dspark: rank of the Markov head")
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=d.steps)
    g.add_argument("--lr", type=float, default=d.lr)
    g.add_argument("--warmup", type=int, default=d.warmup)
    g.add_argument("--batch-sequences", type=int, default=d.batch_sequences)
    g.add_argument("--blocks", type=int, default=d.blocks_per_sequence, help="blocks drawn per sequence")
    g.add_argument("--gamma", type=float, help="loss decay over block slots (default: 7 for block 16)")
    g.add_argument("--soft-labels", type=float, default=d.soft_labels, help="weight of the soft cross-entropy on the target's top-k (0-1)")
    g.add_argument("--eval-every", type=int, default=d.eval_every)
    g.add_argument("--save-every", type=int, default=d.save_every)
    g.add_argument("--seed", type=int, default=d.seed)
    g.add_argument("--device", default=d.device, help="auto, cpu, cuda or mps")
    g.add_argument("--dtype", default=d.dtype, help="auto, float32 or bfloat16")
    g = p.add_argument_group("output")
    g.add_argument("--gguf", type=Path, help="drafter GGUF path (default: OUT/drafter.gguf)")
    g.add_argument("--outtype", default=d.outtype, help="f32, f16, bf16 or q8_0")
    g.add_argument("--tau-prompts", type=int, default=d.tau_prompts_per_category, help="held-out prompts per category for the Session τ")
    g.add_argument("--tau-max-tokens", type=int, default=d.tau_max_tokens)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def config_from_args(a: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        target=a.target, prompts=a.prompts, out=a.out,
        test_per_category=a.test_per_category, hold_out=a.hold_out, category_weights=a.weights,
        max_prompts=a.max_prompts, eval_prompts_per_category=a.eval_prompts,
        generate_minutes=a.generate_minutes, max_new_tokens=a.max_new_tokens, max_seq_len=a.max_seq_len,
        parallel=a.parallel, temperature=a.temperature, threads=a.threads, flash_attn=a.flash_attn,
        top_k=a.top_k, from_archive=a.from_archive, archive=a.archive, prefill_batch=a.prefill_batch,
        kind=a.kind, draft_layers=a.draft_layers, feature_layers=a.feature_layers, target_layer_ids=a.target_layer_ids,
        block_size=a.block_size, mask_token_id=a.mask_token_id,
        draft_vocab=(TrainConfig.draft_vocab if kind_named(a.kind).reduced_vocab else None) if a.draft_vocab is None else (a.draft_vocab or None),
        init_from_target=a.init_from_target, selector_rank=a.selector_rank, markov_rank=a.markov_rank, soft_labels=a.soft_labels,
        steps=a.steps, lr=a.lr, warmup=a.warmup, batch_sequences=a.batch_sequences,
        blocks_per_sequence=a.blocks, gamma=a.gamma, eval_every=a.eval_every, save_every=a.save_every,
        seed=a.seed, device=a.device, dtype=a.dtype, gguf=a.gguf, outtype=a.outtype,
        tau_prompts_per_category=a.tau_prompts, tau_max_tokens=a.tau_max_tokens,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    try:
        cfg.validate()
        from .pipeline import run

        result = run(cfg, stage=args.stage, progress=not args.quiet)
    except TrainError as e:
        print(f"dflash-train: error: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:
        if e.name not in TRAIN_EXTRA:
            raise
        print(f"dflash-train: error: training needs {e.name}: pip install 'dflash-gguf[train]'", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("dflash-train: interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    for line in result.summary():
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
