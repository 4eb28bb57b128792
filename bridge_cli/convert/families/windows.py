"""Sliding-window layers as config.json's ``layer_types`` lists them (Gemma 2 and 3, GPT-OSS), both ways.

A ``sliding_attention`` layer sees its ``sliding_window`` most recent keys, its own included:
megatron-core's ``window_size = [sliding_window - 1, 0]`` in the layers ``window_attn_skip_freq``
(one 0/1 per layer) marks. No torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping

from bridge_cli.convert.hf_config import unsupported

LAYER_TYPES = ("sliding_attention", "full_attention")


def layer_types(hf: Mapping[str, Any], count: int, where: Path, pattern: int) -> list[str]:
    """Each layer's kind: config.json's ``layer_types``, else all but every ``sliding_window_pattern``-th
    (``pattern`` where that is unset) windowed."""
    layers = hf.get("layer_types")
    if layers is None:
        pattern = hf.get("sliding_window_pattern", pattern)
        layers = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(count)]
    if not isinstance(layers, list) or len(layers) != count or any(kind not in LAYER_TYPES for kind in layers):
        unsupported(where, f"layer_types {layers!r}: one of {', '.join(LAYER_TYPES)} per layer "
                           f"(num_hidden_layers {count}) is needed")
    return layers


def window_fields(hf: Mapping[str, Any], layers: list[str], where: Path) -> dict[str, Any]:
    """``window_size`` and ``window_attn_skip_freq`` for the layer kinds ``layers`` (none without a windowed one)."""
    if "sliding_attention" not in layers:
        return {}
    window = hf.get("sliding_window")
    if not isinstance(window, int) or window < 1:
        unsupported(where, f"sliding_window {window!r} with sliding-window layers: a positive integer is needed")
    return {"window_size": [window - 1, 0],
            "window_attn_skip_freq": [int(kind == "sliding_attention") for kind in layers]}


def window_config(model: Mapping[str, Any]) -> dict[str, Any]:
    """config.json's ``sliding_window`` and ``layer_types`` for the model (its ``model:`` YAML values)."""
    windowed = [_windowed(model, n) for n in range(1, model["num_layers"] + 1)]
    return {"sliding_window": model["window_size"][0] + 1 if any(windowed) else None,
            "layer_types": [LAYER_TYPES[0] if w else LAYER_TYPES[1] for w in windowed]}


def _windowed(model: Mapping[str, Any], layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based) of the model (its YAML values) has the sliding window."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window = model["window_size"]
    return window is not None and window[0] >= 0 and is_layer_window_attention(
        window, model["window_attn_skip_freq"], layer_number)
