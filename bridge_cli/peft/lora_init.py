"""How a LoRA adapter's A starts: drawn from a generator of its own, seeded by the run's seed, the layer and
the module's name, so the same adapter starts alike under any tensor, pipeline or expert layout.

Both the per-layer adapters (:mod:`.lora`) and the grouped-GEMM experts' (:mod:`.lora_experts`) draw from here.
"""

from __future__ import annotations

import math
import zlib

import torch


def adapter_seed(seed: int, layer_number: int, name: str) -> int:
    """The seed the A of layer ``layer_number``'s module ``name`` is drawn from: the same under any layout."""
    return zlib.crc32(f"{seed}:{layer_number}:{name}".encode())


def draw_a(dim: int, in_features: int, method: str, seed: int) -> torch.Tensor:
    """A LoRA A matrix (``dim x in_features``), drawn from its own generator seeded with ``seed``."""
    weight = torch.empty(dim, in_features)
    generator = torch.Generator().manual_seed(seed)
    if method == "xavier":
        return torch.nn.init.xavier_normal_(weight, generator=generator)
    return torch.nn.init.kaiming_uniform_(weight, a=math.sqrt(5), generator=generator)
