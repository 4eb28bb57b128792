"""The Hugging Face families bridge converts: one module each (config mapping + tensor map), and
the registry that `import-hf`, `export-hf` and `families` use. No torch import.

Import picks the family by config.json's ``model_type`` and records it in the recipe
(``checkpoint.export_hf_model_type``), so that it travels with every checkpoint trained from there. Export takes
``--model-type``, else the family the checkpoint records, else picks the first family, in registry order, whose
fixed fields the checkpoint's model has (a Mistral without its sliding window is the identical Llama, so Mistral
comes after it; Seed-OSS never: it is the identical Qwen2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.config.errors import ConfigError
from bridge_cli.convert.families.arcee import Arcee
from bridge_cli.convert.families.dots1 import Dots1
from bridge_cli.convert.families.ernie4_5 import Ernie4_5
from bridge_cli.convert.families.gemma import Gemma
from bridge_cli.convert.families.gemma2 import Gemma2
from bridge_cli.convert.families.gemma3 import Gemma3
from bridge_cli.convert.families.glm4 import Glm4
from bridge_cli.convert.families.glm4_moe import Glm4Moe
from bridge_cli.convert.families.gpt2 import Gpt2
from bridge_cli.convert.families.deepseek_v2 import DeepseekV2
from bridge_cli.convert.families.deepseek_v3 import DeepseekV3
from bridge_cli.convert.families.gpt_oss import GptOss
from bridge_cli.convert.families.llama import Llama
from bridge_cli.convert.families.llama_like import LlamaLike
from bridge_cli.convert.families.mistral import Mistral
from bridge_cli.convert.families.mixtral import Mixtral
from bridge_cli.convert.families.olmo2 import Olmo2
from bridge_cli.convert.families.olmoe import Olmoe
from bridge_cli.convert.families.phi3 import Phi3
from bridge_cli.convert.families.qwen2 import Qwen2
from bridge_cli.convert.families.qwen2_moe import Qwen2Moe
from bridge_cli.convert.families.qwen3 import Qwen3
from bridge_cli.convert.families.qwen3_moe import Qwen3Moe
from bridge_cli.convert.families.seed_oss import SeedOss
from bridge_cli.convert.families.stablelm import StableLm
from bridge_cli.convert.families.starcoder2 import Starcoder2
from bridge_cli.convert.hf_config import unsupported

FAMILIES: dict[str, LlamaLike] = {family.model_type: family
                                  for family in (Llama(), Mistral(), Qwen2(), Qwen3(), Phi3(),
                                                 Mixtral(), Qwen3Moe(), Olmoe(), Gemma3(), Gemma2(), GptOss(), Gemma(),
                                                 Starcoder2(), Olmo2(), Qwen2Moe(), Glm4(), StableLm(), Gpt2(),
                                                 SeedOss(), Arcee(), DeepseekV3(), DeepseekV2(), Glm4Moe(),
                                                 Dots1(), Ernie4_5())}
"""model_type -> its family, in the order export tries them."""

INFERRED = ("llama", "mistral", "qwen2", "qwen3", "phi3",
            "mixtral", "qwen3_moe", "olmoe", "gemma3_text", "gemma2", "gpt_oss", "gemma", "starcoder2", "olmo2",
            "qwen2_moe", "glm4", "stablelm", "gpt2", "arcee", "deepseek_v3", "deepseek_v2", "glm4_moe", "dots1",
            "ernie4_5")
"""The families export picks without --model-type."""


REFUSED: dict[str, str] = {
    "olmo3": ("its long-context releases (Olmo-3-7B-Think and Olmo-3.1-32B-Think among them) scale RoPE with YaRN "
              "(rope_scaling: factor 8 from 8192 positions, attention_factor 1.208) in their full-attention layers "
              "only, as transformers applies it, and keep plain RoPE in their sliding-window layers; megatron-core's "
              "YaRN rotates and scales every layer, and bridge's sliding-window rotary table (local_rotary_base) sits "
              "beside a plain or Llama 3.1-scaled one only"),
    "ernie4_5_moe": ("its router (ERNIE-4.5-21B-A3B, ERNIE-4.5-300B-A47B) picks each token's experts by their softmax "
                     "probabilities plus a per-expert bias (mlp.gate.moe_statics.e_score_correction_bias) and weighs "
                     "them by the probabilities alone, renormalised; megatron-core's softmax router takes no expert "
                     "bias (moe_router_enable_expert_bias needs moe_router_score_function sigmoid), so no model here "
                     "chooses the experts it chooses"),
}
"""Hugging Face model types bridge knows and does not convert yet: why, for the refusal."""


def supported() -> str:
    """'llama, mistral, ...' for error messages."""
    return ", ".join(FAMILIES)


def for_import(hf: Mapping[str, Any], where: Path) -> LlamaLike:
    """The family of config.json ``hf`` (read from ``where``), or a CheckpointError listing the supported ones."""
    model_type = hf.get("model_type")
    if model_type in REFUSED:
        unsupported(where, f"model_type {model_type!r} is not converted yet: {REFUSED[model_type]}",
                    f"Supported: {supported()}.")
    if model_type not in FAMILIES:
        unsupported(where, f"model_type {model_type!r} is not supported",
                    f"Supported: {supported()} (`bridge convert-ckpt families` lists what each covers).")
    return FAMILIES[model_type]


def for_export(model: Mapping[str, Any], model_type: Optional[str], where: Path,
               recorded: Optional[str] = None) -> LlamaLike:
    """The family to write the model (its ``model:`` YAML values, from checkpoint ``where``) as: ``model_type``
    (--model-type), else ``recorded`` (the family the checkpoint's run_config.yaml names), else the first that fits."""
    if model_type is None and recorded is not None:
        fits = [name for name in INFERRED if not FAMILIES[name].differences(model)]
        hint = (f"Export with --model-type {fits[0]} (the family it fits)." if fits else
                "No family holds it (export without --model-type says why).")
        if recorded not in FAMILIES:
            raise CheckpointError(f"{where}: its run_config.yaml records the family {recorded!r} "
                                  f"(checkpoint.export_hf_model_type), which bridge does not convert. {hint}")
        different = FAMILIES[recorded].differences(model)
        if different:
            raise CheckpointError(f"{where}: its run_config.yaml records the family {recorded} "
                                  "(checkpoint.export_hf_model_type: the one it was imported from), and a "
                                  f"{recorded} model cannot hold its model, which has {', '.join(different)}. {hint}")
        return FAMILIES[recorded]
    if model_type is not None:
        if model_type not in FAMILIES:
            raise ConfigError("--model-type", f"{model_type!r} is not a family bridge converts.",
                              f"Choose one of {supported()}.")
        different = FAMILIES[model_type].differences(model)
        if different:
            raise CheckpointError(f"{where}: a {model_type} model cannot hold this checkpoint's model, which has "
                                  f"{', '.join(different)}. Export without --model-type to pick the family it fits.")
        return FAMILIES[model_type]
    for name in INFERRED:
        if not FAMILIES[name].differences(model):
            return FAMILIES[name]
    closest = min((FAMILIES[name] for name in INFERRED), key=lambda family: len(family.differences(model)))
    raise CheckpointError(
        f"{where}: export-hf writes Llama-style models ({supported()}: RMSNorm, SwiGLU, RoPE, no linear biases "
        f"except Qwen2's on q/k/v, GPT-OSS's and StarCoder2's, whose LayerNorm GELU layers have them all; GPT-2 with "
        f"learned positions; Arcee's squared-ReLU MLP), and this checkpoint's model has "
        f"{', '.join(closest.differences(model))} (differences from the closest family, {closest.model_type}).")


def listing() -> list[str]:
    """One line per family: model_type, what it covers, what it refuses; then one per refused model_type, why."""
    width = max(map(len, [*FAMILIES, *REFUSED]))
    return [*(f"{name:<{width}}  {family.models}. Limits: {family.limits}." for name, family in FAMILIES.items()),
            *(f"{name:<{width}}  not converted: {why}." for name, why in REFUSED.items())]
