"""Token dispatch that never waits on the GPU, for one rank's experts or experts spread over ranks.

megatron-core's ``alltoall`` and ``allgather`` dispatchers copy the tokens-per-expert counts to the
host and permute with ``masked_select``: the host waits on the GPU two or three times per MoE layer
and micro-batch, and the GPU idles while the host catches up (a quarter of the MoE proxy's step on
one H100, most of the loss under expert parallelism). Both unpermute with an atomic scatter-add in bf16.

:class:`DeviceTokenDispatcher` keeps every count on the GPU. Tokens cross ranks as in megatron-core's
``allgather`` dispatcher: each rank of the expert-tensor x expert-parallel group gathers the group's
tokens and routing, runs its own experts on the pairs routed to them, and a reduce-scatter sums each
token's outputs back to the rank that holds it (every shape fixed; equal sizes on every rank). For
top-k routing over EP ranks that moves (EP - 1) tokens a token where an all-to-all of the
(token, expert) pairs moves topk x (EP - 1) / EP: less whenever EP <= topk.

On a rank, the (token, local expert) pairs are sorted on the GPU into megatron-core's order (by
expert, tokens ascending within each). Their number changes from step to step when the rank holds
only some experts, so the buffers have room for the most there can be (every gathered token sending
min(topk, local experts) pairs here) and the real count stays on the GPU: grouped GEMMs stop at
their last offset and the row gathers and sums skip the tail (:mod:`bridge_cli.models.moe_rows`).
The tail costs memory (EP times the expected rows at most) and no time. Each token's outputs are
summed with a gather in fp32 (one rounding instead of one per expert). Fixed shapes and no host
reads also let ``model.compile_layers`` compile the MoE layers whole, at any expert-parallel size.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
import torch.distributed._functional_collectives as funcol
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from bridge_cli.models.moe_rows import GatherRows, MaskGradient, SumRows


class DeviceTokenDispatcher(MoETokenDispatcher):
    """Gathers the group's tokens, permutes the pairs of this rank's experts and sums them back (see the module)."""

    def __init__(self, replaced: MoETokenDispatcher):
        groups = SimpleNamespace(ep=replaced.ep_group, expt_tp=replaced.tp_group, tp_ep=replaced.tp_ep_group)
        super().__init__(config=replaced.config, pg_collection=groups)
        self.local = slice(replaced.local_expert_indices[0],
                           replaced.local_expert_indices[0] + replaced.num_local_experts)
        self.slots = min(replaced.config.moe_router_topk, replaced.num_local_experts)
        self.group_size = self.tp_size * self.ep_size
        # with every expert here, each token sends exactly topk pairs: no tail to skip
        self.all_experts_here = replaced.num_local_experts == replaced.config.num_moe_experts

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        return hidden_states.view(-1, hidden_states.shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.group_size > 1:
            group = self.tp_ep_group
            self.routing_map = funcol.wait_tensor(
                funcol.all_gather_tensor(self.routing_map.to(torch.uint8), 0, group)).bool()
            probs, hidden_states = _all_gather(probs, group), _all_gather(hidden_states, group)
        return hidden_states, probs

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        tokens = hidden_states.shape[0]
        local_map = self.routing_map[:, self.local]
        experts = local_map.shape[1]
        # (expert, token) pairs flattened expert-major; the selected ones first, in that order
        order = torch.argsort(local_map.t().reshape(-1).logical_not().to(torch.int8), stable=True)
        pairs = order[: tokens * self.slots]
        tokens_per_expert = local_map.sum(dim=0)
        count = None if self.all_experts_here else tokens_per_expert.sum()
        row_of_pair = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        # each token's rows, its experts ascending; -1 for a slot no expert of this rank fills
        slot_experts = torch.argsort(local_map.logical_not().to(torch.int8), dim=1, stable=True)[:, : self.slots]
        token_index = torch.arange(tokens, device=order.device).unsqueeze(1)
        rows_of_token = row_of_pair.index_select(0, (slot_experts * tokens + token_index).reshape(-1)).view(tokens, -1)
        if count is not None:
            rows_of_token = torch.where(local_map.gather(1, slot_experts), rows_of_token, -1)
        self.token_of_row, self.rows_of_token, self.count = pairs % tokens, rows_of_token, count
        permuted_probs = probs[:, self.local].t().reshape(-1).index_select(0, pairs)
        if count is not None:  # the tail's probabilities get no gradient from the rows nobody reads
            permuted_probs = MaskGradient.apply(permuted_probs, count)
        permuted = GatherRows.apply(hidden_states, self.token_of_row, count, rows_of_token)
        self.routing_map = None
        return permuted, tokens_per_expert, permuted_probs

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return SumRows.apply(hidden_states, self.rows_of_token, self.token_of_row, self.count)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.group_size > 1:
            hidden_states = _reduce_scatter(hidden_states, self.tp_ep_group)
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self.hidden_shape)


def _all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """The group's ``x`` stacked along the first axis; the gradient is reduce-scattered back."""
    gather = getattr(funcol, "all_gather_single_autograd", None) or funcol.all_gather_tensor_autograd
    return funcol.wait_tensor(gather(x.contiguous(), 0, group))


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """The group's ``x`` summed, each rank keeping its slice of the first axis; the gradient is all-gathered."""
    scatter = getattr(funcol, "reduce_scatter_single_autograd", None) or funcol.reduce_scatter_tensor_autograd
    return funcol.wait_tensor(scatter(x.contiguous(), "sum", 0, group))


def use_device_token_dispatch(model: torch.nn.Module) -> None:
    """Give every eligible MoE layer of ``model`` a :class:`DeviceTokenDispatcher`.

    Eligible (:func:`~bridge_cli.models.moe_checks.device_dispatch_blocker`): grouped-GEMM experts (they
    take the counts as a GPU tensor), megatron-core's ``allgather`` dispatcher, or its ``alltoall`` one
    where expert parallelism is at most ``moe_router_topk`` (beyond, the all-to-all moves less data), no
    shared-expert overlap and no capacity factor. Every load-balancing type bridge accepts keeps exactly
    top-k experts per token.
    """
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher,
        MoEAlltoAllTokenDispatcher,
    )

    from bridge_cli.models.moe_checks import device_dispatch_blocker

    for layer in model.modules():
        if not isinstance(layer, MoELayer):
            continue
        if (not device_dispatch_blocker(layer.config)
                and type(layer.token_dispatcher) in (MoEAlltoAllTokenDispatcher, MoEAllGatherTokenDispatcher)):
            layer.token_dispatcher = DeviceTokenDispatcher(layer.token_dispatcher)
        elif type(layer.token_dispatcher) is MoEAlltoAllTokenDispatcher and layer.token_dispatcher.tp_size > 1 \
                and not torch.cuda.is_available():
            from bridge_cli.runtime.errors import RuntimeUnavailable

            raise RuntimeUnavailable(
                f"model.moe_token_dispatcher_type=alltoall with expert tensor parallelism "
                f"({layer.token_dispatcher.tp_size}) and megatron-core's dispatcher (here "
                f"{device_dispatch_blocker(layer.config)}) gathers uneven token counts, which gloo cannot; on the CPU "
                "set model.moe_token_dispatcher_type=allgather.")
