"""``dots1``: rednote's dots.llm1 (``Dots1ForCausalLM``): Qwen3's attention (per-head q/k RMSNorm, explicit
``head_dim``, sliding-window layers) with DeepSeek-V3's mixture of experts: dense first layers
(``first_k_dense_replace``), the sigmoid router with its expert bias, group-limited top-k, ``routed_scaling_factor``
and shared experts (:mod:`deepseek_moe`). No multi-token-prediction layers. No torch import.

transformers' ``Dots1Config`` windows layer ``i`` where ``sliding_window`` is set and ``i >= max_window_layers``
(or where ``layer_types`` says) and has no ``use_sliding_window`` switch: a config.json whose
``use_sliding_window: false`` contradicts its windowed layers is refused rather than read one way or the other.
dots.llm1's releases (62 layers, ``max_window_layers`` 62) have none. Their ``scoring_func`` (``noaux_tc``, the
sigmoid router) and ``moe_layer_freq`` (1), which transformers ignores, are checked to say what it computes.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert.families.deepseek_moe import ROUTING_KEYS, DeepSeekMoE, sigmoid_router_fixed
from bridge_cli.convert.families.llama_like import INERT_KEYS, LLAMA_KEYS
from bridge_cli.convert.families.moe import MOE_INERT_KEYS
from bridge_cli.convert.families.qwen3 import Qwen3
from bridge_cli.convert.families.windows import LAYER_TYPES, max_window_layers, qwen_layer_types, qwen_window_config
from bridge_cli.convert.hf_config import unsupported

SIGMOID_SCORING = ("noaux_tc", "sigmoid")
"""``scoring_func`` values that name the router transformers' dots1 computes (sigmoid scores, the expert bias)."""


class Dots1(DeepSeekMoE, Qwen3):
    model_type = "dots1"
    architecture = "Dots1ForCausalLM"
    models = ("dots.llm1.base, dots.llm1.inst: Qwen3's attention (per-head q/k norms, sliding-window layers) with "
              "dense first layers and MoE layers with the sigmoid router, expert bias and shared experts")
    limits = ("refuses attention_bias, RoPE scalings other than llama3 and yarn, norm_topk_prob false with top-k above "
              "1 (megatron-core renormalises sigmoid scores), num_experts_per_tok / topk_group other than 2 with "
              "n_group above 1, use_sliding_window false with sliding-window layers, scoring_func other than "
              "noaux_tc or sigmoid, moe_layer_freq other than 1")
    fixed = sigmoid_router_fixed(Qwen3.fixed)
    mapped_keys = (*LLAMA_KEYS, *ROUTING_KEYS, "first_k_dense_replace", "sliding_window", "max_window_layers",
                   "layer_types")
    assumed = {"attention_bias": False}
    inert_keys = (*INERT_KEYS, *MOE_INERT_KEYS)
    mtp = False

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        super().check(hf, where)
        scoring = hf.get("scoring_func", SIGMOID_SCORING[0])
        if scoring not in SIGMOID_SCORING:
            unsupported(where, f"scoring_func {scoring!r}: transformers' dots1 router takes sigmoid scores "
                               f"({' or '.join(SIGMOID_SCORING)}) whatever it says")
        if hf.get("moe_layer_freq", 1) != 1:
            unsupported(where, f"moe_layer_freq {hf['moe_layer_freq']!r}: transformers' dots1 makes every layer from "
                               "first_k_dense_replace on an MoE layer")

    def layer_kinds(self, hf: Mapping[str, Any], count: int, where: Path) -> list[str]:
        layers = qwen_layer_types({**hf, "use_sliding_window": True}, count, where,
                                  lambda i: hf.get("sliding_window") is not None and i >= max_window_layers(hf, where))
        windowed = [i for i, kind in enumerate(layers) if kind == LAYER_TYPES[0]]
        if windowed and hf.get("use_sliding_window") is False:
            unsupported(where, f"use_sliding_window false with sliding-window layers (sliding_window "
                               f"{hf.get('sliding_window')}, layers {windowed}): transformers' dots1 ignores "
                               "use_sliding_window and windows them",
                        "Set sliding_window to null for full attention, or remove use_sliding_window.")
        return layers

    # model fields -> config.json

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {"attention_bias": False, **qwen_window_config(model), **self.layer_config(model),
                **self.routing_config(model)}
