"""``phi3``: Llama's layout with q/k/v fused into ``qkv_proj`` and gate/up into ``gate_up_proj``."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert import hf_config
from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.families.windows import every_layer, window_config
from bridge_cli.convert.hf_weights import Architecture, Layout, Pair


class Phi3(LlamaLike):
    """Phi-3 text models with plain RoPE (the 4k ones; the 128k ones, Phi-3.5 and Phi-4-mini use LongRoPE).

    ``qkv_proj`` is ``[q; k; v]``, split on import into megatron-core's per-group interleave and
    fused again on export; ``gate_up_proj`` is ``[gate; up]``, which is megatron-core's
    ``linear_fc1`` as it is. ``partial_rotary_factor`` is megatron-core's ``rotary_percent`` (both
    rotate the first part of each head). A sliding window in every layer, as Mistral's.
    """

    model_type = "phi3"
    architecture = "Phi3ForCausalLM"
    models = "Phi-3-mini/medium 4k; fused qkv and gate_up, partial RoPE"
    limits = "refuses LongRoPE (the 128k models) and other RoPE scalings but llama3 and yarn (on whole heads)"
    rope_hint = ("LongRoPE (Phi-3 128k: per-dimension short/long factors switched by length) has no "
                 "megatron-core counterpart. ")
    mapped_keys = (*LlamaLike.mapped_keys, "sliding_window", "original_max_position_embeddings")
    inert_keys = (*LlamaLike.inert_keys, "resid_pdrop", "embd_pdrop")
    fixed = {key: value for key, value in LlamaLike.fixed.items() if key not in ("rotary_percent", "window_size")}
    windows = "every_layer"

    def layer_kinds(self, hf: Mapping[str, Any], count: int, where: Path) -> list[str]:
        return every_layer(hf, count)

    def rotary_percent(self, hf: Mapping[str, Any], where) -> float:
        return hf_config.partial_rotary_factor(hf, where)

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        # token ids belong to the tokenizer, and Phi-3's default pad id (32000) would not fit a smaller vocabulary
        return {"sliding_window": window_config(model)["sliding_window"],
                "partial_rotary_factor": model["rotary_percent"], "pad_token_id": None}

    def attention_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        q_rows, kv_rows, _ = arch.qkv_rows
        h = arch.hidden_size
        return [Pair(m + "linear_qkv.weight", ((p + "qkv_proj.weight", (q_rows + 2 * kv_rows, h)),), Layout.FUSED_QKV),
                Pair(m + "linear_proj.weight", ((p + "o_proj.weight", (h, q_rows)),))]

    def mlp_pairs(self, arch: Architecture, m: str, p: str) -> list[Pair]:
        h, f = arch.hidden_size, arch.ffn_hidden_size
        return [Pair(m + "linear_fc1.weight", ((p + "gate_up_proj.weight", (2 * f, h)),)),
                Pair(m + "linear_fc2.weight", ((p + "down_proj.weight", (h, f)),))]
