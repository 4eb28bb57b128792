"""The base model inside a LoRA model: its layers run without their adapters for the length of a block.

DPO's reference under ``peft=lora`` is the model it started from, which is the frozen base: running
the same modules with their adapters off gives its log-probabilities without a second copy of the
weights. Each adapted layer's class is swapped back to its base class (the layer keeps its
parameters and names, and the adapter stays attached) and restored afterwards, even on an error.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch


def adapted_layers(model: torch.nn.Module) -> list[tuple[torch.nn.Module, type, type]]:
    """(layer, class with its adapter, base class) for every layer of ``model`` that carries adapters."""
    from bridge_cli.peft.lora import _LoRALayer
    from bridge_cli.peft.lora_experts import GroupedGemmExperts, is_grouped_with_adapters

    found = []
    for module in model.modules():
        if isinstance(module, _LoRALayer):
            found.append((module, type(module), module._base_cls))
        elif is_grouped_with_adapters(module):
            found.append((module, type(module), GroupedGemmExperts))
    return found


@contextlib.contextmanager
def adapters_off(layers: list[tuple[torch.nn.Module, type, type]]) -> Iterator[None]:
    """Inside the block, each of ``layers`` (from :func:`adapted_layers`) computes its base layer alone."""
    for module, _, base in layers:
        module.__class__ = base
    try:
        yield
    finally:
        for module, adapted, _ in layers:
            module.__class__ = adapted
