"""Sliding-window layers, both ways: in every layer where ``sliding_window`` is set (Mistral, Mixtral, Phi-3,
StarCoder2, Qwen3-MoE), where config.json's ``layer_types`` lists them (Gemma 2 and 3, GPT-OSS), or where Qwen's
``use_sliding_window`` and ``max_window_layers`` put them (Qwen2, Qwen3, Qwen2-MoE).

A ``sliding_attention`` layer sees its ``sliding_window`` most recent keys, its own included:
megatron-core's ``window_size = [sliding_window - 1, 0]`` in the layers ``window_attn_skip_freq``
(one 0/1 per layer) marks, which bridge's attention computes at any sequence length. No torch import.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable, Mapping

from bridge_cli.convert.hf_config import unsupported

LAYER_TYPES = ("sliding_attention", "full_attention")
QWEN_WINDOW_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types")
"""The config.json keys that place a Qwen model's sliding-window layers."""


def layer_types(hf: Mapping[str, Any], count: int, where: Path, pattern: int) -> list[str]:
    """Each layer's kind: config.json's ``layer_types``, else all but every ``sliding_window_pattern``-th
    (``pattern`` where that is unset) windowed."""
    layers = hf.get("layer_types")
    if layers is None:
        pattern = hf.get("sliding_window_pattern", pattern)
        layers = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(count)]
    return _checked(layers, count, where)


def every_layer(hf: Mapping[str, Any], count: int) -> list[str]:
    """Each layer's kind where ``sliding_window`` windows every layer, and none where it is null (Mistral's)."""
    return [LAYER_TYPES[0] if hf.get("sliding_window") is not None else LAYER_TYPES[1]] * count


def qwen_layer_types(hf: Mapping[str, Any], count: int, where: Path, windowed: Callable[[int], bool]) -> list[str]:
    """Each layer's kind in a Qwen model: config.json's ``layer_types``, else, with ``use_sliding_window``, windowed
    where ``windowed(i)`` says (the family's reading of ``max_window_layers``). Without ``use_sliding_window``
    transformers drops ``sliding_window``, so no layer may be windowed."""
    use = bool(hf.get("use_sliding_window"))
    layers = hf.get("layer_types")
    if layers is None:
        layers = [LAYER_TYPES[0] if use and windowed(i) else LAYER_TYPES[1] for i in range(count)]
    layers = _checked(layers, count, where)
    if LAYER_TYPES[0] in layers and not use:
        unsupported(where, "sliding_attention in layer_types with use_sliding_window false: transformers then has "
                           "no window for those layers (its model fails to run)")
    return layers


def _checked(layers: Any, count: int, where: Path) -> list[str]:
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


def window_differences(model: Mapping[str, Any], model_type: str, every_layer: bool) -> list[str]:
    """What keeps the model's windows (its YAML values) from a family's: a window that sees keys after the query,
    or, with ``every_layer`` (the family windows every layer or none), some layers without it."""
    window = model.get("window_size")
    if window is not None and window[0] >= 0 and window[1] != 0:
        return [f"model.window_size={list(window)} (a {model_type} model's window sees no key after the query)"]
    windowed = [_windowed(model, n) for n in range(1, model["num_layers"] + 1)]
    if every_layer and any(windowed) and not all(windowed):
        return [f"model.window_attn_skip_freq={model.get('window_attn_skip_freq')} (a {model_type} model has its "
                "sliding window in every layer or in none)"]
    return []


def qwen_window_config(model: Mapping[str, Any], per_layer: bool = True) -> dict[str, Any]:
    """A Qwen model's ``use_sliding_window`` and ``sliding_window`` for the model (its YAML values); ``per_layer``,
    its ``layer_types`` too, which transformers reads before ``max_window_layers``."""
    config = window_config(model)
    windowed = {"use_sliding_window": config["sliding_window"] is not None, "sliding_window": config["sliding_window"]}
    if not per_layer:
        return windowed
    return {**windowed, "layer_types": config["layer_types"], "max_window_layers": model["num_layers"]}


def max_window_layers(hf: Mapping[str, Any], where: Path) -> int:
    """Qwen's ``max_window_layers``, which places its sliding-window layers."""
    value = hf.get("max_window_layers")
    if not isinstance(value, int) or value < 0:
        unsupported(where, f"max_window_layers {value!r} with use_sliding_window: a layer count is needed")
    return value


def _windowed(model: Mapping[str, Any], layer_number: int) -> bool:
    """Whether layer ``layer_number`` (1-based) of the model (its YAML values) has the sliding window."""
    from megatron.core.transformer.utils import is_layer_window_attention

    window = model.get("window_size")
    return window is not None and window[0] >= 0 and is_layer_window_attention(
        window, model.get("window_attn_skip_freq"), layer_number)
