"""The host-sync-free token dispatcher for local experts against megatron-core's own dispatchers:
the same forward and gradients in fp32 on the CPU, with and without a capacity that drops pairs, and
megatron-core's dispatchers kept where its experts pad their input to capacity or are not grouped. The chunked exchange
(model.moe_exchange_chunks) in one process, and the settings it refuses; across ranks it is tested in
tests/integration/test_moe_exchange_chunks.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bridge_cli.models.moe_dispatch import DeviceTokenDispatcher
from bridge_cli.models.provider import GPTModelProvider
from tests.unit.test_cli_errors import assert_user_error
from tests.unit.test_moe_grouped_experts import SEQ, VOCAB
from tests.unit.test_moe_grouped_experts import forward_backward as logits_after_backward


def build(dispatcher: str = "alltoall", **overrides):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    options = dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
        seq_length=SEQ, make_vocab_size_divisible_by=128, position_embedding_type="rope", normalization="RMSNorm",
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0,
        attention_dropout=0.0, spec="torch", num_moe_experts=8, moe_router_topk=3, moe_ffn_hidden_size=32,
        moe_token_dispatcher_type=dispatcher, moe_aux_loss_coeff=1e-2, moe_grouped_gemm=True)
    return GPTModelProvider(**{**options, **overrides}).provide()


def moe_layers(model):
    return [layer.mlp for layer in model.decoder.layers]


def with_megatron_dispatchers(model, dispatcher: str):
    """The same model with megatron-core's dispatcher of that name put back in every MoE layer."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import token_dispatcher

    cls = {"alltoall": token_dispatcher.MoEAlltoAllTokenDispatcher,
           "allgather": token_dispatcher.MoEAllGatherTokenDispatcher}[dispatcher]
    pgs = ProcessGroupCollection.use_mpu_process_groups()
    for mlp in moe_layers(model):
        mlp.token_dispatcher = cls(mlp.num_local_experts, mlp.local_expert_indices, config=mlp.config,
                                   pg_collection=pgs)
    return model


def forward_backward(model):
    logits = logits_after_backward(model)
    return logits, {name: p.grad.clone() for name, p in model.named_parameters()}


DROPPING = {"no_capacity": {}, "capacity_by_probs": dict(moe_expert_capacity_factor=0.5),
            "capacity_by_position": dict(moe_expert_capacity_factor=0.5, moe_token_drop_policy="position")}
"""Capacity 0.5: every expert takes half the pairs it would get on average, so megatron-core's router drops pairs
(the highest-probability ones kept, or the earliest tokens) before the dispatcher sees the routing."""


@pytest.mark.parametrize("dropping", DROPPING)
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_local_dispatch_equals_megatron_cores_dispatcher(one_process, dispatcher, dropping):
    ours = build(dispatcher, **DROPPING[dropping])
    assert all(isinstance(mlp.token_dispatcher, DeviceTokenDispatcher) for mlp in moe_layers(ours))
    theirs = with_megatron_dispatchers(build(dispatcher, **DROPPING[dropping]), dispatcher)
    logits, grads = forward_backward(ours)
    their_logits, their_grads = forward_backward(theirs)
    torch.testing.assert_close(logits, their_logits, rtol=1e-6, atol=1e-6)
    assert grads.keys() == their_grads.keys()
    for name in grads:  # experts, routers (through the probabilities and the aux loss), attention, embedding
        torch.testing.assert_close(grads[name], their_grads[name], rtol=1e-5, atol=1e-7, msg=name)


def test_a_token_gets_each_of_its_experts_output_once(one_process):
    """Hand-made routing: the combined output is sum over a token's experts of prob * expert(token)."""
    mlp = moe_layers(build(moe_router_topk=2))[0]
    dispatcher, experts = mlp.token_dispatcher, mlp.experts
    hidden = torch.randn(5, 1, 64)
    routing_map = torch.zeros(5, 8, dtype=torch.bool)
    chosen = [(0, 7), (3, 1), (2, 5), (7, 0), (4, 6)]
    for token, pair in enumerate(chosen):
        routing_map[token, list(pair)] = True
    probs = torch.rand(5, 8) * routing_map
    tokens, probs_in = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    permuted, counts, permuted_probs = dispatcher.dispatch_postprocess(*dispatcher.token_dispatch(tokens, probs_in))
    assert counts.tolist() == routing_map.sum(0).tolist()
    out, _ = experts(permuted, counts, permuted_probs)
    combined = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(out)))
    with torch.no_grad():
        for token, pair in enumerate(chosen):
            expected = sum(probs[token, e] * experts(hidden[token], torch.tensor([0] * e + [1] + [0] * (7 - e)),
                                                     torch.ones(1))[0][0] for e in pair)
            torch.testing.assert_close(combined[token, 0], expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides", [dict(moe_expert_capacity_factor=1.0, moe_pad_expert_input_to_capacity=True),
                                       dict(moe_grouped_gemm=False)], ids=["padded_to_capacity", "sequential_mlp"])
