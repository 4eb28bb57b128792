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
The tail costs memory (EP times the expected rows at most) and no time; with a capacity factor the buffers
hold at most that factor times the expected rows (:func:`~bridge_cli.models.dispatch_room.room`). Each token's
outputs are summed with a gather in fp32 (one rounding instead of one per expert). Fixed shapes and no host
reads also let ``model.compile_layers`` compile the MoE layers whole, at any expert-parallel size.

The gather and the reduce-scatter leave the GPU's compute idle. With ``model.moe_exchange_chunks`` above 1
the layer is a :class:`ChunkedExchangeMoELayer`: :meth:`DeviceTokenDispatcher.experts_in_chunks` splits the
tokens into chunks and issues each chunk's gather before the previous chunk's experts run and each
reduce-scatter before the next chunk's, forward and backward (:class:`Exchange`), with the same numbers.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import NamedTuple

import torch
import torch.distributed._functional_collectives as funcol
from megatron.core.transformer.moe.moe_layer import MoELayer
from megatron.core.transformer.moe.token_dispatcher import MoETokenDispatcher

from bridge_cli.models import expert_activation
from bridge_cli.models.dispatch_room import room
from bridge_cli.models.moe_experts import GroupedGemmExperts
from bridge_cli.models.moe_rows import GatherRows, MaskGradient, SumRows


PAIR_SLOTS = 64
"""How many exchanges of a layer :attr:`DeviceTokenDispatcher.pairs` keeps apart between two log lines (micro-batches,
chunks, recomputed forwards); beyond, they add into the first entries again, the same ones on every rank."""


