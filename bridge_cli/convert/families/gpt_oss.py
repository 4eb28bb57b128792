"""``gpt_oss``: GPT-OSS (GptOssForCausalLM), Llama's layout with six changes, each a megatron-core setting.

- Biases on q, k, v and o, on the router and on every expert's projections: ``add_bias_linear``
  (megatron-core's TopKRouter then holds a bias too; experts run as SequentialMLP, since the
  grouped-GEMM experts without Transformer Engine take no biases).
- A learned sink logit per head (``self_attn.sinks``) in every softmax: ``softmax_type=learnable``,
  ``core_attention.softmax_offset``.
- Sliding-window layers where ``layer_types`` says (every other one, the first included).
- YaRN RoPE: ``position_embedding_type=yarn`` and the ``yarn_*`` fields. transformers' ``truncate``
  is ``yarn_correction_range_round_to_int``; its attention factor (0.1 * ln(factor) + 1 unless
  ``mscale``/``mscale_all_dim`` say otherwise) scales cos and sin as megatron-core's
  ``yarn_mscale``/``yarn_mscale_all_dim`` do. Both rotate the two halves of each head.
- The router takes the top-k logits and a softmax over them: megatron-core's
  ``moe_router_pre_softmax=false``.
- Clamped SwiGLU experts, ``(clamp(up, -limit, limit) + 1) * g * sigmoid(1.702 g)`` with
  ``g = clamp(gate, max=limit)``: megatron-core's ``quick_gelu`` gated MLP with
  ``glu_linear_offset=1`` and ``activation_func_clamp_value=swiglu_limit``. The experts are stored
  stacked (``gate_up_proj`` ``[experts, hidden, 2 * ffn]``, gate and up interleaved along its last axis;
  ``down_proj`` ``[experts, ffn, hidden]``), which import splits into each expert's ``linear_fc1``
  (``[gate; up]``) and ``linear_fc2`` and export stacks again.

config.json is read in transformers 4.x's keys (``rope_theta``, ``rope_scaling``) and 5.x's
(``rope_parameters``), and written in 4.x's, which both load.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Optional

from bridge_cli.convert import hf_config, yarn
from bridge_cli.convert.families.llama_like import LLAMA_STYLE, LlamaLike
from bridge_cli.convert.families.moe import MOE_INERT_KEYS, MOE_KEYS, MoELike, moe_fixed
from bridge_cli.convert.families.windows import layer_types, window_config
from bridge_cli.convert.hf_config import unsupported
from bridge_cli.convert.hf_weights import Architecture, Layout, Pair

SWIGLU_ALPHA = 1.702
"""The sigmoid gain of GPT-OSS's SwiGLU: megatron-core's quick_gelu hard-codes it."""

DENSE = {**{key: value for key, value in LLAMA_STYLE.items() if key != "window_size"},
         "add_bias_linear": True, "add_qkv_bias": True, "position_embedding_type": "yarn",
         "activation_func": "quick_gelu", "glu_linear_offset": 1.0, "softmax_type": "learnable"}
"""GPT-OSS's attention and MLP settings (the windows and the YaRN numbers vary)."""