def test_megatron_cores_dispatcher_stays_where_the_permutation_is_not_fixed(one_process, overrides):
    assert not any(isinstance(mlp.token_dispatcher, DeviceTokenDispatcher) for mlp in moe_layers(build(**overrides)))


def holding_experts_0_to_3(mlp) -> DeviceTokenDispatcher:
    """A dispatcher for ``mlp`` (all 8 experts on this one process) as on a rank that holds experts 0-3 only."""
    from types import SimpleNamespace

    real = mlp.token_dispatcher
    half = SimpleNamespace(config=real.config, ep_group=real.ep_group, tp_group=real.tp_group,
                           tp_ep_group=real.tp_ep_group, local_expert_indices=[0, 1, 2, 3], num_local_experts=4)
    return DeviceTokenDispatcher(half)


def test_the_unused_tail_reaches_no_output_and_no_gradient(one_process):
    """A rank holding some experts gets buffers sized for the most pairs it can receive; on the GPU the rows past
    the count are left unwritten (any values, NaN included). Whatever they hold, the combined output and the
    gradients of the tokens and of the routing probabilities stay those of the real rows."""
    dispatcher = holding_experts_0_to_3(moe_layers(build(moe_router_topk=2))[0])
    hidden = torch.randn(6, 1, 64, requires_grad=True)
    routing_map = torch.zeros(6, 8, dtype=torch.bool)
    for token, pair in enumerate([(0, 7), (3, 1), (5, 6), (2, 0), (4, 1), (6, 7)]):
        routing_map[token, list(pair)] = True
    probs = (torch.rand(6, 8) * routing_map).requires_grad_()
    tokens, probs_in = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    permuted, counts, permuted_probs = dispatcher.dispatch_postprocess(*dispatcher.token_dispatch(tokens, probs_in))
    count = int(counts.sum())
    assert count == 6 and permuted.shape[0] == 12  # 6 tokens x min(topk, 4 local experts) rows of room
    valid = (torch.arange(12) < count).unsqueeze(-1)
    rows = torch.where(valid, permuted, float("nan"))  # what the GPU's unwritten tail may hold
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(
        rows * permuted_probs.unsqueeze(-1))))
    out.square().sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(hidden.grad).all() and torch.isfinite(probs.grad).all()
    local = routing_map[:, :4]
    expected = (hidden.detach()[:, 0].unsqueeze(1) * (probs.detach()[:, :4] * local).unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out[:, 0].detach(), expected)
    assert (probs.grad[:, 4:] == 0).all()  # experts of other ranks get their gradient there


def test_a_capacity_factor_shrinks_the_buffers_to_the_pairs_the_router_lets_through(one_process):
    """Capacity 0.5 over 8 experts and top-2: each expert takes at most ceil(6 x 2 / 8 x 0.5) = 1 pair of the 6 tokens,
    so a rank holding experts 0-3 needs room for 4 rows, not the 12 of every token's two pairs; routing that keeps to
    the capacity (as megatron-core's router leaves it) runs through the smaller buffers to the same sums."""
    dispatcher = holding_experts_0_to_3(moe_layers(build(moe_router_topk=2, moe_expert_capacity_factor=0.5))[0])
    hidden = torch.randn(6, 1, 64)
    routing_map = torch.zeros(6, 8, dtype=torch.bool)
    for token, pair in enumerate([(0, 7), (3, 5), (6, 7), (1, 4), (2, 5), (4, 6)]):
        routing_map[token, list(pair)] = True
    probs = torch.rand(6, 8) * routing_map
    tokens, probs_in = dispatcher.dispatch_preprocess(hidden, routing_map, probs)
    permuted, counts, permuted_probs = dispatcher.dispatch_postprocess(*dispatcher.token_dispatch(tokens, probs_in))
    assert dispatcher.room == 4 and permuted.shape[0] == 4 and int(counts.sum()) == 4
    out = dispatcher.combine_postprocess(dispatcher.token_combine(dispatcher.combine_preprocess(
        permuted * permuted_probs.unsqueeze(-1))))
    expected = (hidden[:, 0].unsqueeze(1) * (probs[:, :4] * routing_map[:, :4]).unsqueeze(-1)).sum(1)
    torch.testing.assert_close(out[:, 0], expected)


