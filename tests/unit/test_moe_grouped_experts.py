"""Grouped-GEMM experts (model.moe_grouped_gemm=true without Transformer Engine) against megatron-core's
SequentialMLP: the same numbers in fp32 on the CPU, and torch_dist checkpoints that load either way."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bridge_cli.models.moe_experts import GroupedGemmExperts, grouped_linear
from bridge_cli.models.provider import GPTModelProvider

VOCAB, SEQ, BATCH = 128, 16, 2


def build(grouped: bool, gated: bool = True, seed: int = 0):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    config = GPTModelProvider(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB,
        seq_length=SEQ, make_vocab_size_divisible_by=128, position_embedding_type="rope", normalization="RMSNorm",
        add_bias_linear=False, gated_linear_unit=gated, activation_func=F.silu if gated else F.gelu,
        hidden_dropout=0.0, attention_dropout=0.0, spec="torch", num_moe_experts=4, moe_router_topk=2,
        moe_ffn_hidden_size=32, moe_layer_freq=[0, 1], moe_token_dispatcher_type="alltoall",
        moe_aux_loss_coeff=0.0, moe_grouped_gemm=grouped)
    return config.provide()


def experts(model):
    return model.decoder.layers[1].mlp.experts


def copy_sequential_into_grouped(sequential, grouped) -> None:
    with torch.no_grad():
        for name, tensor in sequential.state_dict().items():
            if ".mlp.experts." not in name and torch.is_tensor(tensor):
                grouped.state_dict()[name].copy_(tensor)
        seq_experts, grp_experts = experts(sequential), experts(grouped)
        for e, expert in enumerate(seq_experts.local_experts):
            grp_experts.weight1[e].copy_(expert.linear_fc1.weight)
            grp_experts.weight2[e].copy_(expert.linear_fc2.weight)


def forward_backward(model):
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    position_ids = torch.arange(SEQ).expand(BATCH, SEQ)
    model.zero_grad()
    logits = model(tokens, position_ids, None)
    logits.float().square().mean().backward()
    return logits.detach()


@pytest.mark.parametrize("gated", [True, False], ids=["swiglu", "gelu"])
def test_grouped_experts_equal_sequential_mlp_forward_and_gradients(one_process, gated):
    sequential, grouped = build(False, gated), build(True, gated, seed=1)
    assert type(experts(sequential)).__name__ == "SequentialMLP"
    assert isinstance(experts(grouped), GroupedGemmExperts)
    assert type(grouped.decoder.layers[0].mlp).__name__ == "MLP"  # moe_layer_freq: the first layer is dense
    copy_sequential_into_grouped(sequential, grouped)
    torch.testing.assert_close(forward_backward(grouped), forward_backward(sequential), rtol=1e-5, atol=1e-5)
    for e, expert in enumerate(experts(sequential).local_experts):
        torch.testing.assert_close(experts(grouped).weight1.grad[e], expert.linear_fc1.weight.grad, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(experts(grouped).weight2.grad[e], expert.linear_fc2.weight.grad, rtol=1e-5, atol=1e-6)
    router_seq = sequential.decoder.layers[1].mlp.router.weight.grad
    torch.testing.assert_close(grouped.decoder.layers[1].mlp.router.weight.grad, router_seq, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("direction", ["sequential_to_grouped", "grouped_to_sequential"])
def test_a_checkpoint_of_one_loads_into_the_other(one_process, tmp_path, direction):
    from megatron.core import dist_checkpointing

    source, target = (build(False), build(True, seed=1))
    if direction == "grouped_to_sequential":
        source, target = target, source
    dist_checkpointing.save(source.sharded_state_dict(), str(tmp_path))
    checkpoint_keys = {v.key for v in source.sharded_state_dict().values()}
    assert {"decoder.layers.1.mlp.experts.experts.linear_fc1.weight",
            "decoder.layers.1.mlp.experts.experts.linear_fc2.weight"} <= checkpoint_keys
    loaded = dist_checkpointing.load(target.sharded_state_dict(), str(tmp_path))
    target.load_state_dict(loaded)
    torch.testing.assert_close(forward_backward(target), forward_backward(source), rtol=1e-5, atol=1e-5)


def test_grouped_linear_handles_experts_without_tokens():
    x, weight = torch.randn(5, 8), torch.randn(3, 4, 8)
    counts = torch.tensor([2, 0, 3])
    out = grouped_linear(x, weight, counts)
    torch.testing.assert_close(out, torch.cat([x[:2] @ weight[0].T, x[2:] @ weight[2].T]))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_flagged_weights_add_their_gradient_into_main_grad_in_one_graph(compiled):
    """model.gradient_accumulation_fusion on grouped experts: a flagged weight's gradient is added into its
    main_grad (fp32, on top of what it held) and its own gradient is a placeholder; compiled, the function that
    does it stays in the graph (no graph break), so a compiled MoE layer is one graph."""
    torch.manual_seed(0)
    x = torch.randn(9, 8, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(3, 4, 8))
    weight.main_grad = torch.randn(3, 4, 8)
    weight.grad_added_to_main_grad = True
    held = weight.main_grad.clone()
    counts = torch.tensor([2, 0, 5])  # two rows past the counts: the dispatcher's unused tail
    plain = weight.detach().clone().requires_grad_(True)
    x_plain = x.detach().clone().requires_grad_(True)
    grouped_linear(x_plain, plain, counts).square().sum().backward()

    def step(x, counts):
        return grouped_linear(x, weight, counts, into_main_grad=True).square().sum()

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    (torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step)(x, counts).backward()
    torch.testing.assert_close(weight.main_grad, held + plain.grad)
    torch.testing.assert_close(x.grad, x_plain.grad)
    assert not torch._dynamo.utils.counters["graph_break"]


def test_unflagged_weights_keep_their_own_gradient():
    """Without the flag (a model not wrapped for training: evaluation, export) the gradient is autograd's."""
    x, weight = torch.randn(5, 8), torch.nn.Parameter(torch.randn(3, 4, 8))
    weight.main_grad = torch.zeros(3, 4, 8)
    grouped_linear(x, weight, torch.tensor([2, 0, 3]), into_main_grad=True).sum().backward()
    assert weight.grad is not None and not weight.main_grad.any()


def test_lora_on_grouped_experts_merges_into_the_expert_weights(one_process):
    from bridge_cli.config.peft_config import LoRAConfig
    from bridge_cli.peft.lora import apply_lora, merge_lora

    model = build(True)
    apply_lora([model], LoRAConfig(target_modules=["linear_fc1", "linear_fc2"]), seed=0)
    adapter = experts(model).adapter
    with torch.no_grad():  # B starts at zero: give the adapters an effect to fold
        for name in ("linear_fc1_out", "linear_fc2_out"):
            getattr(adapter, name).normal_(0, 0.5, generator=torch.Generator().manual_seed(2))
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(SEQ).expand(BATCH, SEQ)
    with torch.no_grad():
        with_adapters = model(tokens, positions, None)
        assert not torch.allclose(with_adapters, build(True)(tokens, positions, None), atol=1e-3)
        merge_lora([model])
        assert type(experts(model)) is GroupedGemmExperts and not hasattr(experts(model), "adapter")
        torch.testing.assert_close(model(tokens, positions, None), with_adapters, rtol=1e-5, atol=1e-5)
