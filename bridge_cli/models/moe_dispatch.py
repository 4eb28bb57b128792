"""Token dispatch that never waits on the GPU, for MoE layers whose experts all live on this rank.

megatron-core's ``alltoall`` and ``allgather`` dispatchers copy the tokens-per-expert counts to the
host and permute with ``masked_select``: the host waits on the GPU two or three times per MoE layer
and micro-batch, and the GPU idles while the host catches up (a quarter of the MoE proxy's step on
an H100). The ``alltoall`` one also splits and re-concatenates the permuted tokens by expert when
every expert is local, and both unpermute with an atomic scatter-add in bf16.

With expert parallelism and expert tensor parallelism of 1 there is nothing to communicate, and
without a capacity factor every token goes to exactly ``moe_router_topk`` experts, so the
permutation has a fixed size. :class:`LocalTokenDispatcher` then sorts the (token, expert) pairs
on the GPU into megatron-core's order (by expert, tokens ascending within each), hands the counts
to the experts as a GPU tensor, and sums each token's expert outputs with a gather instead of
atomics (one bf16 rounding instead of one per expert). Fixed shapes also let ``model.compile_layers``
compile the MoE layers whole. Other layouts keep megatron-core's dispatchers.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher


class LocalTokenDispatcher(MoETokenDispatcher):
    """Permutes each token to its ``topk`` local experts and back, on the GPU only (see the module)."""

    def __init__(self, replaced: MoETokenDispatcher):
        groups = SimpleNamespace(ep=replaced.ep_group, expt_tp=replaced.tp_group, tp_ep=replaced.tp_ep_group)
        super().__init__(config=replaced.config, pg_collection=groups)
        self.topk = replaced.config.moe_router_topk

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return hidden_states.view(-1, hidden_states.shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        tokens = hidden_states.shape[0]
        # the selected (expert, token) pairs first, in expert-major order: megatron-core's permutation
        unselected = self.routing_map.t().reshape(-1).logical_not().to(torch.int8)
        pairs = torch.argsort(unselected, stable=True)[: tokens * self.topk]
        self.token_of_row = pairs % tokens
        self.rows_of_token = torch.argsort(self.token_of_row, stable=True)  # token t's rows: t*topk ... t*topk+topk-1
        tokens_per_expert = self.routing_map.sum(dim=0)
        permuted_probs = probs.t().reshape(-1).index_select(0, pairs)
        permuted = _ExpandRows.apply(hidden_states, self.token_of_row, self.rows_of_token, self.topk)
        self.routing_map = None
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return _SumRows.apply(hidden_states, self.rows_of_token, self.token_of_row, self.topk)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self.hidden_shape)


def _sum_per_token(rows: torch.Tensor, rows_of_token: torch.Tensor, topk: int) -> torch.Tensor:
    """Each token's ``topk`` rows summed (accumulated in fp32 by torch's reduction, rounded once)."""
    return rows.index_select(0, rows_of_token).view(-1, topk, rows.shape[-1]).sum(dim=1)


class _ExpandRows(torch.autograd.Function):
    """``x[token_of_row]``; its gradient sums each token's rows with a gather (no atomic adds)."""

    @staticmethod
    def forward(ctx, x, token_of_row, rows_of_token, topk):
        ctx.save_for_backward(rows_of_token)
        ctx.topk = topk
        return x.index_select(0, token_of_row)

    @staticmethod
    def backward(ctx, grad):
        (rows_of_token,) = ctx.saved_tensors
        return _sum_per_token(grad, rows_of_token, ctx.topk), None, None, None


class _SumRows(torch.autograd.Function):
    """Each token's expert rows summed; its gradient is the token's gradient copied to each row."""

    @staticmethod
    def forward(ctx, rows, rows_of_token, token_of_row, topk):
        ctx.save_for_backward(token_of_row)
        return _sum_per_token(rows, rows_of_token, topk)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return grad.index_select(0, token_of_row), None, None, None


def use_local_token_dispatch(model: torch.nn.Module) -> None:
    """Give every eligible MoE layer of ``model`` a :class:`LocalTokenDispatcher`.

    Eligible: grouped-GEMM experts (they take the counts as a GPU tensor), expert parallel and
    expert tensor parallel size 1, megatron-core's ``alltoall`` or ``allgather`` dispatcher without
    shared-expert overlap, and no capacity factor (:func:`~bridge_cli.models.moe_checks.local_dispatch_blocker`).
    Every load-balancing type bridge accepts keeps exactly top-k experts per token.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher,
        MoEAlltoAllTokenDispatcher,
    )

    from bridge_cli.models.moe_checks import local_dispatch_blocker

    for layer in model.modules():
        if (isinstance(layer, MoELayer) and not local_dispatch_blocker(layer.config)
                and type(layer.token_dispatcher) in (MoEAlltoAllTokenDispatcher, MoEAllGatherTokenDispatcher)):
            layer.token_dispatcher = LocalTokenDispatcher(layer.token_dispatcher)
