"""bridge's fixes to megatron-core's router: the auxiliary-loss scaler (megatron-core's gradients, read at backward
time, and a function that ``torch.compile`` traces whole), and the expert bias back in fp32 before anything compiles."""

from __future__ import annotations

import logging

import pytest
import torch

from bridge_cli.models.moe_compat import make_aux_loss_scaler_traceable


def attach(probs, weight):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    aux_loss = (weight * probs).square().sum()
    return MoEAuxLossAutoScaler.apply(probs * 2, aux_loss)


def grads_with_scale_set_after_forward(fn, scale: float):
    """As megatron-core's schedule does: forward, then set_loss_scale, then backward."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    probs = torch.linspace(-1, 1, 12).view(3, 4).requires_grad_()
    weight = torch.arange(4.0)
    out = fn(probs, weight)
    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor([scale]))  # shaped as the schedule sets it
    out.sum().backward()
    return probs.grad


@pytest.mark.slow  # compiles on the CPU
def test_the_aux_loss_gets_the_scale_set_after_the_forward_in_eager_and_compiled(monkeypatch):
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)
    monkeypatch.setattr(MoEAuxLossAutoScaler, "backward", MoEAuxLossAutoScaler.backward)  # undone after the test
    probs = torch.linspace(-1, 1, 12).view(3, 4)
    weight = torch.arange(4.0)
    for scale in (0.25, 3.0):
        expected = 2 + scale * 2 * weight.square() * probs  # d(2 p)/dp + scale * d(aux)/dp
        torch.testing.assert_close(grads_with_scale_set_after_forward(attach, scale), expected)  # megatron-core's own
        make_aux_loss_scaler_traceable()
        torch.testing.assert_close(grads_with_scale_set_after_forward(attach, scale), expected)
        compiled = torch.compile(attach, fullgraph=True, dynamic=False)  # fails on a graph break
        torch.testing.assert_close(grads_with_scale_set_after_forward(compiled, scale), expected)
        monkeypatch.setattr(MoEAuxLossAutoScaler, "main_loss_backward_scale", None)


def test_the_expert_bias_is_fp32_before_the_first_forward_after_the_bf16_cast(one_process):
    """Float16Module casts the router's expert bias to bf16 with the weights; megatron-core casts it back in the
    router's forward, which under compiled layers is a graph break. keep_router_biases_in_fp32 does it first."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    from bridge_cli.models.moe_compat import keep_router_biases_in_fp32
    from bridge_cli.models.provider import GPTModelProvider

    model_parallel_cuda_manual_seed(0)
    config = GPTModelProvider(
        num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=16, spec="torch",
        normalization="RMSNorm", add_bias_linear=False, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_token_dispatcher_type="alltoall",
        bf16=True, params_dtype=torch.bfloat16)
    model = Float16Module(config, config.provide())
    biases = [m.expert_bias for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    assert biases and all(b.dtype == torch.bfloat16 for b in biases)  # what the cast leaves
    keep_router_biases_in_fp32([model])
    biases = [m.expert_bias for m in model.modules() if getattr(m, "expert_bias", None) is not None]
    assert biases and all(b.dtype == torch.float32 for b in biases)



class RecompileReasons(logging.Handler):
    """dynamo's recompilation messages (which guard failed) while it is installed."""

    def __enter__(self):
        self.messages: list[str] = []
        torch._logging.set_logs(recompiles=True)
        logging.getLogger("torch._dynamo.guards.__recompiles").addHandler(self)
        return self

    def __exit__(self, *_):
        logging.getLogger("torch._dynamo.guards.__recompiles").removeHandler(self)
        torch._logging.set_logs()

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def recompiles_and_losses(prepared: bool) -> tuple[list[str], torch.Tensor]:
    """Compile each layer of a 3-layer MoE model (dynamo with its eager backend, no inductor), run one training
    forward; dynamo's recompilation messages, and the load-balancing losses the routers recorded, one per layer
    (megatron-core's tracker)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.transformer_layer import TransformerLayer

    from bridge_cli.models.moe_compat import make_router_loss_entries, number_routers_by_tensor
    from bridge_cli.models.provider import GPTModelProvider

    model_parallel_cuda_manual_seed(0)
    config = GPTModelProvider(
        num_layers=3, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=16, spec="torch",
        normalization="RMSNorm", add_bias_linear=False, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        moe_grouped_gemm=True, moe_token_dispatcher_type="alltoall", moe_router_load_balancing_type="aux_loss",
        moe_aux_loss_coeff=1e-2)
    model = config.provide().train()
    clear_tracker()
    if prepared:
        number_routers_by_tensor([model])
        make_router_loss_entries([model])
    torch._dynamo.reset()
    for module in model.modules():
        if isinstance(module, TransformerLayer):
            module.compile(backend="eager", dynamic=False)
    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with RecompileReasons() as reasons:
        model(tokens, torch.arange(16).expand(2, 16), None)
    return reasons.messages, tracked_values("load_balancing_loss")


def clear_tracker() -> None:
    try:  # megatron-core 0.19
        from megatron.core.transformer.moe.moe_logging import destroy_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        get_moe_layer_wise_logging_tracker().clear()
    else:
        destroy_moe_metrics_tracker()


def tracked_values(name: str) -> torch.Tensor:
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker
    except ImportError:
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        return get_moe_layer_wise_logging_tracker()[name]["values"].clone()
    return get_moe_metrics_tracker().metrics[name].values.clone()


@pytest.mark.slow  # compiles on the CPU (dynamo only)
def test_compiled_moe_layers_do_not_recompile_per_layer_nor_for_the_tracker_and_still_record_each_layers_loss(one_process):
    """A router's int layer number, read by megatron-core's tracker inside the compiled layer, made every MoE layer
    compile graphs of its own (on the GPU, megatron-core 0.19.2: one compile per layer of the MoE proxy); numbered
    by a tensor, no recompilation comes from it, and each layer's load-balancing loss lands in its own entry as
    before. The tracker's entry, made by the first layer's record inside its compiled code, recompiled the next
    layer once (megatron-core 0.19.2 on the GPU); made before compiling, it does not. (The CPU's grouped GEMM
    recompiles for its token counts either way, which the GPU's does not.)"""
    plain, expected = recompiles_and_losses(prepared=False)
    numbered, found = recompiles_and_losses(prepared=True)
    assert any("layer_number ==" in m for m in plain), plain  # megatron-core's own
    assert any("load_balancing_loss" in m for m in plain), plain
    assert not any("layer_number" in m or "load_balancing_loss" in m for m in numbered), numbered
    assert found.shape == (3,) and bool((found > 0).all()), found
    torch.testing.assert_close(found, expected)
