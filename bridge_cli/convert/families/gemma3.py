"""``gemma3_text``: Gemma 3's text models (Gemma3ForCausalLM), on Llama's layout with five changes.

- RMSNorm with ``1 + w`` (``layernorm_zero_centered_gamma``; the weights are stored as they are)
  everywhere, the per-head q/k norms (``qk_layernorm``) included.
- A norm on the attention and MLP outputs before each joins the residual (``post_sublayer_norm``):
  ``post_attention_layernorm`` and ``post_feedforward_layernorm``; the norm before the MLP is
  ``pre_feedforward_layernorm``.
- Input embeddings times sqrt(hidden_size) (``scale_embeddings``); tanh-approximated GELU in the
  gated MLP (megatron-core's ``fast_gelu``); attention scaled by ``query_pre_attn_scalar ** -0.5``
  (``softmax_scale``).
- Sliding-window layers (``layer_types``, or every layer but each ``sliding_window_pattern``-th),
  which see their ``sliding_window`` keys: ``window_size = [sliding_window - 1, 0]`` and
  ``window_attn_skip_freq`` one 0/1 per layer.
- RoPE with its own base in those layers (``rope_local_base_freq``, unscaled: ``local_rotary_base``);
  the global layers' linear scaling (the 4B-27B models' factor 8) is megatron-core's
  ``seq_len_interpolation_factor``.

``attn_logit_softcapping`` and ``final_logit_softcapping`` (null in Gemma 3, set in Gemma 2) are the
model fields of the same names.

config.json is read in transformers 4.x's keys (``rope_theta``, ``rope_local_base_freq``,
``rope_scaling``, ``sliding_window_pattern``) and 5.x's (``rope_parameters`` per layer type), and
written in 4.x's, which both load.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from bridge_cli.convert import hf_config
from bridge_cli.convert.families.gemma import refuse_gemma_options
from bridge_cli.convert.families.llama_like import LLAMA_STYLE, LlamaLike
from bridge_cli.convert.families.windows import layer_types, window_config
from bridge_cli.convert.hf_config import unsupported

ACTIVATION = "gelu_pytorch_tanh"
"""The GELU Gemma 3 uses: its tanh approximation, which megatron-core's fast_gelu computes."""

SOFT_CAPS = ("attn_logit_softcapping", "final_logit_softcapping")
"""config.json's soft caps of the attention scores and of the output logits (null: none)."""


