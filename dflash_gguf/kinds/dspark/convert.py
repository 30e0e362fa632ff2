"""Converting a DSpark checkpoint: its config schemas brought to DFlash's, its Markov and confidence heads,
and the block layout and confidence keys libllama reads (upstream's `DSparkModel`)."""

from __future__ import annotations

from typing import Any

import gguf

from ...schema import Keys, Tensors
from ..base import KindError
from ..converting import CheckKeys, Converter, Shape, draft_value

V = gguf.GGUFValueType

LAYOUT = ("dflash_config", "sample_from_anchor", "aux_hidden_state_layer_ids", "markov_head_type", "markov_rank")
"""The keys `normalise` reads, in the nested transformer and at the top level."""
NESTED = "transformer_layer_config"


def check_layout(hparams: dict[str, Any], check: CheckKeys) -> None:
    """The DSpark keys, checked before normalisation reads them: `transformer_layer_config` and what it nests
    (prefixed in messages), then the merged view normalisation builds."""
    check((NESTED, *LAYOUT), hparams, "")
    nested = hparams.get(NESTED)
    if nested is not None:
        check(LAYOUT, nested, f"{NESTED}.")
        check(LAYOUT, {**hparams, **nested}, "")


def normalise(hparams: dict[str, Any]) -> tuple[dict[str, Any], bool, int | None]:
    """DSpark's config schemas brought to DFlash's, as upstream's DSparkModel does: (hparams, sample_from_anchor, markov_rank).

    The speculators export nests the transformer under `transformer_layer_config` and names target layers
    `aux_hidden_state_layer_ids` (layer inputs, i.e. HF ids + 1); both forms default to the bonus-anchor
    block (an EAGLE3-style 1+N layout), the DeepSpec / z-lab forms to the anchor-first block.
    The keys read here were type- and range-checked by `check_layout`.
    """
    nested = hparams.get(NESTED)
    anchor = hparams.get("sample_from_anchor")
    if anchor is None:  # a JSON null is an absent key, as everywhere in the schema
        anchor = nested is None and hparams.get("aux_hidden_state_layer_ids") is None
    hp = {**hparams, **(nested or {})}
    if hp.get("dflash_config") is None:
        aux = hp.get("aux_hidden_state_layer_ids")
        if aux is not None:
            hp["dflash_config"] = {"mask_token_id": hp.get("mask_token_id"), "target_layer_ids": [i - 1 for i in aux]}
        else:
            hp["dflash_config"] = {k: hp[k] for k in ("target_layer_ids", "mask_token_id") if hp.get(k) is not None}
    return hp, anchor, draft_value(hp, "markov_rank")


class DSparkConverter(Converter):
    def read_config(self, hparams: dict[str, Any], check: CheckKeys) -> tuple[dict[str, Any], bool | None, dict[str, Any]]:
        check_layout(hparams, check)
        hp, anchor, rank = normalise(hparams)
        return hp, anchor, {"markov_rank": rank}

    def complete(self, cfg: Any, tensors: dict[str, Any], directory: Any) -> dict[str, Any]:
        """The Markov rank: config.json's, else markov_w1's second dimension."""
        if cfg.kind_values["markov_rank"] is not None:
            return cfg.kind_values
        w1 = tensors.get(Tensors.MARKOV_W1)
        if w1 is None:
            raise KindError(f"{directory}: missing tensor markov_head.markov_w1.weight (a {cfg.architecture} needs its Markov head)")
        if len(w1.shape) != 2 or w1.shape[1] < 1:
            raise KindError(f"{w1.file}: tensor {w1.name} has shape {list(w1.shape)}, expected [vocab_size, markov_rank]")
        return {**cfg.kind_values, "markov_rank": int(w1.shape[1])}

    def shapes(self, cfg: Any) -> tuple[dict[str, Shape], dict[str, Shape]]:
        rank = cfg.kind_values["markov_rank"] or 0
        return {Tensors.MARKOV_W1: (cfg.vocab_size, rank), Tensors.MARKOV_W2: (cfg.draft_vocab_size or cfg.vocab_size, rank)}, {}

    def optional_shapes(self, cfg: Any, name: str, shape: Shape) -> dict[str, Shape]:
        optional = {Tensors.CONF_PROJ: (1, cfg.hidden_size + (cfg.kind_values["markov_rank"] or 0)), Tensors.CONF_PROJ_BIAS: (1,)}
        if name == Tensors.CONF_PROJ and shape == (1, cfg.hidden_size):
            raise KindError(
                f"scores the hidden state alone (confidence_head_with_markov false); "
                f"libllama's DSpark confidence head reads [hidden; markov_w1[prev]], shape [1, {optional[name][1]}]"
            )
        return optional

    def metadata(self, cfg: Any, tensor_names: set[str]) -> list[tuple[str, Any, gguf.GGUFValueType]]:
        return [(Keys.SAMPLE_FROM_ANCHOR, bool(cfg.sample_from_anchor), V.BOOL),
                (Keys.HAS_CONFIDENCE_HEAD, Tensors.CONF_PROJ in tensor_names, V.BOOL)]

    def info_rows(self, info: Any) -> list[tuple[str, str]]:
        layout = "anchor-first (a block of B drafts B tokens)" if info.sample_from_anchor else "bonus anchor (B - 1 drafts)"
        return [
            ("markov rank", str(info.markov_rank)),
            ("confidence head", "yes" if info.has_confidence_head else "no"),
            ("block layout", layout),
        ]
