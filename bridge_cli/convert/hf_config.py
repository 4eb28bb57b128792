"""Hugging Face ``config.json`` <-> the ``model:`` section of a bridge recipe. No torch import.

Supported: the Llama family as transformers names it, ``llama`` (Llama 2, 3, 3.1, 3.2),
``mistral`` and ``qwen2`` (biases on q/k/v). All are megatron-core GPTModels with RMSNorm,
SwiGLU, RoPE and grouped-query attention; they differ only in the fields mapped here.

Both directions read and write transformers' classic keys (``rope_theta``, ``rope_scaling``,
``torch_dtype``), which transformers 4.45+ and 5.x load; on import, 5.x's ``rope_parameters`` is
read too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, Optional

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.config.errors import ConfigError

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
"""model_type -> the transformers class a converted folder is loaded with."""

DEFAULT_MAX_SEQ_LENGTH = 4096
"""model.seq_length of an import is max_position_embeddings capped at this (Llama 3.1 says 131072,
more than a training recipe should start from); --seq-length sets it."""

LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""megatron-core's Llama 3.1 RoPE scaling hard-codes these; only the factor is a setting."""

LLAMA_STYLE = {
    "normalization": "RMSNorm", "activation_func": "silu", "gated_linear_unit": True, "add_bias_linear": False,
    "position_embedding_type": "rope", "rotary_percent": 1.0, "rotary_interleaved": False,
    "seq_len_interpolation_factor": None, "qk_layernorm": False, "num_moe_experts": None,
    "multi_latent_attention": False, "layernorm_zero_centered_gamma": False,
    "apply_residual_connection_post_layernorm": False,
}
"""The model fields every supported Hugging Face architecture fixes (the shapes aside)."""


def read_config(hf_dir: Path) -> dict[str, Any]:
    """``hf_dir/config.json`` as a dict; a missing or unreadable file is a CheckpointError."""
    path = Path(hf_dir) / "config.json"
    if not Path(hf_dir).is_dir():
        raise CheckpointError(f"{hf_dir} is not a folder. Give the Hugging Face model folder "
                              "(the one holding config.json and *.safetensors).")
    if not path.is_file():
        raise CheckpointError(f"{hf_dir} has no config.json, so it is not a Hugging Face model folder. "
                              "Download the whole model (config.json and *.safetensors).")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{path} cannot be read as JSON ({err}).") from err
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object.")
    return config


def to_model_fields(hf: Mapping[str, Any], where: Path, seq_length: Optional[int] = None) -> dict[str, Any]:
    """The recipe's ``model:`` fields for the Hugging Face config ``hf`` (read from ``where``).

    ``seq_length`` overrides the default (max_position_embeddings, capped at
    DEFAULT_MAX_SEQ_LENGTH and at Mistral's sliding window, so that full causal attention is
    exactly what the model computes). Raises CheckpointError for what megatron-core cannot build.
    """
    model_type = hf.get("model_type")
    if model_type not in ARCHITECTURES:
        _unsupported(where, f"model_type {model_type!r} is not supported",
                     f"Supported: {', '.join(ARCHITECTURES)} (Llama 2/3/3.1/3.2, Mistral, Qwen2).")
    get = _getter(hf, where)
    heads = get("num_attention_heads")
    groups = hf.get("num_key_value_heads") or heads
    if heads % groups:
        _unsupported(where, f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({groups})")
    if hf.get("hidden_act", "silu") != "silu":
        _unsupported(where, f"hidden_act {hf['hidden_act']!r}: these architectures use silu")
    if model_type == "llama" and (hf.get("attention_bias") or hf.get("mlp_bias")):
        _unsupported(where, "attention_bias/mlp_bias: megatron-core's Llama has no biases on o_proj and the MLP")
    if model_type == "qwen2" and (hf.get("use_sliding_window") or
                                  any(kind != "full_attention" for kind in hf.get("layer_types") or [])):
        _unsupported(where, "sliding-window layers (use_sliding_window / layer_types)")
    theta, scaling = _rope(hf, where)
    return {
        "num_layers": get("num_hidden_layers"),
        "hidden_size": get("hidden_size"),
        "ffn_hidden_size": get("intermediate_size"),
        "num_attention_heads": heads,
        "num_query_groups": groups,
        "kv_channels": hf.get("head_dim") or get("hidden_size") // heads,
        "vocab_size": get("vocab_size"),
        # Megatron pads the embedding to a multiple of this (times TP); a power of two that divides
        # the vocabulary keeps it unpadded at TP=1, so the checkpoint holds exactly HF's rows.
        "make_vocab_size_divisible_by": min(128, get("vocab_size") & -get("vocab_size")),
        "seq_length": _seq_length(hf, where, seq_length),
        "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings", False)),
        "normalization": "RMSNorm",
        "layernorm_epsilon": float(hf.get("rms_norm_eps", 1e-6)),
        "activation_func": "silu",
        "gated_linear_unit": True,
        "add_bias_linear": False,
        "add_qkv_bias": model_type == "qwen2",
        "position_embedding_type": "rope",
        "rotary_percent": 1.0,
        "rotary_base": theta,
        "rope_scaling": scaling is not None,
        "rope_scaling_factor": scaling if scaling is not None else 8.0,
        "hidden_dropout": 0.0,
        "attention_dropout": float(hf.get("attention_dropout", 0.0)),
        "init_method_std": float(hf.get("initializer_range", 0.02)),
    }


