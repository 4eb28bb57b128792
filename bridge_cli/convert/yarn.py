"""YaRN RoPE (config.json's ``rope_type: yarn``) <-> megatron-core's ``position_embedding_type=yarn`` fields.

transformers and megatron-core compute the same table: frequencies blended between the original and the
``factor``-interpolated ones over a ramp set by ``beta_fast``/``beta_slow`` (its ends rounded when ``truncate``,
megatron-core's ``yarn_correction_range_round_to_int``), and cos/sin scaled by an attention factor that both
derive from ``factor``, ``mscale`` and ``mscale_all_dim``. Both rotate the two halves of whole heads. No torch.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert import hf_config
from bridge_cli.convert.hf_config import unsupported


def is_yarn(hf: Mapping[str, Any]) -> bool:
    return hf_config.rope_kind(hf_config.rope_settings(hf)) == "yarn"


def model_fields(hf: Mapping[str, Any], where: Path, default_theta: float) -> dict[str, Any]:
    """The model's position fields for a config.json whose RoPE is YaRN; refuses what megatron-core's differs in."""
    parameters = hf_config.rope_settings(hf)
    partial = parameters.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        unsupported(where, f"partial_rotary_factor {partial!r} with yarn: megatron-core's YaRN rotates whole heads")
    factor, original = _factor_and_original(hf, where)
    # transformers uses mscale and mscale_all_dim only when both are set and non-zero
    mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if not (mscale and mscale_all_dim):
        mscale, mscale_all_dim = 1.0, 0.0
    wanted = parameters.get("attention_factor")
    derived = attention_factor(factor, mscale, mscale_all_dim)
    if wanted is not None and wanted != derived:
        unsupported(where, f"yarn attention_factor {wanted!r}: megatron-core scales cos/sin by the factor "
                           f"that factor, mscale and mscale_all_dim give ({derived!r})")
    return {"position_embedding_type": "yarn", "rotary_percent": 1.0,
            "rotary_base": hf_config.rope_theta(hf, where, default_theta),
            "rope_scaling": False, "rope_scaling_factor": 8.0,
            "yarn_rotary_scaling_factor": float(factor), "yarn_original_max_position_embeddings": original,
            "yarn_beta_fast": float(parameters.get("beta_fast") or 32.0),
            "yarn_beta_slow": float(parameters.get("beta_slow") or 1.0),
            "yarn_mscale": float(mscale), "yarn_mscale_all_dim": float(mscale_all_dim),
            "yarn_correction_range_round_to_int": bool(parameters.get("truncate", True))}


def context_length(hf: Mapping[str, Any], where: Path) -> int:
    """The longest sequence a YaRN model takes: ``factor`` times the length it was trained at (Qwen3's 4 x 32,768),
    which config.json's ``max_position_embeddings`` often leaves at the original."""
    factor, original = _factor_and_original(hf, where)
    return int(factor * original)


def _factor_and_original(hf: Mapping[str, Any], where: Path) -> tuple[float, int]:
    """YaRN's scaling factor and original context length, with transformers' defaults."""
    parameters = hf_config.rope_settings(hf)
    # transformers' default: the context the model was trained at, config.json's own maximum
    original = parameters.get("original_max_position_embeddings", hf.get("original_max_position_embeddings",
                                                                         hf.get("max_position_embeddings")))
    if not isinstance(original, int) or original < 1:
        unsupported(where, f"yarn original_max_position_embeddings {original!r}: a positive integer is needed")
    factor = parameters.get("factor")
    if factor is None:  # transformers' default, the ratio of the context lengths
        factor = hf_config.getter(hf, where)("max_position_embeddings") / original
    if not isinstance(factor, (int, float)) or factor <= 0:
        unsupported(where, f"yarn factor {factor!r}: a positive number is needed")
    return factor, original


def hf_rope_scaling(model: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's ``rope_scaling`` for a model of ``position_embedding_type=yarn`` (its YAML values)."""
    mscale, mscale_all_dim = model["yarn_mscale"], model["yarn_mscale_all_dim"]
    return {"rope_type": "yarn", "factor": model["yarn_rotary_scaling_factor"],
            "original_max_position_embeddings": model["yarn_original_max_position_embeddings"],
            "beta_fast": model["yarn_beta_fast"], "beta_slow": model["yarn_beta_slow"],
            "truncate": model["yarn_correction_range_round_to_int"],
            **({"mscale": mscale, "mscale_all_dim": mscale_all_dim} if mscale_all_dim else {})}


def differences(model: Mapping[str, Any]) -> list[str]:
    """``model.KEY=VALUE`` for YaRN settings a config.json cannot say: transformers reads the two mscales only
    when both are non-zero."""
    mscales = (model.get("yarn_mscale", 1.0), model.get("yarn_mscale_all_dim", 0.0))
    if mscales != (1.0, 0.0) and not all(mscales):
        return [f"model.yarn_mscale={mscales[0]} with model.yarn_mscale_all_dim={mscales[1]}"]
    return []


def attention_factor(factor: float, mscale: float, mscale_all_dim: float) -> float:
    """YaRN's cos/sin scale, as transformers and megatron-core both compute it."""

    def get_mscale(scale: float, weight: float) -> float:
        return 1.0 if scale <= 1 else 0.1 * weight * math.log(scale) + 1.0

    return float(get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim))
