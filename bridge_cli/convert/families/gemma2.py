"""``gemma2``: Gemma 2 (Gemma2ForCausalLM), Gemma 3's layout (:mod:`.gemma3`) without its q/k norms and
its second RoPE base, with soft-capped attention scores and output logits.

Every other layer is sliding-window, the first included (``layer_types``, or
``sliding_window_pattern`` 2); ``attn_logit_softcapping`` (50) and ``final_logit_softcapping`` (30)
become the model fields of the same names, which the ``torch`` spec's attention and the output
layer apply.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert import hf_config
from bridge_cli.convert.families.gemma3 import Gemma3
from bridge_cli.convert.hf_config import unsupported


class Gemma2(Gemma3):
    """Gemma 2 (2B, 9B, 27B)."""

    model_type = "gemma2"
    architecture = "Gemma2ForCausalLM"
    models = ("Gemma 2 (Gemma2ForCausalLM); alternating sliding-window and global layers, soft-capped attention "
              "scores and logits, 1 + w RMSNorms, post-attention/feedforward norms, scaled embeddings")
    limits = "refuses attention_bias and RoPE scalings; needs model.spec=torch (the soft-capped attention)"
    fixed = {**Gemma3.fixed, "qk_layernorm": False, "local_rotary_base": None}
    window_pattern = 2

    def fields(self, hf: Mapping[str, Any], where: Path, seq_length=None) -> dict[str, Any]:
        return {**super().fields(hf, where, seq_length), "qk_layernorm": False}

    def rope_fields(self, hf: Mapping[str, Any], where: Path) -> dict[str, Any]:
        parameters = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        kind = hf_config.rope_kind(parameters)
        if kind != "default":
            unsupported(where, f"RoPE scaling {kind!r}: Gemma 2's RoPE is unscaled")
        theta = parameters.get("rope_theta", hf.get("rope_theta", 10_000.0))
        return {"rotary_base": hf_config.integer_theta(theta, "rope_theta", where), "local_rotary_base": None,
                "seq_len_interpolation_factor": None, "rope_scaling": False, "rope_scaling_factor": 8.0}

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        extras = super().hf_extras(model)
        del extras["rope_local_base_freq"]
        return extras
