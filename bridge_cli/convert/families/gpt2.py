"""``gpt2``: learned absolute positions, LayerNorms with biases, a plain tanh-GELU MLP, Conv1D linears with biases."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from bridge_cli.config.errors import ConfigError
from bridge_cli.convert import hf_config
from bridge_cli.convert.families.llama_like import INERT_KEYS, LLAMA_STYLE, LlamaLike
from bridge_cli.convert.hf_config import unsupported
from bridge_cli.convert.hf_weights import Architecture, Layout, Pair

ROPE_ONLY = ("rotary_percent", "rotary_interleaved", "seq_len_interpolation_factor", "local_rotary_base")
"""Fields of the Llama layout that only RoPE reads."""

ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
"""transformers' names of the tanh GELU, megatron-core's ``fast_gelu``."""


class Gpt2(LlamaLike):
    """GPT-2 (124M to 1.5B) and DistilGPT2 (``GPT2LMHeadModel``).

    Its ``wpe`` is megatron-core's learned absolute position embedding, which has ``model.seq_length``
    rows: ``n_positions``. The norms are LayerNorms with a bias; the MLP is ungated, its ``gelu_new``
    megatron-core's ``fast_gelu``, unfused as StarCoder2's. Every linear is a Conv1D with a bias, its
    weight the transpose of megatron-core's; ``c_attn`` is ``[q; k; v]``, split on import into
    megatron-core's per-head interleave (all heads are their own query group) and fused again on export.
    The output layer is the token embedding.
    """

    model_type = "gpt2"
    architecture = "GPT2LMHeadModel"
    models = "GPT-2 124M-1.5B, DistilGPT2; learned positions, LayerNorm, tanh GELU, Conv1D linears with biases"
    limits = ("refuses scale_attn_by_inverse_layer_idx, reorder_and_upcast_attn, scale_attn_weights=false, "
              "activations other than gelu_new/gelu_pytorch_tanh, untied lm_head and cross-attention; "
              "model.seq_length is n_positions")
    mapped_keys = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "n_inner", "activation_function",
                   "attn_pdrop", "layer_norm_epsilon", "initializer_range")
    assumed = {"scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
               "add_cross_attention": False, "tie_word_embeddings": True}
    # dropout in training, and the summary_* of the sequence-classification head, which GPT2LMHeadModel has not
    inert_keys = (*INERT_KEYS, "resid_pdrop", "embd_pdrop", "summary_type", "summary_use_proj", "summary_activation",
                  "summary_proj_to_labels", "summary_first_dropout")
    fixed = {**{key: value for key, value in LLAMA_STYLE.items() if key not in ROPE_ONLY},
             "position_embedding_type": "learned_absolute", "normalization": "LayerNorm",
             "activation_func": "fast_gelu", "gated_linear_unit": False, "add_bias_linear": True,
             "add_qkv_bias": True, "share_embeddings_and_output_weights": True}
    pre_norms = ("ln_1", "ln_2")
    norm_bias = True
    hf_embedding = "transformer.wte"
    hf_layers = "transformer.h"
    hf_attention = "attn"
    hf_final_norm = "transformer.ln_f"
    epsilon_key = "layer_norm_epsilon"

    # config.json -> model fields

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length: Optional[int] = None) -> dict[str, Any]:
        positions = hf_config.getter(hf, where)("n_positions")
        if seq_length not in (None, positions):
            raise ConfigError("--seq-length", f"{seq_length}: GPT-2's position embedding has n_positions "
                              f"({positions}, {where}) rows, and megatron-core's has model.seq_length.",
                              "Import without --seq-length.")
        return {**super().fields(hf, where), "seq_length": positions, "attention_dropout": float(hf["attn_pdrop"]),
                "bias_activation_fusion": False}

    def shape(self, hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
        get = hf_config.getter(hf, where)
        hidden, heads = get("n_embd"), get("n_head")
        if hidden % heads:
            unsupported(where, f"n_embd ({hidden}) is not a multiple of n_head ({heads})")
        return {"num_layers": get("n_layer"), "hidden_size": hidden, "ffn_hidden_size": hf.get("n_inner") or 4 * hidden,
                "num_attention_heads": heads, "num_query_groups": heads, "kv_channels": hidden // heads,
                "vocab_size": get("vocab_size")}

    def activation(self, hf: Mapping[str, Any], where: Path) -> str:
        if hf["activation_function"] not in ACTIVATIONS:
            unsupported(where, f"activation_function {hf['activation_function']!r}: the gpt2 family uses the tanh "
                        f"GELU ({' or '.join(ACTIVATIONS)}), megatron-core's fast_gelu")
        return "fast_gelu"

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        if hf.get("scale_attn_by_inverse_layer_idx"):
            unsupported(where, "scale_attn_by_inverse_layer_idx: megatron-core scales every layer's attention "
                        "scores alike")
        if hf.get("reorder_and_upcast_attn"):
            unsupported(where, "reorder_and_upcast_attn: transformers' eager attention then computes the scores "
                        "in float32, megatron-core's in the model's dtype")
        if not hf["scale_attn_weights"]:
            unsupported(where, "scale_attn_weights false: this family keeps megatron-core's 1/sqrt(head size) "
                        "scale of the attention scores")
        if not hf["tie_word_embeddings"]:
            unsupported(where, "tie_word_embeddings false: GPT2LMHeadModel's lm_head is its token embedding, "
                        "and this family fixes share_embeddings_and_output_weights on")
        if hf.get("add_cross_attention"):
            unsupported(where, "add_cross_attention: megatron-core's GPTModel is a decoder without cross-attention")

    def position_fields(self, hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
        return {}

    # model fields -> config.json

    def differences(self, model: Mapping[str, Any]) -> list[str]:
        heads = model["num_attention_heads"]
        full_heads = {"num_query_groups": heads, "kv_channels": model["hidden_size"] // heads}
        return [*super().differences(as_imported(model)), *(f"model.{key}={model[key]}"
                                                             for key, value in full_heads.items()
                                                             if model.get(key) not in (None, value))]

    def hf_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": model["vocab_size"],
            "n_embd": model["hidden_size"],
            "n_inner": model["ffn_hidden_size"],
            "n_layer": model["num_layers"],
            "n_head": model["num_attention_heads"],
            "n_positions": model["seq_length"],
            "layer_norm_epsilon": model["layernorm_epsilon"],
            "activation_function": "gelu_new",
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
            "tie_word_embeddings": True,
            "attn_pdrop": model["attention_dropout"], "resid_pdrop": 0.0, "embd_pdrop": 0.0,
            "initializer_range": model["init_method_std"],
            "torch_dtype": model["params_dtype"],
            # token ids belong to the tokenizer (transformers' defaults, 50256, would not fit a smaller vocabulary)
            "bos_token_id": None, "eos_token_id": None,
        }

    # tensors

    def embedding_pairs(self, arch: Architecture) -> list[Pair]:
        return [*super().embedding_pairs(arch),
                Pair("embedding.position_embeddings.weight", (("transformer.wpe.weight",
                                                               (arch.positions, arch.hidden_size)),))]

    def attention_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        h = arch.hidden_size
        return [*conv1d(m + "linear_qkv", p + "c_attn", h, 3 * h, fused_qkv=True),
                *conv1d(m + "linear_proj", p + "c_proj", h, h)]

    def mlp_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        h, f = arch.hidden_size, arch.ffn_hidden_size
        return [*conv1d(m + "linear_fc1", p + "c_fc", h, f), *conv1d(m + "linear_fc2", p + "c_proj", f, h)]


def conv1d(mcore: str, hf: str, inputs: int, outputs: int, fused_qkv: bool = False) -> list[Pair]:
    """megatron-core's linear ``mcore`` (weight and bias) and Hugging Face's Conv1D ``hf`` (weight ``[in, out]``);
    ``fused_qkv``: its outputs are ``[q; k; v]``."""
    return [Pair(f"{mcore}.weight", ((f"{hf}.weight", (inputs, outputs)),),
                 Layout.FUSED_QKV_T if fused_qkv else Layout.TRANSPOSED),
            Pair(f"{mcore}.bias", ((f"{hf}.bias", (outputs,)),), Layout.FUSED_QKV if fused_qkv else Layout.SAME)]


def as_imported(model: Mapping[str, Any]) -> dict[str, Any]:
    """``model`` with the fields a GPT-2 trained from bridge's ``gpt`` model config (``recipe=gpt2_124m``) holds in
    other words than an imported one: megatron-core's fused bias-GELU (``gelu`` with ``bias_activation_fusion``, of
    an ungated MLP with biases) is the tanh GELU, ``fast_gelu``; and ``add_bias_linear`` gives q/k/v their bias
    whatever ``add_qkv_bias`` says."""
    same = dict(model)
    if same.get("add_bias_linear"):
        same["add_qkv_bias"] = True
        if same.get("activation_func") == "gelu" and same.get("bias_activation_fusion") and not same.get(
                "gated_linear_unit"):
            same["activation_func"] = "fast_gelu"
    return same
