"""The routed experts' SwiGLU times the routing probabilities over the rows below a count
(bridge_cli/models/expert_activation.py) on the CPU: the values and gradients of megatron-core's activation and the
probabilities' product for the rows below the count, zero past it; and where GroupedGemmExperts uses it. The Triton
kernels are tests/gpu/test_gpu_moe.py's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bridge_cli.models.expert_activation import swiglu_probs
from tests.unit.test_moe_dispatch import build, moe_layers


def reference(x: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """GroupedGemmExperts' activation without the count: SwiGLU, then the probabilities."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return (F.silu(gate) * up * probs.unsqueeze(-1)).to(x.dtype)


def test_values_and_gradients_below_the_count_and_zero_past_it():
    torch.manual_seed(0)
    x = torch.randn(10, 2 * 24, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(10, dtype=torch.float64, requires_grad=True)
    count = torch.tensor(7)
    out = swiglu_probs(x, probs, count)
    grad = torch.randn(10, 24, dtype=torch.float64)
    out.backward(grad)
    ours = out.detach(), x.grad.clone(), probs.grad.clone()
    x.grad = probs.grad = None
    expected = reference(x, probs)
    expected[:7].backward(grad[:7])
    torch.testing.assert_close(ours[0][:7], expected[:7].detach())
    torch.testing.assert_close(ours[1][:7], x.grad[:7])
    torch.testing.assert_close(ours[2][:7], probs.grad[:7])
    assert (ours[0][7:] == 0).all() and (ours[1][7:] == 0).all() and (ours[2][7:] == 0).all()


def test_gradients_pass_torch_autograd_gradcheck():
    x = torch.randn(5, 8, dtype=torch.float64, requires_grad=True)
    probs = torch.rand(5, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda a, b: swiglu_probs(a, b, torch.tensor(5)), (x, probs))


@pytest.mark.parametrize("overrides, counted", [
    ({}, False),  # every expert on this one rank, no capacity: no rows to skip
    (dict(moe_expert_capacity_factor=0.5), True),
    (dict(moe_expert_capacity_factor=0.5, moe_pad_expert_input_to_capacity=True), False),  # megatron-core's dispatcher
    (dict(moe_expert_capacity_factor=0.5, activation_func_clamp_value=7.0), False),  # a clamped gate
], ids=["dropless", "capacity", "padded", "clamped"])
def test_grouped_experts_count_their_activation_where_the_buffer_has_a_tail(one_process, overrides, counted):
    experts = moe_layers(build(**overrides))[0].experts
    assert experts.counted_activation is counted
