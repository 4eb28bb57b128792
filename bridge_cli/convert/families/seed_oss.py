"""``seed_oss``: ByteDance Seed-OSS (SeedOssForCausalLM), Llama's layout with biases on q, k and v."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.hf_config import unsupported


class SeedOss(LlamaLike):
    """Seed-OSS-36B (Base, Instruct). ``attention_bias`` biases q, k and v only (megatron-core's ``add_qkv_bias``,
    as Qwen2's), ``head_dim`` is explicit; its ``residual_dropout`` on the attention and MLP outputs acts in
    training alone (megatron-core's ``hidden_dropout``, 0 as for every family). The same model as a Qwen2, so
    export writes it only with ``--model-type seed_oss``."""

    model_type = "seed_oss"
    architecture = "SeedOssForCausalLM"
    models = "Seed-OSS-36B; biases on q/k/v, explicit head_dim"
    limits = "refuses attention_bias=false, attention_out_bias, mlp_bias and RoPE scalings other than llama3 and yarn"
    assumed = {"attention_bias": True, "attention_out_bias": False, "mlp_bias": False}
    inert_keys = (*LlamaLike.inert_keys, "residual_dropout", "pretraining_tp")  # transformers 5 ignores the latter
    fixed = {**LlamaLike.fixed, "add_qkv_bias": True}

    def check(self, hf: Mapping[str, Any], where: Path) -> None:
        if not hf.get("attention_bias", True):
            unsupported(where, "attention_bias false: this family fixes the q/k/v biases on")
        if hf.get("attention_out_bias") or hf.get("mlp_bias"):
            unsupported(where, "attention_out_bias/mlp_bias: megatron-core puts the o_proj and MLP biases under one "
                        "switch (add_bias_linear), and Seed-OSS has neither")

    def hf_extras(self, model: Mapping[str, Any]) -> dict[str, Any]:
        return {"attention_bias": True, "attention_out_bias": False, "mlp_bias": False, "residual_dropout": 0.0}