class Gemma3(LlamaLike):
    """Gemma 3 text models (1B, and the language model of 4B-27B as Gemma3ForCausalLM saves it)."""

    model_type = "gemma3_text"
    architecture = "Gemma3ForCausalLM"
    models = ("Gemma 3 text (Gemma3ForCausalLM); sliding-window and global layers with their own RoPE bases, "
              "1 + w RMSNorms, post-attention/feedforward norms, scaled embeddings")
    limits = "refuses bidirectional attention, attention_bias and RoPE scalings but linear (global layers)"
    mapped_keys = (*(key for key in LlamaLike.mapped_keys if key != "hidden_act"), "hidden_activation",
                   "query_pre_attn_scalar", "sliding_window", "layer_types", *SOFT_CAPS)
    assumed = {"attention_bias": False, "use_bidirectional_attention": False}
    fixed = {**{key: value for key, value in LLAMA_STYLE.items()
                if key not in ("seq_len_interpolation_factor", "local_rotary_base", "softmax_scale", "window_size",
                               "attn_logit_softcapping", "final_logit_softcapping")},
             "activation_func": "fast_gelu", "qk_layernorm": True, "layernorm_zero_centered_gamma": True,
             "post_sublayer_norm": True, "scale_embeddings": True, "add_qkv_bias": False, "rope_scaling": False}
    pre_norms = ("input_layernorm", "pre_feedforward_layernorm")
    post_norms = ("post_attention_layernorm", "post_feedforward_layernorm")

    windows = "per_layer"
    window_pattern = 6
    """Without ``layer_types``, every ``sliding_window_pattern``-th layer is global (this default where unset)."""

    # config.json -> model fields

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length: Optional[int] = None) -> dict[str, Any]:
        return {**super().fields(hf, where, seq_length), "softmax_scale": float(hf["query_pre_attn_scalar"]) ** -0.5,
                **{key: _soft_cap(hf[key], key, where) for key in SOFT_CAPS}}

    def layer_kinds(self, hf: Mapping[str, Any], count: int, where: Path) -> list[str]:
        return layer_types(hf, count, where, self.window_pattern)

    def activation(self, hf: Mapping[str, Any], where: Path) -> str:
        act = hf.get("hidden_activation") or hf.get("hidden_act") or ACTIVATION
        if act != ACTIVATION:
            unsupported(where, f"hidden_activation {act!r}: Gemma 3 uses {ACTIVATION}")
        return "fast_gelu"

    def rope_fields(self, hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
        full, sliding = _rope_parameters(hf)
        kind = hf_config.rope_kind(full)
        if kind not in ("default", "linear"):
            unsupported(where, f"RoPE scaling {kind!r} in the global layers",
                        "Supported: none (default) and linear, megatron-core's seq_len_interpolation_factor.")
        factor = full.get("factor") if kind == "linear" else None
        if kind == "linear" and (not isinstance(factor, (int, float)) or factor <= 0):
            unsupported(where, f"linear RoPE scaling with factor {factor!r}: a positive number is needed")
        if hf_config.rope_kind(sliding) != "default":
            unsupported(where, f"RoPE scaling {hf_config.rope_kind(sliding)!r} in the sliding-window "
                               "layers: megatron-core's rotary embedding of those layers is unscaled")
        return {"rotary_base": hf_config.integer_theta(full["rope_theta"], "rope_theta", where),
                "local_rotary_base": hf_config.integer_theta(sliding["rope_theta"], "rope_local_base_freq", where),
                "seq_len_interpolation_factor": None if factor is None else float(factor),
                "rope_scaling": False, "rope_scaling_factor": 8.0}

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        refuse_gemma_options(hf, where)

    # model fields -> config.json

    def hf_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        config = super().hf_config(model)
        del config["hidden_act"]  # Gemma 3 reads hidden_activation
        return config

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        scale = model["softmax_scale"]
        scalar = model["kv_channels"] if scale is None else scale ** -2
        factor = model["seq_len_interpolation_factor"]
        local_base = model["local_rotary_base"]
        return {
            "hidden_activation": ACTIVATION,
            "query_pre_attn_scalar": round(scalar) if abs(scalar - round(scalar)) < 1e-6 * scalar else scalar,
            **window_config(model),
            "rope_local_base_freq": float(model["rotary_base"] if local_base is None else local_base),
            "rope_scaling": None if factor is None else {"rope_type": "linear", "factor": float(factor)},
            "attention_bias": False,
            "attn_logit_softcapping": model["attn_logit_softcapping"],
            "final_logit_softcapping": model["final_logit_softcapping"],
        }


def _rope_parameters(hf: Mapping[str, Any]) -> tuple[dict, dict]:
    """(global, sliding-window) RoPE settings, each with its ``rope_theta``: transformers 5.x's
    ``rope_parameters`` per layer type, else 4.x's ``rope_theta``/``rope_scaling`` and ``rope_local_base_freq``."""
    parameters = hf.get("rope_parameters") or {}
    if "full_attention" in parameters or "sliding_attention" in parameters:
        full = {"rope_theta": 1_000_000.0, **(parameters.get("full_attention") or {})}
        sliding = {"rope_theta": 10_000.0, **(parameters.get("sliding_attention") or {})}
        return full, sliding
    full = {**(hf.get("rope_scaling") or {}), "rope_theta": hf.get("rope_theta", 1_000_000.0)}
    return full, {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}


def _soft_cap(value: Any, key: str, where: Path) -> Optional[float]:
    if value is not None and (not isinstance(value, (int, float)) or value <= 0):
        unsupported(where, f"{key} {value!r}: a positive number (or null) is needed")
    return None if value is None else float(value)