class DeviceTokenDispatcher(MoETokenDispatcher):
    """Gathers the group's tokens, permutes the pairs of this rank's experts and sums them back (see the module)."""

    def __init__(self, replaced: MoETokenDispatcher, chunks: int = 1):
        groups = SimpleNamespace(ep=replaced.ep_group, expt_tp=replaced.tp_group, tp_ep=replaced.tp_ep_group)
        super().__init__(config=replaced.config, pg_collection=groups)
        self.local = slice(replaced.local_expert_indices[0],
                           replaced.local_expert_indices[0] + replaced.num_local_experts)
        self.slots = min(replaced.config.moe_router_topk, replaced.num_local_experts)
        self.room: int | None = None
        """Rows of the permuted buffer (:func:`~bridge_cli.models.dispatch_room.room`), set from each micro-batch's
        token count in :meth:`dispatch_preprocess`: with a capacity factor fewer than every token's ``slots`` pairs."""
        self.group_size = self.tp_size * self.ep_size
        self.all_experts_here = replaced.num_local_experts == replaced.config.num_moe_experts
        # with every expert here and no capacity to drop pairs, each token sends exactly topk pairs: no tail to skip
        self.exactly_topk = self.all_experts_here and replaced.config.moe_expert_capacity_factor is None
        self.chunks = chunks
        """model.moe_exchange_chunks: above 1, the tokens stay on their rank through token_dispatch and token_combine,
        and :meth:`experts_in_chunks` (called by :class:`ChunkedExchangeMoELayer`) exchanges them chunk by chunk."""
        self.pairs: torch.Tensor | None = None
        """The (token, expert) pairs this rank's experts ran in each exchange since the log line last read them
        (experts spread over ranks), one of :data:`PAIR_SLOTS` entries an exchange, :attr:`exchange` the next; the
        log line's ``ep load max/mean`` compares the group's ranks exchange by exchange. Made by
        :func:`expert_pair_counters` once the model sits on its device (with ``model.use_cpu_initialization`` the
        layers are built on the host and moved after this dispatcher is installed)."""
        self.exchange: torch.Tensor | None = None
        """The entry of :attr:`pairs` the next exchange counts into: a one-element tensor, so that counting is a
        graph op of the compiled layer, the same on every rank of the group (they run the same exchanges)."""

    def dispatch_preprocess(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        self.hidden_shape = hidden_states.shape
        self.routing_map = routing_map
        config = self.config
        self.room = room(routing_map.shape[0], self.group_size, self.local.stop - self.local.start,
                         config.num_moe_experts, config.moe_router_topk, config.moe_expert_capacity_factor)
        return hidden_states.view(-1, hidden_states.shape[-1]), probs

    def token_dispatch(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        if self.group_size > 1 and self.chunks == 1:
            self.routing_map, probs = self._gather_routing(self.routing_map, probs)
            hidden_states = _all_gather(hidden_states, self.tp_ep_group)
        return hidden_states, probs

    def _gather_routing(self, routing_map: torch.Tensor, probs: torch.Tensor):
        group = self.tp_ep_group
        routing_map = funcol.wait_tensor(funcol.all_gather_tensor(routing_map.to(torch.uint8), 0, group)).bool()
        return routing_map, _all_gather(probs, group)

    def dispatch_postprocess(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        permuted, tokens_per_expert, permuted_probs, self.layout = self._permute(hidden_states, self.routing_map, probs)
        self.routing_map = None
        return permuted, tokens_per_expert, permuted_probs

    def _permute(self, hidden_states: torch.Tensor, routing_map: torch.Tensor, probs: torch.Tensor):
        """The rows of this rank's (token, expert) pairs, their counts per expert and probabilities, and the
        layout that sums them back (:meth:`_sum`)."""
        tokens = hidden_states.shape[0]
        local_map = routing_map[:, self.local]
        experts = local_map.shape[1]
        # (expert, token) pairs flattened expert-major; the selected ones first, in that order
        order = torch.argsort(local_map.t().reshape(-1).logical_not().to(torch.int8), stable=True)
        pairs = order[: min(tokens * self.slots, self.room)]  # a chunk's tokens, or room for the whole micro-batch
        tokens_per_expert = local_map.sum(dim=0)
        count = None if self.exactly_topk else tokens_per_expert.sum()
        row_of_pair = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=order.device))
        # each token's rows, its experts ascending; -1 for a slot no expert of this rank fills
        slot_experts = torch.argsort(local_map.logical_not().to(torch.int8), dim=1, stable=True)[:, : self.slots]
        token_index = torch.arange(tokens, device=order.device).unsqueeze(1)
        rows_of_token = row_of_pair.index_select(0, (slot_experts * tokens + token_index).reshape(-1)).view(tokens, -1)
        if count is not None:
            rows_of_token = torch.where(local_map.gather(1, slot_experts), rows_of_token, -1)
        token_of_row = pairs % tokens
        permuted_probs = probs[:, self.local].t().reshape(-1).index_select(0, pairs)
        if count is not None:  # the tail's probabilities get no gradient from the rows nobody reads
            permuted_probs = MaskGradient.apply(permuted_probs, count)
            if self.pairs is not None:
                self.pairs.index_add_(0, self.exchange, count.view(1))
                self.exchange.add_(1).remainder_(PAIR_SLOTS)
        permuted = GatherRows.apply(hidden_states, token_of_row, count, rows_of_token)
        return permuted, tokens_per_expert, permuted_probs, (rows_of_token, token_of_row, count)

    def combine_preprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return self._sum(hidden_states, self.layout)

    @staticmethod
    def _sum(expert_output: torch.Tensor, layout: tuple) -> torch.Tensor:
        """Each token's rows of ``expert_output`` summed (``layout`` from :meth:`_permute`)."""
        return SumRows.apply(expert_output, *layout)

    def token_combine(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if self.group_size > 1 and self.chunks == 1:
            hidden_states = _reduce_scatter(hidden_states, self.tp_ep_group)
        return hidden_states

    def combine_postprocess(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return hidden_states.view(self.hidden_shape)

    def experts_in_chunks(self, hidden_states: torch.Tensor, probs: torch.Tensor, experts) -> torch.Tensor:
        """This rank's tokens through the group's ``experts`` (what token_dispatch, dispatch_postprocess, the experts,
        combine_preprocess and token_combine do), the tokens split into ``chunks`` along the token axis and pipelined:
        the gather of chunk i + 1 is issued before chunk i's experts run, and the reduce-scatter of chunk i before
        chunk i + 1's, so the exchange runs while the experts compute. Routing is per token and each token's rows
        are summed in the same order as unchunked, so a token's output is the same; the gathers of the routing map
        and the probabilities are small and done first, whole."""
        tokens = hidden_states.shape[0]
        # a token count that does not split (sequences of another length than validated) runs as one chunk
        chunks = self.chunks if tokens % self.chunks == 0 else 1
        size = tokens // chunks
        routing_map, probs = self._gather_routing(self.routing_map, probs)
        self.routing_map = None
        # the gathered rows are (rank, chunk, token of the chunk); chunk c's are those of every rank
        routing_map = routing_map.view(self.group_size, chunks, size, -1)
        probs = probs.view(self.group_size, chunks, size, -1)
        pieces = hidden_states.split(size)
        exchange = Exchange(self.tp_ep_group)
        next_chunk = exchange.start_gather(pieces[0])
        outputs = []
        for chunk in range(chunks):
            this_chunk = next_chunk
            if chunk + 1 < chunks:
                next_chunk = exchange.start_gather(pieces[chunk + 1])
            gathered = exchange.finish(this_chunk)
            permuted, tokens_per_expert, permuted_probs, layout = self._permute(
                gathered, routing_map[:, chunk].reshape(gathered.shape[0], -1),
                probs[:, chunk].reshape(gathered.shape[0], -1))
            expert_output, _ = experts(permuted, tokens_per_expert, permuted_probs)
            outputs.append(exchange.start_reduce_scatter(self._sum(expert_output, layout)))
        return torch.cat([exchange.finish(output) for output in outputs])


class ChunkedExchangeMoELayer(MoELayer):
    """megatron-core's MoE layer whose routed experts run between the chunks of their token exchange
    (``model.moe_exchange_chunks``, :meth:`DeviceTokenDispatcher.experts_in_chunks`); its dispatcher's
    token_dispatch and token_combine then leave the tokens where they are. Router, auxiliary losses, shared
    experts, parameters and checkpoint keys are the MoE layer's own."""

    def routed_experts_compute(self, hidden_states: torch.Tensor, probs: torch.Tensor):
        return self.token_dispatcher.experts_in_chunks(hidden_states, probs, self.experts), None


class Exchange:
    """Collectives over one process group issued now and waited on where their result is used, forward and
    backward. torch's native functional collectives (``torch.ops._c10d_functional``) return at once, and their
    ``wait_tensor`` makes the compute stream wait for the communication (``funcol``'s Python functions wait at
    once inside ``torch.compile``). The gradient of a gather is a reduce-scatter, issued where the backward reaches
    :meth:`finish` and waited on where it reaches the start; a reduce-scatter's is a gather, likewise. The start's
    ``receipt`` (the input's shape, one element of memory) is the path that reverse collective takes back."""

    def __init__(self, group):
        self.size, self.name = group.size(), group.group_name

    def start_gather(self, x: torch.Tensor) -> "Started":
        """The group's ``x`` stacked along the first axis, once :meth:`finish` has waited on it."""
        return Started(*_Start.apply(x, _GATHER, self.size, self.name), _GATHER, self.size, self.name)

    def start_reduce_scatter(self, x: torch.Tensor) -> "Started":
        """The group's ``x`` summed, this rank's slice of the first axis, once :meth:`finish` has waited on it."""
        return Started(*_Start.apply(x, _REDUCE_SCATTER, self.size, self.name), _REDUCE_SCATTER, self.size, self.name)

    @staticmethod
    def finish(started: "Started") -> torch.Tensor:
        """The result of a started collective, usable from here on."""
        return _Finish.apply(*started)


class Started(NamedTuple):
    """A collective issued and not yet waited on."""

    output: torch.Tensor
    """Not to be read before :meth:`Exchange.finish`."""
    receipt: torch.Tensor
    """Of the input's shape, one element expanded and never read: its gradient is the reverse collective, issued in
    :class:`_Finish`'s backward."""
    kind: str
    group_size: int
    group_name: str


_GATHER, _REDUCE_SCATTER = "gather", "reduce_scatter"


def _issue(kind: str, x: torch.Tensor, group_size: int, group_name: str) -> torch.Tensor:
    if kind == _GATHER:
        return torch.ops._c10d_functional.all_gather_into_tensor(x.contiguous(), group_size, group_name)
    return torch.ops._c10d_functional.reduce_scatter_tensor(x.contiguous(), "sum", group_size, group_name)


class _Start(torch.autograd.Function):
    """Issues the collective. Backward: waits on the reverse collective that :class:`_Finish`'s backward issued
    (the receipt's gradient) and returns it as the input's gradient."""

    @staticmethod
    def forward(ctx, x, kind, group_size, group_name):
        return _issue(kind, x, group_size, group_name), x.new_empty(()).expand(x.shape)

    @staticmethod
    def backward(ctx, _unused, receipt_grad):
        return torch.ops._c10d_functional.wait_tensor(receipt_grad), None, None, None


class _Finish(torch.autograd.Function):
    """Waits on the collective. Backward: issues the reverse collective (a gather's is a reduce-scatter, and back)
    as the receipt's gradient; the output's own gradient passes to :class:`_Start` unread."""

    @staticmethod
    def forward(ctx, output, receipt, kind, group_size, group_name):
        ctx.reverse = _REDUCE_SCATTER if kind == _GATHER else _GATHER
        ctx.group = (group_size, group_name)
        return torch.ops._c10d_functional.wait_tensor(output)

    @staticmethod
    def backward(ctx, grad):
        return grad, _issue(ctx.reverse, grad, *ctx.group), None, None, None


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
    shared-expert overlap and no padding to capacity. Every load-balancing type bridge accepts routes a token to
    top-k experts; ``model.moe_expert_capacity_factor`` has megatron-core's router drop the pairs past an expert's
    capacity before the exchange, and the count on the GPU covers the pairs left. Where rows can go past that count
    (experts spread over ranks, or pairs dropped), grouped experts compute their activation up to it
    (:mod:`bridge_cli.models.expert_activation`). With ``model.moe_exchange_chunks`` above 1 (validated by
    :func:`~bridge_cli.models.moe_checks.check_moe`), the layer becomes a :class:`ChunkedExchangeMoELayer`.
    """
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
            chunks = layer.config.moe_exchange_chunks
            layer.token_dispatcher = DeviceTokenDispatcher(layer.token_dispatcher, chunks)
            if isinstance(layer.experts, GroupedGemmExperts):  # rows past the count (experts spread, or dropped)
                layer.experts.counted_activation = (not layer.token_dispatcher.exactly_topk
                                                    and expert_activation.applies(layer.config))
            if chunks > 1:
                if type(layer) is not MoELayer:
                    raise ValueError(f"model.moe_exchange_chunks chunks megatron-core's MoELayer, and this layer is a "
                                     f"{type(layer).__name__}; set model.moe_exchange_chunks=1.")
                layer.__class__ = ChunkedExchangeMoELayer  # one method differs; modules, parameters and state stay
        elif type(layer.token_dispatcher) is MoEAlltoAllTokenDispatcher and layer.token_dispatcher.tp_size > 1 \
                and not torch.cuda.is_available():
            from bridge_cli.runtime.errors import RuntimeUnavailable

            raise RuntimeUnavailable(
                f"model.moe_token_dispatcher_type=alltoall with expert tensor parallelism "
                f"({layer.token_dispatcher.tp_size}) and megatron-core's dispatcher (here "
                f"{device_dispatch_blocker(layer.config)}) gathers uneven token counts, which gloo cannot; on the CPU "
                "set model.moe_token_dispatcher_type=allgather.")


def expert_pair_counters(chunks: list) -> tuple[list[torch.Tensor], object]:
    """Each :class:`DeviceTokenDispatcher`'s :attr:`~DeviceTokenDispatcher.pairs` counters in ``chunks`` (one entry an
    exchange), made zero on the device its layer's parameters are on now, and the group they are compared over
    (expert TP x EP, the group that gathers the tokens); ``([], None)`` where no rank's experts are spread."""
    layers = [m for chunk in chunks for m in chunk.modules()
              if isinstance(m, MoELayer) and isinstance(m.token_dispatcher, DeviceTokenDispatcher)
              and not m.token_dispatcher.all_experts_here]
    for layer in layers:
        device = next(layer.parameters()).device
        layer.token_dispatcher.pairs = torch.zeros(PAIR_SLOTS, dtype=torch.int64, device=device)
        layer.token_dispatcher.exchange = torch.zeros(1, dtype=torch.int64, device=device)
    dispatchers = [layer.token_dispatcher for layer in layers]
    return [d.pairs for d in dispatchers], (dispatchers[0].tp_ep_group if dispatchers else None)
