"""``qwen3_moe``: Qwen3's attention (per-head q/k RMSNorm) with mixture-of-experts MLPs."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert.families.moe import MOE_INERT_KEYS, MOE_KEYS, MoELike, moe_fixed
from bridge_cli.convert.families.qwen3 import Qwen3
from bridge_cli.convert.families.windows import every_layer, qwen_window_config
from bridge_cli.convert.hf_config import unsupported
from bridge_cli.convert.hf_weights import moe_layer_pattern


class Qwen3Moe(MoELike, Qwen3):
    """Qwen3-MoE (30B-A3B, 235B-A22B). Layer ``i`` is an MoE layer unless it is in ``mlp_only_layers`` or
    ``i + 1`` is not a multiple of ``decoder_sparse_step``: megatron-core's ``moe_layer_freq`` as a list, the
    dense layers of FFN size ``intermediate_size``, the experts of ``moe_intermediate_size``.
    ``norm_topk_prob`` picks the router's softmax after (true) or before (false) the top-k."""

    model_type = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    models = "Qwen3-MoE (30B-A3B, 235B-A22B); Qwen3 attention, dense layers where mlp_only_layers/decoder_sparse_step say"
    limits = "refuses attention_bias, RoPE scalings other than llama3 and yarn, and norm_topk_prob with top-1 routing"
    all_layers_moe = False
    mapped_keys = (*Qwen3.mapped_keys, "num_experts", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                   "mlp_only_layers", *MOE_KEYS)
    inert_keys = (*Qwen3.inert_keys, *MOE_INERT_KEYS)
    fixed = moe_fixed(Qwen3.fixed)
    windows = "every_layer"  # transformers' Qwen3-MoE windows every layer with use_sliding_window (no layer_types)

    def layer_kinds(self, hf: Mapping[str, Any], count: int, where: Path) -> list[str]:
        return every_layer({"sliding_window": hf.get("sliding_window") if hf.get("use_sliding_window") else None},
                           count)

    def moe_layers(self, hf: Mapping[str, Any], where: Path, num_layers: int) -> list[bool]:
        return qwen_moe_layers(hf, where, num_layers, "qwen3")

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {"attention_bias": False, **qwen_window_config(model, per_layer=False), **self.moe_config(model),
                **qwen_moe_config(model)}


def qwen_moe_layers(hf: Mapping[str, Any], where: Path, num_layers: int, dense_family: str) -> list[bool]:
    """Per layer, whether a Qwen MoE model's layer is an MoE layer: not in ``mlp_only_layers``, and ``i + 1`` a
    multiple of ``decoder_sparse_step``."""
    step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1:
        unsupported(where, f"decoder_sparse_step {step!r}: a positive integer is needed")
    pattern = [i not in dense and (i + 1) % step == 0 for i in range(num_layers)]
    if not any(pattern):
        unsupported(where, "no MoE layer (mlp_only_layers / decoder_sparse_step)", f"Convert it as {dense_family}.")
    return pattern


def qwen_moe_config(model: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's keys of a Qwen MoE model's experts and layer pattern."""
    pattern = moe_layer_pattern(model["moe_layer_freq"], model["num_layers"])
    return {"moe_intermediate_size": model["moe_ffn_hidden_size"], "norm_topk_prob": not model["moe_router_pre_softmax"],
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i, moe in enumerate(pattern) if not moe]}