class GptOss(MoELike, LlamaLike):
    """GPT-OSS 20B and 120B, unquantized (bf16) weights."""

    model_type = "gpt_oss"
    architecture = "GptOssForCausalLM"
    models = ("GPT-OSS 20B, 120B (bf16 weights); biases on attention, router and experts, learned attention "
              "sinks, alternating sliding-window layers, YaRN RoPE, clamped SwiGLU experts stacked per projection")
    limits = ("refuses MXFP4-quantized folders (dequantize them with transformers first), attention_bias=false, "
              "RoPE other than yarn, swiglu_alpha other than 1.702 and top-1 routing; the experts run as "
              "SequentialMLP at expert TP 1, so training under TP > 1 needs EP > 1")
    experts_key = "num_local_experts"
    windows = "per_layer"
    # hidden_act is unused: the experts compute their clamped SwiGLU whatever it says
    mapped_keys = (*(key for key in LlamaLike.mapped_keys if key != "hidden_act"), "num_local_experts",
                   "sliding_window", "layer_types", "swiglu_limit", *MOE_KEYS)
    assumed = {"attention_bias": True, "swiglu_alpha": SWIGLU_ALPHA}
    inert_keys = (*LlamaLike.inert_keys, *MOE_INERT_KEYS, "hidden_act")
    fixed = moe_fixed(DENSE, moe_router_pre_softmax=False)

    # config.json -> model fields

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length: Optional[int] = None) -> dict[str, Any]:
        return {**super().fields(hf, where, seq_length),
                "activation_func_clamp_value": float(hf["swiglu_limit"]),
                # megatron-core computes biased experts at expert TP 1 only, and bridge's grouped-GEMM
                # experts (without Transformer Engine) take no biases
                "expert_tensor_parallel_size": 1, "moe_grouped_gemm": False}

    def layer_kinds(self, hf: Mapping[str, Any], count: int, where: Path) -> list[str]:
        return layer_types(hf, count, where, 2)

    def activation(self, hf: Mapping[str, Any], where: Path) -> str:
        # hidden_act is unused: GPT-OSS's experts compute their clamped SwiGLU whatever it says
        alpha = hf.get("swiglu_alpha", SWIGLU_ALPHA)
        if alpha != SWIGLU_ALPHA:
            unsupported(where, f"swiglu_alpha {alpha!r}: megatron-core's quick_gelu computes "
                               f"x * sigmoid({SWIGLU_ALPHA} x)")
        return "quick_gelu"

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        quantization = hf.get("quantization_config")
        if quantization:
            method = quantization.get("quant_method") if isinstance(quantization, dict) else quantization
            unsupported(where, f"quantization_config ({method}): the experts are stored quantized (blocks and "
                               "scales), and bridge converts unquantized weights",
                        "Dequantize the folder first: transformers' GptOssForCausalLM.from_pretrained(DIR, "
                        "quantization_config=Mxfp4Config(dequantize=True), dtype=torch.bfloat16).save_pretrained(OUT), "
                        "then convert OUT.")
        if not hf.get("attention_bias", True):
            unsupported(where, "attention_bias false: the router and the experts have biases, and megatron-core's "
                               "add_bias_linear gives q/k/v and o_proj theirs too")
        limit = hf.get("swiglu_limit", 7.0)
        if not isinstance(limit, (int, float)) or isinstance(limit, bool) or not 0 < limit < math.inf:
            unsupported(where, f"swiglu_limit {limit!r}: a positive number is needed")

    def expert_ffn_size(self, hf: Mapping[str, Any], where: Path) -> int:
        return hf_config.getter(hf, where)("intermediate_size")

    def router_fields(self, hf: Mapping[str, Any], where: Path, topk: int) -> dict[str, Any]:
        if topk == 1:
            unsupported(where, "num_experts_per_tok 1: transformers weighs each token's one expert 1 (a softmax over "
                               "one logit), a router megatron-core refuses (its gradient is zero); its softmax "
                               "before the top-1 weighs the expert otherwise")
        return {"moe_router_pre_softmax": False}

    def rope_fields(self, hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
        if not yarn.is_yarn(hf):
            kind = hf_config.rope_kind(hf_config.rope_settings(hf))
            unsupported(where, f"RoPE {kind!r}: the gpt_oss family converts GPT-OSS's yarn")
        return yarn.model_fields(hf, where, default_theta=150_000.0)

    # model fields -> config.json

    def differences(self, model: Mapping[str, Any]) -> list[str]:
        out = super().differences(model)
        if "activation_func_clamp_value" in model and model["activation_func_clamp_value"] is None:
            out.append("model.activation_func_clamp_value=None")  # transformers' GPT-OSS always clamps
        return out

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {**self.moe_config(model), "intermediate_size": model["moe_ffn_hidden_size"], "attention_bias": True,
                "swiglu_alpha": SWIGLU_ALPHA,
                "swiglu_limit": model["activation_func_clamp_value"], **window_config(model)}

    # tensors

    def attention_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        h = arch.hidden_size
        return [*super().attention_pairs(arch, m, p), Pair(m + "linear_proj.bias", ((p + "o_proj.bias", (h,)),)),
                Pair(m + "core_attention.softmax_offset", ((p + "sinks", (arch.num_attention_heads,)),))]

    def feed_forward_pairs(self, arch: Architecture, layer: int, m: str, p: str) -> list[Pair]:
        h, e, f = arch.hidden_size, arch.num_experts, arch.moe_ffn_hidden_size

        def experts(linear: str) -> tuple[str, ...]:
            return tuple(f"{m}experts.local_experts.{j}.{linear}" for j in range(e))

        x = p + "experts."
        return [Pair(m + "router.weight", ((p + "router.weight", (e, h)),)),
                Pair(m + "router.bias", ((p + "router.bias", (e,)),)),
                Pair(experts("linear_fc1.weight"), ((x + "gate_up_proj", (e, h, 2 * f)),), Layout.EXPERTS_GATE_UP),
                Pair(experts("linear_fc1.bias"), ((x + "gate_up_proj_bias", (e, 2 * f)),), Layout.EXPERTS_GATE_UP),
                Pair(experts("linear_fc2.weight"), ((x + "down_proj", (e, f, h)),), Layout.EXPERTS_T),
                Pair(experts("linear_fc2.bias"), ((x + "down_proj_bias", (e, h)),), Layout.EXPERTS)]
