"""How many rows bridge's token dispatcher permutes into on a rank (:mod:`bridge_cli.models.moe_dispatch`), from the
config's numbers alone: the dispatcher sizes its buffers with it, and the memory estimate counts them
(:mod:`bridge_cli.training.memory_estimate`, which imports no torch)."""

from __future__ import annotations

import math
from typing import Optional


def room(local_tokens: int, group_size: int, local_experts: int, experts: int, topk: int,
         capacity_factor: Optional[float] = None) -> int:
    """Rows of the buffer a rank's dispatcher permutes into: the most (token, local expert) pairs it can receive from
    the ``group_size`` ranks that exchange tokens, each routing ``local_tokens``. Without a capacity each token sends
    min(topk, local experts) pairs; with megatron-core's ``capacity_factor`` (pairs past it dropped, not padded) each
    rank's router sends each expert at most its capacity, ``ceil(local_tokens x topk / experts x factor)`` as
    megatron-core's ``get_capacity`` computes it, and never more than its tokens."""
    most = group_size * local_tokens * min(topk, local_experts)
    if capacity_factor is None:
        return most
    capacity = min(math.ceil(local_tokens * topk / experts * capacity_factor), local_tokens)
    return min(most, group_size * local_experts * capacity)
