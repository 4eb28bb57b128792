"""The Llama layout that llama, mistral, qwen2, qwen3 and phi3 share: config mapping and tensor map.

All are megatron-core GPTModels with RMSNorm, SwiGLU, RoPE and grouped-query attention. A family
is a subclass of :class:`LlamaLike` that changes only what differs from Llama (biases on q/k/v,
per-head q/k norms, fused projections, sliding windows, its own config.json keys). No torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Collection, Mapping, Optional

from bridge_cli.convert import hf_config, yarn
from bridge_cli.convert.families import hf_defaults
from bridge_cli.convert.families.windows import LAYER_TYPES, window_differences, window_fields
from bridge_cli.convert.hf_config import LLAMA3_ROPE_FIXED, unsupported
from bridge_cli.convert.hf_weights import Architecture, Layout, Pair

LLAMA_STYLE = {
    "normalization": "RMSNorm", "activation_func": "silu", "gated_linear_unit": True, "add_bias_linear": False,
    "position_embedding_type": "rope", "rotary_percent": 1.0, "rotary_interleaved": False,
    "seq_len_interpolation_factor": None, "qk_layernorm": False, "qk_layernorm_across_heads": False,
    "num_moe_experts": None,
    "multi_latent_attention": False, "layernorm_zero_centered_gamma": False,
    "apply_residual_connection_post_layernorm": False, "post_sublayer_norm": False, "pre_sublayer_norm": True,
    "scale_embeddings": False,
    "local_rotary_base": None, "softmax_scale": None, "softmax_type": "vanilla", "window_size": None,
    "attn_logit_softcapping": None, "final_logit_softcapping": None,
}
"""The model fields every family here fixes (the shapes aside), unless it overrides one."""
LLAMA_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "max_position_embeddings", "hidden_act", "rms_norm_eps",
              "tie_word_embeddings", "rope_parameters", "attention_dropout", "initializer_range")
"""The config.json keys the Llama layout reads into the model's fields."""
INERT_KEYS = ("use_cache", "pad_token_id", "bos_token_id", "eos_token_id")
"""config.json keys that leave the logits alone: generation settings and the tokenizer's ids."""
_YARN_FOR_ROPE = ("position_embedding_type", "rope", "yarn")
"""(field, fixed value, model's value) that differences() accepts: a family of plain RoPE takes YaRN's too."""


