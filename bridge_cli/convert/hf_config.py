"""Reading a Hugging Face ``config.json``, and the config rules every family shares. No torch import.

The families (``convert/families``) map config.json to the ``model:`` section of a recipe and
back with these helpers. Both directions read and write transformers' classic keys
(``rope_theta``, ``rope_scaling``, ``torch_dtype``), which transformers 4.45+ and 5.x load; on
import, 5.x's ``rope_parameters`` is read too.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping, NoReturn, Optional

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.config.errors import ConfigError

DEFAULT_MAX_SEQ_LENGTH = 4096
"""model.seq_length of an import is max_position_embeddings capped at this (Llama 3.1 says 131072,
more than a training recipe should start from); --seq-length sets it."""

LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
"""megatron-core's Llama 3.1 RoPE scaling hard-codes these; only the factor is a setting."""


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


def getter(hf: Mapping[str, Any], where: Path):
    """``get(key)``: config.json's positive integer ``key``, or a CheckpointError naming it."""

    def get(key: str) -> int:
        value = hf.get(key)
        if not isinstance(value, int) or value < 1:
            raise CheckpointError(f"{where}: {key} is {'missing' if value is None else repr(value)}; "
                                  "a positive integer is needed.")
        return value

    return get


def rope(hf: Mapping[str, Any], where: Path, hint: str = "") -> tuple[int, Optional[float]]:
    """(rotary_base, Llama 3.1 scaling factor or None) from transformers 4.x or 5.x keys.

    ``hint`` adds to the refusal of other scalings (why this family's one cannot be expressed).
    """
    scaling = rope_settings(hf)
    theta = rope_theta(hf, where, 10000.0)
    kind = rope_kind(scaling)
    if kind == "default":
        return theta, None
    if kind != "llama3":
        unsupported(where, f"RoPE scaling {kind!r}",
                    f"{hint}Supported: none (default), llama3 (Llama 3.1/3.2) and yarn, what megatron-core's rotary "
                    "embeddings implement.")
    fixed = {key: scaling.get(key) for key in LLAMA3_ROPE_FIXED}
    if fixed != LLAMA3_ROPE_FIXED or not isinstance(scaling.get("factor"), (int, float)):
        unsupported(where, f"llama3 RoPE scaling with factor {scaling.get('factor')!r} and {fixed}",
                    f"megatron-core implements a numeric factor with {LLAMA3_ROPE_FIXED} only.")
    return theta, float(scaling["factor"])


def rope_settings(hf: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's RoPE scaling settings: transformers 4.x's ``rope_scaling``, else 5.x's ``rope_parameters``
    (``rope_scaling`` where a 5.x folder was edited as a 4.x model card says)."""
    return dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})


def rope_kind(settings: Mapping[str, Any]) -> str:
    """The RoPE scaling that ``settings`` name, in 4.x's key or 5.x's ("default": none)."""
    return settings.get("rope_type", settings.get("type", "default"))


def rope_theta(hf: Mapping[str, Any], where: Path, default: float) -> int:
    """config.json's RoPE base: top-level ``rope_theta`` (4.x) or the one in ``rope_parameters`` (5.x)."""
    return integer_theta(hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", default)),
                         "rope_theta", where)


def integer_theta(theta: Any, key: str, where: Path) -> int:
    """A RoPE base from config.json's ``key``: megatron-core's is an integer."""
    if not isinstance(theta, (int, float)) or theta != int(theta):
        unsupported(where, f"{key} {theta!r}: megatron-core's RoPE base is an integer")
    return int(theta)


def partial_rotary_factor(hf: Mapping[str, Any], where: Path) -> float:
    """config.json's ``partial_rotary_factor`` (transformers 4.x or 5.x keys): megatron-core's ``rotary_percent``,
    both rotating the first part of each head."""
    factor = (hf.get("rope_parameters") or {}).get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        unsupported(where, f"partial_rotary_factor {factor!r}: a fraction in (0, 1] is needed")
    return float(factor)


def seq_length(hf: Mapping[str, Any], where: Path, wanted: Optional[int], longest: Optional[int] = None) -> int:
    """model.seq_length: ``wanted``, or max_position_embeddings capped at DEFAULT_MAX_SEQ_LENGTH.

    ``wanted`` may go up to max_position_embeddings, or to ``longest`` where the RoPE scaling takes the
    model further (YaRN's factor x original length). A sliding window sets no limit: the converted model
    has it (``window_size``) at every length.
    """
    declared = hf.get("max_position_embeddings") or DEFAULT_MAX_SEQ_LENGTH
    limit = max(declared, longest or 0)
    source = "max_position_embeddings" if limit == declared else "YaRN's factor x original_max_position_embeddings"
    if wanted is None:
        return min(declared, DEFAULT_MAX_SEQ_LENGTH)
    if wanted > limit:
        raise ConfigError("--seq-length", f"{wanted} is longer than the model supports ({limit}: {source} in {where}).",
                          f"Use --seq-length {limit} or less.")
    return wanted


def unsupported(where: Path, what: str, hint: str = "") -> NoReturn:
    """Raise the CheckpointError of a model bridge cannot convert, saying what and why."""
    raise CheckpointError(f"{where}: {what}; bridge cannot convert this model." + (f" {hint}" if hint else ""))
