"""The auxiliary-loss scaler bridge gives megatron-core's router: megatron-core's gradients, read at
backward time, and a function that ``torch.compile`` traces whole."""

from __future__ import annotations

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