def check_exportable(model: Mapping[str, Any], where: Path) -> None:
    """Raise CheckpointError unless the model (YAML values) is one a Hugging Face Llama/Qwen2 class holds."""
    # a field this megatron-core lacks cannot hold another value
    different = [f"model.{key}={model[key]}" for key, value in LLAMA_STYLE.items()
                 if key in model and model[key] != value]
    if different:
        raise CheckpointError(
            f"{where}: export-hf writes Llama-style models (RMSNorm, SwiGLU, RoPE, no linear biases except "
            f"Qwen2's on q/k/v), and this checkpoint's model has {', '.join(different)}.")


def to_hf_config(model: Mapping[str, Any]) -> dict[str, Any]:
    """The Hugging Face config.json of a Llama-style model given by its ``model:`` YAML values.

    Biases on q/k/v make it Qwen2, else Llama (a Mistral without a sliding window is a Llama).
    """
    model_type = "qwen2" if model["add_qkv_bias"] else "llama"
    config: dict[str, Any] = {
        "architectures": [ARCHITECTURES[model_type]],
        "model_type": model_type,
        "vocab_size": model["vocab_size"],
        "hidden_size": model["hidden_size"],
        "intermediate_size": model["ffn_hidden_size"],
        "num_hidden_layers": model["num_layers"],
        "num_attention_heads": model["num_attention_heads"],
        "num_key_value_heads": model["num_query_groups"],
        "head_dim": model["kv_channels"],
        "max_position_embeddings": model["seq_length"],
        "rms_norm_eps": model["layernorm_epsilon"],
        "hidden_act": "silu",
        "rope_theta": float(model["rotary_base"]),
        "rope_scaling": ({"rope_type": "llama3", "factor": float(model["rope_scaling_factor"]), **LLAMA3_ROPE_FIXED}
                         if model["rope_scaling"] else None),
        "tie_word_embeddings": bool(model["share_embeddings_and_output_weights"]),
        "attention_dropout": model["attention_dropout"],
        "initializer_range": model["init_method_std"],
        "torch_dtype": model["params_dtype"],
    }
    if model_type == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    else:
        config.update(use_sliding_window=False, max_window_layers=model["num_layers"])
    return config


def _getter(hf: Mapping[str, Any], where: Path):
    def get(key: str) -> int:
        value = hf.get(key)
        if not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{where}: {key} is {'missing' if value is None else repr(value)}; "
                                  "a positive integer is needed.")
        return value

    return get


def _rope(hf: Mapping[str, Any], where: Path) -> tuple[int, Optional[float]]:
    """(rotary_base, Llama 3.1 scaling factor or None) from transformers 4.x or 5.x keys."""
    parameters = hf.get("rope_parameters") or {}
    scaling = hf.get("rope_scaling") or parameters
    theta = hf.get("rope_theta", parameters.get("rope_theta", 10000.0))
    if not isinstance(theta, (int, float)) or theta != int(theta):
        _unsupported(where, f"rope_theta {theta!r}: megatron-core's rotary_base is an integer")
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return int(theta), None
    if kind != "llama3":
        _unsupported(where, f"RoPE scaling {kind!r}", "Supported: none (default) and llama3 (Llama 3.1/3.2).")
    fixed = {key: scaling.get(key) for key in LLAMA3_ROPE_FIXED}
    if fixed != LLAMA3_ROPE_FIXED or not isinstance(scaling.get("factor"), (int, float)):
        _unsupported(where, f"llama3 RoPE scaling with factor {scaling.get('factor')!r} and {fixed}",
                     f"megatron-core implements a numeric factor with {LLAMA3_ROPE_FIXED} only.")
    return int(theta), float(scaling["factor"])


def _seq_length(hf: Mapping[str, Any], where: Path, wanted: Optional[int]) -> int:
    limit = hf.get("max_position_embeddings") or DEFAULT_MAX_SEQ_LENGTH
    window = hf.get("sliding_window") if hf.get("model_type") == "mistral" else None
    if window:
        limit = min(limit, window)
    if wanted is None:
        return min(limit, DEFAULT_MAX_SEQ_LENGTH)
    if wanted > limit:
        raise ConfigError("--seq-length", f"{wanted} is longer than the model supports ({limit}: "
                          f"max_position_embeddings{' / sliding_window' if window else ''} in {where}).",
                          f"Use --seq-length {limit} or less.")
    return wanted


def _unsupported(where: Path, what: str, hint: str = "") -> None:
    raise CheckpointError(f"{where}: {what}; bridge cannot convert this model." + (f" {hint}" if hint else ""))