class LlamaLike:
    """One Hugging Face family of the Llama layout. Subclasses set the attributes and override the hooks."""

    model_type = "llama"
    """config.json's ``model_type``."""
    architecture = "LlamaForCausalLM"
    """The transformers class an exported folder is loaded with."""
    models = "Llama 2, 3, 3.1, 3.2; tied or untied embeddings; Llama 3.1 and YaRN RoPE scaling"
    """What the family covers, for `bridge convert-ckpt families`."""
    limits = "refuses attention_bias/mlp_bias and RoPE scalings other than llama3 and yarn"
    """What its import refuses, for `bridge convert-ckpt families`."""
    rope_hint = ""
    """Why this family's other RoPE scalings cannot be expressed (starts the refusal's hint)."""
    fixed = {**LLAMA_STYLE, "add_qkv_bias": False}
    """The model fields this family fixes; export refuses a checkpoint whose model differs."""
    pre_norms: Optional[tuple[str, str]] = ("input_layernorm", "post_attention_layernorm")
    """Hugging Face's names of a layer's norms before the attention and before the MLP (None: it has none)."""
    post_norms: Optional[tuple[str, str]] = None
    """Its names of the norms after the attention and after the MLP (``post_sublayer_norm``; None: none)."""
    norm_bias = False
    """Whether every norm, the final one included, has a bias (a LayerNorm's) besides its weight."""
    hf_embedding = "model.embed_tokens"
    """Hugging Face's name of the token embedding."""
    hf_layers = "model.layers"
    """Its prefix of the decoder layers (``<hf_layers>.<i>.``)."""
    hf_attention = "self_attn"
    """Its name of a layer's attention."""
    hf_final_norm = "model.norm"
    """Its name of the norm after the last layer."""
    epsilon_key = "rms_norm_eps"
    """config.json's key of the norms' epsilon."""
    mapped_keys: tuple[str, ...] = LLAMA_KEYS
    """The config.json keys (fields of transformers' config class) that become the model's fields."""
    assumed: Mapping[str, Any] = {"attention_bias": False, "mlp_bias": False}
    """config.json keys whose value the converted model assumes (a bool: its truth); another is refused."""
    inert_keys: tuple[str, ...] = INERT_KEYS
    """config.json keys that do not change what the model computes (generation, token ids, dropout in training,
    which is the recipe's model.hidden_dropout)."""
    windows: Optional[str] = None
    """Where the family's sliding window may be: None (nowhere; ``window_size`` is a fixed field), "every_layer"
    (in every layer or none, Mistral's) or "per_layer" (:meth:`layer_kinds` says)."""

    # config.json -> model fields

    def model_fields(self, hf: Mapping[str, Any], where: Path, seq_length: Optional[int] = None,
                     tensors: Optional[Collection[str]] = None) -> dict[str, Any]:
        """The recipe's ``model:`` fields for config.json ``hf`` (read from ``where``), a key it lacks meaning what
        transformers' config class of the family makes of it.

        ``seq_length`` overrides the default (max_position_embeddings capped at
        DEFAULT_MAX_SEQ_LENGTH); ``tensors``, the names of the folder's tensors, adds what they decide
        (:meth:`tensor_fields`). Raises CheckpointError for what megatron-core cannot build exactly.
        """
        hf = self.completed(hf)
        fields = self.fields(hf, where, seq_length)
        self.check_assumed(hf, where)  # after the family's own checks, whose refusals say more
        return fields if tensors is None else {**fields, **self.tensor_fields(hf, where, fields, tensors)}

    def tensor_fields(self, hf: Mapping[str, Any], where: Path, fields: Mapping[str, Any],
                      tensors: Collection[str]) -> dict[str, Any]:
        """The model's fields that the folder's tensor names (``tensors``) decide beyond config.json ``hf``: none
        here (DeepSeek-V3's multi-token-prediction layers, which transformers' own saves leave out)."""
        return {}

    def completed(self, hf: Mapping[str, Any]) -> dict[str, Any]:
        """config.json ``hf`` with transformers' default for each key it lacks, and its RoPE settings in
        ``rope_parameters`` (:func:`~bridge_cli.convert.families.hf_defaults.complete`)."""
        return hf_defaults.complete(self.model_type, hf)

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length: Optional[int] = None) -> dict[str, Any]:
        """model_fields of the completed config.json ``hf``; the hook a family overrides."""
        shape = self.shape(hf, where)
        activation = self.activation(hf, where)
        self.check(hf, where)
        vocab = shape["vocab_size"]
        return {
            **shape,
            # Megatron pads the embedding to a multiple of this (times TP); a power of two that divides
            # the vocabulary keeps it unpadded at TP=1, so the checkpoint holds exactly HF's rows.
            "make_vocab_size_divisible_by": min(128, vocab & -vocab),
            "seq_length": hf_config.seq_length(hf, where, seq_length, self.longest(hf, where)),
            "share_embeddings_and_output_weights": bool(hf.get("tie_word_embeddings")),
            "normalization": "RMSNorm",
            "layernorm_epsilon": float(hf[self.epsilon_key]),
            "activation_func": activation,
            "gated_linear_unit": True,
            "add_bias_linear": False,
            "qk_layernorm": False,
            "position_embedding_type": "rope",
            **self.own_fixed(),
            **self.position_fields(hf, where),
            "hidden_dropout": 0.0,
            "attention_dropout": float(hf.get("attention_dropout", 0.0)),
            "init_method_std": float(hf.get("initializer_range", 0.02)),
            # null where a family with windows has none, so the recipe says so (bridge_cli/convert/old_imports.py
            # tells an import that capped seq_length at the window instead by the key's absence)
            **({"window_size": None} if self.windows else {}),
            **window_fields(hf, self.layer_kinds(hf, shape["num_layers"], where), where),
        }

    def shape(self, hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
        """The model's layer count and sizes (attention heads and groups, FFN, vocabulary) for config.json's."""
        get = hf_config.getter(hf, where)
        heads = get("num_attention_heads")
        groups = hf.get("num_key_value_heads") or heads
        if heads % groups:
            unsupported(where, f"num_attention_heads ({heads}) is not a multiple of num_key_value_heads ({groups})")
        return {
            "num_layers": get("num_hidden_layers"),
            "hidden_size": get("hidden_size"),
            "ffn_hidden_size": get("intermediate_size"),
            "num_attention_heads": heads,
            "num_query_groups": groups,
            "kv_channels": hf.get("head_dim") or get("hidden_size") // heads,
            "vocab_size": get("vocab_size"),
        }

    def own_fixed(self) -> dict[str, Any]:
        """The fixed fields where this family departs from the Llama layout (LLAMA_STYLE), which its recipes set."""
        return {key: value for key, value in self.fixed.items() if key not in LLAMA_STYLE or LLAMA_STYLE[key] != value}

    def activation(self, hf: Mapping[str, Any], where: Path) -> str:
        """model.activation_func for config.json's activation."""
        if hf.get("hidden_act", "silu") != "silu":
            unsupported(where, f"hidden_act {hf['hidden_act']!r}: the {self.model_type} family uses silu")
        return "silu"

    def position_fields(self, hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
        """The model's fields of its position embedding (RoPE's, here; YaRN-scaled RoPE where config.json says so)."""
        rotary_percent = self.rotary_percent(hf, where)
        if yarn.is_yarn(hf):
            if rotary_percent != 1.0:
                unsupported(where, f"yarn with RoPE on {rotary_percent} of each head: megatron-core's YaRN rotates "
                                   "whole heads")
            if self.fixed.get("rotary_interleaved"):
                unsupported(where, f"yarn with the {self.model_type} family's interleaved RoPE: megatron-core's YaRN "
                                   "rotates the two halves of each head")
        return {"rotary_percent": rotary_percent, **self.rope_fields(hf, where)}

    def rope_fields(self, hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
        """The model's RoPE base and scaling fields for config.json's RoPE settings."""
        if yarn.is_yarn(hf):
            return yarn.model_fields(hf, where, default_theta=10_000.0)
        theta, scaling = hf_config.rope(hf, where, self.rope_hint)
        return {"rotary_base": theta, "rope_scaling": scaling is not None,
                "rope_scaling_factor": scaling if scaling is not None else 8.0}

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        """Refuse config.json settings this family's megatron-core model cannot express."""
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            unsupported(where, "attention_bias/mlp_bias: megatron-core's Llama has no biases on o_proj and the MLP")

    def check_assumed(self, hf: Mapping[str, Any], where: Path) -> None:
        """Refuse a config.json value other than the one the converted model assumes (:attr:`assumed`)."""
        for key, value in self.assumed.items():
            given = hf.get(key, value)
            if (bool(given) != value) if isinstance(value, bool) else given != value:
                unsupported(where, f"{key} {given!r}: bridge converts a {self.model_type} model with {key} {value!r}")

    def layer_kinds(self, hf: Mapping[str, Any], count: int, where: Path) -> list[str]:
        """Each of the ``count`` layers' attention, as transformers' model of the family reads config.json:
        "sliding_attention" (windowed, ``sliding_window``) or "full_attention"."""
        return [LAYER_TYPES[1]] * count

    def longest(self, hf: Mapping[str, Any], where: Path) -> Optional[int]:
        """The longest sequence the model takes where max_position_embeddings understates it (YaRN's); None: that."""
        return yarn.context_length(hf, where) if yarn.is_yarn(hf) else None

    def rotary_percent(self, hf: Mapping[str, Any], where: Path) -> float:
        """The fraction of each head that RoPE rotates: all of it, here (families that rotate part override this)."""
        factor = hf_config.partial_rotary_factor(hf, where)
        if factor != 1.0:
            unsupported(where, f"partial_rotary_factor {factor!r}: bridge converts a {self.model_type} model with RoPE "
                               "on whole heads (phi3, glm4 and stablelm rotate part of each head)")
        return 1.0

    # model fields -> config.json

    def differences(self, model: Mapping[str, Any]) -> list[str]:
        """``model.KEY=VALUE`` for each fixed field that the model (YAML values) sets otherwise."""
        # a field this megatron-core lacks cannot hold another value; RoPE may be YaRN's (config.json says so)
        out = [f"model.{key}={model[key]}" for key, value in self.fixed.items()
               if key in model and model[key] != value and (key, value, model[key]) != _YARN_FOR_ROPE]
        if self.windows is not None:
            out += window_differences(model, self.model_type, every_layer=self.windows == "every_layer")
        return out + (yarn.differences(model) if model.get("position_embedding_type") == "yarn" else [])

    def hf_config(self, model: Mapping[str, Any]) -> dict[str, Any]:
        """The config.json of the model given by its ``model:`` YAML values."""
        return {
            "architectures": [self.architecture],
            "model_type": self.model_type,
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
            "rope_scaling": self.hf_rope_scaling(model),
            "tie_word_embeddings": bool(model["share_embeddings_and_output_weights"]),
            "attention_dropout": model["attention_dropout"],
            "initializer_range": model["init_method_std"],
            "torch_dtype": model["params_dtype"],
            **self.hf_extras(model),
        }

    def hf_rope_scaling(self, model: Mapping[str, Any]) -> Optional[dict[str, Any]]:
        """config.json's ``rope_scaling``: YaRN's, Llama 3.1's or none."""
        if model.get("position_embedding_type") == "yarn":
            return yarn.hf_rope_scaling(model)
        if model["rope_scaling"]:
            return {"rope_type": "llama3", "factor": float(model["rope_scaling_factor"]), **LLAMA3_ROPE_FIXED}
        return None

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        """config.json keys of this family alone."""
        return {"attention_bias": False, "mlp_bias": False}

    # tensors

    def pairs(self, arch: Architecture) -> list[Pair]:
        """Every parameter of the model, in the order a Hugging Face checkpoint lists them."""
        h, v = arch.hidden_size, arch.vocab_size
        out = self.embedding_pairs(arch)
        for i in range(arch.num_layers):
            out += self.layer_pairs(arch, i, f"decoder.layers.{i}.", f"{self.hf_layers}.{i}.")
        out += self.norm_pairs(arch, "decoder.final_layernorm", self.hf_final_norm)
        if not arch.tied:
            out.append(Pair("output_layer.weight", (("lm_head.weight", (v, h)),), Layout.VOCAB))
        return out

    def embedding_pairs(self, arch: Architecture) -> list[Pair]:
        """The embedding before the first layer."""
        return [Pair("embedding.word_embeddings.weight",
                     ((f"{self.hf_embedding}.weight", (arch.vocab_size, arch.hidden_size)),), Layout.VOCAB)]

    def layer_pairs(self, arch: Architecture, layer: int, m: str, p: str) -> list[Pair]:
        """Decoder layer ``layer``: megatron-core names under ``m``, Hugging Face's under ``p``."""
        def norm(mcore: str, hf: str) -> list[Pair]:
            return self.norm_pairs(arch, m + mcore, p + hf)

        pre, post = self.pre_norms, self.post_norms
        return [*(norm("input_layernorm", pre[0]) if pre else []),
                *self.attention_pairs(arch, m + "self_attention.", f"{p}{self.hf_attention}."),
                *(norm("self_attn_bda.norm", post[0]) if post else []),
                *(norm("pre_mlp_layernorm", pre[1]) if pre else []),
                *self.feed_forward_pairs(arch, layer, m + "mlp.", p + "mlp."),
                *(norm("mlp_bda.norm", post[1]) if post else [])]

    def norm_pairs(self, arch: Architecture, mcore: str, hf: str) -> list[Pair]:
        """One norm: megatron-core's ``mcore``, Hugging Face's ``hf`` (its weight, and its bias with ``norm_bias``)."""
        kinds = ("weight", "bias") if self.norm_bias else ("weight",)
        return [Pair(f"{mcore}.{kind}", ((f"{hf}.{kind}", (arch.hidden_size,)),)) for kind in kinds]

    def attention_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        """One layer's attention: megatron-core names under ``m``, Hugging Face's under ``p``."""
        h = arch.hidden_size
        q_rows, kv_rows, _ = arch.qkv_rows
        out = [Pair(m + "linear_qkv.weight", ((p + "q_proj.weight", (q_rows, h)), (p + "k_proj.weight", (kv_rows, h)),
                                              (p + "v_proj.weight", (kv_rows, h))), Layout.QKV)]
        if arch.qkv_bias:
            out.append(Pair(m + "linear_qkv.bias", ((p + "q_proj.bias", (q_rows,)), (p + "k_proj.bias", (kv_rows,)),
                                                    (p + "v_proj.bias", (kv_rows,))), Layout.QKV))
        if arch.qk_norm:
            out += [Pair(m + "q_layernorm.weight", ((p + "q_norm.weight", (arch.kv_channels,)),)),
                    Pair(m + "k_layernorm.weight", ((p + "k_norm.weight", (arch.kv_channels,)),))]
        return out + [Pair(m + "linear_proj.weight", ((p + "o_proj.weight", (h, q_rows)),))]

    def feed_forward_pairs(self, arch: Architecture, layer: int, m: str, p: str) -> list[Pair]:
        """Layer ``layer``'s feed-forward block (the MLP; an MoE family's experts where it has them)."""
        return self.mlp_pairs(arch, m, p)

    def mlp_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        """One layer's MLP: megatron-core names under ``m``, Hugging Face's under ``p``."""
        h, f = arch.hidden_size, arch.ffn_hidden_size
        return [Pair(m + "linear_fc1.weight", ((p + "gate_proj.weight", (f, h)), (p + "up_proj.weight", (f, h))),
                     Layout.GATE_UP),
                Pair(m + "linear_fc2.weight", ((p + "down_proj.weight", (h, f)),))]


def across_heads_qk_norms(pairs: list[Pair], arch: Architecture, m: str, p: str) -> list[Pair]:
    """``pairs`` of one layer's attention with its per-head q/k norms swapped for norms over each token's whole
    query and key projections (OLMoE, OLMo 2: megatron-core's ``qk_layernorm_across_heads``)."""
    q_rows, kv_rows, _ = arch.qkv_rows
    per_head = ("q_layernorm.weight", "k_layernorm.weight")
    return [pair for pair in pairs if not pair.mcore.endswith(per_head)] + [
        Pair(m + "q_layernorm.weight", ((p + "q_norm.weight", (q_rows,)),)),
        Pair(m + "k_layernorm.weight", ((p + "k_norm.weight", (kv_rows,)),))]