def test_the_pair_counter_lives_where_the_layer_is_when_the_log_reads_it(one_process):
    """``ep load max/mean`` counts each rank's (token, expert) pairs on its device. With
    ``model.use_cpu_initialization`` the layers are built on the host and moved after the dispatcher is installed, so
    the counter is made when the logger asks for it, beside the layer's parameters then (the first EP run on GPUs
    built it on the host and failed in the compiled layer adding a device count to it)."""
    from bridge_cli.models.moe_dispatch import PAIR_SLOTS, expert_pair_counters

    model = build(moe_router_topk=2)
    mlp = moe_layers(model)[0]
    mlp.token_dispatcher = holding_experts_0_to_3(mlp)
    assert mlp.token_dispatcher.pairs is None  # nothing counted before anyone reads
    counters, group = expert_pair_counters([model])
    assert len(counters) == 1 and group is mlp.token_dispatcher.tp_ep_group and not counters[0].any()
    routing_map = torch.zeros(6, 8, dtype=torch.bool)
    routing_map[:, 0] = routing_map[:3, 5] = routing_map[3:, 2] = True  # pairs on experts 0-3: 6 + 3
    hidden, probs = torch.randn(6, 1, 64), torch.rand(6, 8) * routing_map
    dispatcher = mlp.token_dispatcher
    for _ in range(2):  # two micro-batches: an entry each, so ranks are compared exchange by exchange
        dispatcher.dispatch_postprocess(*dispatcher.dispatch_preprocess(hidden, routing_map, probs))
    assert counters[0][:3].tolist() == [9, 9, 0] and int(counters[0].sum()) == 18
    for _ in range(PAIR_SLOTS - 1):  # past the last entry the exchanges add into the first ones again
        dispatcher.dispatch_postprocess(*dispatcher.dispatch_preprocess(hidden, routing_map, probs))
    assert counters[0][:3].tolist() == [18, 9, 9] and int(dispatcher.exchange) == 1
    model.to("meta")  # where the model goes after the dispatcher was installed
    (counter,), _ = expert_pair_counters([model])
    assert counter.device.type == "meta" and mlp.token_dispatcher.pairs is counter


def test_chunks_give_the_numbers_of_one_pass(one_process):
    """Chunks through a group of one rank: the same logits and gradients (routing and each token's sum are per token;
    experts left 1-3 rows of a chunk run the CPU's small-GEMM kernel, which sums in another order: 1.2e-7 here)."""
    from bridge_cli.models.moe_dispatch import ChunkedExchangeMoELayer

    chunked = build(moe_exchange_chunks=2)
    assert all(type(mlp) is ChunkedExchangeMoELayer for mlp in moe_layers(chunked))
    logits, grads = forward_backward(chunked)
    their_logits, their_grads = forward_backward(build())
    torch.testing.assert_close(logits, their_logits, rtol=1e-6, atol=1e-6)
    assert grads.keys() == their_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], their_grads[name], rtol=1e-6, atol=1e-8, msg=name)


MOE = ["recipe=tiny_moe", "--dry-run"]


@pytest.mark.parametrize("args, fragments", [
    (["model.moe_exchange_chunks=0", "model.expert_model_parallel_size=2", "--world-size", "2"],
     ["model.moe_exchange_chunks: 0 must be 1"]),
    (["recipe=tiny", "model.moe_exchange_chunks=2"], ["model.moe_exchange_chunks", "model.num_moe_experts is unset"]),
    (["model.moe_exchange_chunks=2"],
     ["model.moe_exchange_chunks", "model.expert_model_parallel_size=1 and expert TP 1"]),
    (["model.moe_exchange_chunks=2", "model.moe_grouped_gemm=false", "model.expert_model_parallel_size=2",
      "--world-size", "2"], ["model.moe_exchange_chunks", "model.moe_grouped_gemm=false (SequentialMLP experts)"]),
    (["model.moe_exchange_chunks=3", "model.expert_model_parallel_size=2", "--world-size", "2"],
     ["model.moe_exchange_chunks: 3 does not divide the 128 positions", "model.seq_length=128"]),
])
def test_chunks_are_refused_where_nothing_is_exchanged_or_they_do_not_split(cli, args, fragments):
    assert_user_error(cli("pretrain", *MOE, *args), *fragments)


def test_chunks_pass_the_dry_run_under_expert_parallelism(cli):
    result = cli("pretrain", *MOE, "model.moe_exchange_chunks=4", "model.expert_model_parallel_size=2",
                 "--world-size", "2")
    assert result.exit_code == 0, result.output
