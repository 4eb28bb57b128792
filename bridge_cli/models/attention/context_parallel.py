"""Context parallelism without Transformer Engine: each rank of the CP group holds part of every row.

A row of ``s`` tokens is cut into ``2 * cp`` chunks and rank ``r`` keeps chunks ``r`` and
``2 * cp - 1 - r`` (megatron-core's load balancing: every rank gets an early and a late chunk, so
causal attention costs each the same). The rank's queries attend to the keys and values of the
whole row, all-gathered over the CP group in each layer (their gradients reduce-scattered back);
the mask compares the tokens' places in the row, since the gathered keys are in rank order. RoPE
tables are cut the same way by megatron-core; the loss and gradient reductions already span the
data- and context-parallel ranks in megatron-core.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def rank_positions(seq: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Places in the row of the ``seq / cp_size`` tokens that rank ``cp_rank`` holds, in its order."""
    chunk = seq // (2 * cp_size)
    first, last = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk, device=device), torch.arange(last, last + chunk, device=device)])


def gathered_positions(seq: int, cp_size: int, device=None) -> torch.Tensor:
    """Places in the row of the all-gathered keys: every rank's tokens, rank by rank."""
    return torch.cat([rank_positions(seq, cp_size, r, device) for r in range(cp_size)])


def slice_rows(tensor: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """This rank's part of ``[b, s]`` rows."""
    return tensor.index_select(1, rank_positions(tensor.shape[1], cp_size, cp_rank, tensor.device))


def gather_rows(tensor: torch.Tensor, cp_size: int) -> torch.Tensor:
    """Every rank's part of ``[b, s]`` rows, rank by rank, cut from the whole rows (no communication)."""
    return tensor.index_select(1, gathered_positions(tensor.shape[1], cp_size, tensor.device))


class _GatherSequence(torch.autograd.Function):
    """All-gather along dim 0 over ``group``; the backward reduce-scatters the gradient."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        size = dist.get_world_size(group)
        out = torch.empty((size * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_into_tensor(out, tensor.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        size = dist.get_world_size(ctx.group)
        out = torch.empty((grad.shape[0] // size, *grad.shape[1:]), dtype=grad.dtype, device=grad.device)
        dist.reduce_scatter_tensor(out, grad.contiguous(), group=ctx.group)
        return out, None


def gather_sequence(tensor: torch.Tensor, group) -> torch.Tensor:
    """``[s / cp, ...]`` on each rank to ``[s, ...]`` in rank order, differentiably."""
    return _GatherSequence.apply(tensor, group)
