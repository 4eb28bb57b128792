"""megatron-core's optimizer is one optimizer or a ``ChainedOptimizer`` of several (one per parameter group kind:
dense and expert parameters, or the layout's buffers); code that reaches into each one's state walks its members."""

from __future__ import annotations


def members(optimizer) -> list:
    """The megatron-core optimizers inside ``optimizer``: a chain's members, or the optimizer itself."""
    return list(getattr(optimizer, "chained_optimizers", [optimizer]))
