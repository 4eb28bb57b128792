"""model.cross_entropy_fusion_impl=triton's cross entropy (the torch passes the CPU runs; the Triton kernels are
checked against the same reference in tests/gpu) against float64, and the config rules that choose it."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from bridge_cli.models.cross_entropy import VocabParallelCrossEntropy, language_model_loss


@pytest.mark.parametrize("in_place", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_gradient_equal_float64(dtype, in_place):
    torch.manual_seed(0)
    base = (torch.randn(37, 301) * 4).to(dtype).requires_grad_()
    logits = base * 1  # not a leaf: a model's logits, which in_place may overwrite
    labels, upstream = torch.randint(0, 301, (37,)), torch.randn(37)
    exact = logits.detach().double().requires_grad_()
    expected = F.cross_entropy(exact, labels, reduction="none")
    (expected_grad,) = torch.autograd.grad((expected * upstream.double()).sum(), exact)
    before = logits.detach().clone()

    losses = VocabParallelCrossEntropy.apply(logits, labels, None, in_place)
    (grad,) = torch.autograd.grad((losses * upstream).sum(), logits)
    assert losses.dtype == torch.float32 and grad.dtype == dtype
    assert (grad.data_ptr() == logits.data_ptr()) == in_place  # the gradient took the logits' storage, or not
    if not in_place:
        torch.testing.assert_close(logits.detach(), before, rtol=0, atol=0)
    torch.testing.assert_close(losses.double(), expected, rtol=1e-6, atol=1e-6)
    tolerance = 1e-6 if dtype == torch.float32 else 8e-3  # one bf16 rounding of each gradient
    torch.testing.assert_close(grad.double(), expected_grad.to(dtype).double(), rtol=tolerance, atol=tolerance)


def test_megatron_layout_in_and_out():
    """[b, s] labels and [s, b, vocab] logits in, [b, s] losses out, as megatron-core's compute_language_model_loss."""
    torch.manual_seed(0)
    logits, labels = torch.randn(5, 3, 11), torch.randint(0, 11, (3, 5))
    expected = F.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")
    torch.testing.assert_close(language_model_loss(labels, logits, None), expected)


def test_an_op_that_kept_the_logits_fails_loudly_when_the_gradient_overwrites_them():
    """exp keeps its output for its backward; the in-place gradient moves that output's version counter."""
    base = torch.randn(4, 9, requires_grad=True)
    logits = base.exp()
    losses = VocabParallelCrossEntropy.apply(logits, torch.randint(0, 9, (4,)), None, True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        losses.sum().backward()


def test_the_logits_survive_the_forward_for_the_backward():
    torch.manual_seed(0)
    logits = torch.randn(4, 9, requires_grad=True)
    before = logits.detach().clone()
    VocabParallelCrossEntropy.apply(logits, torch.randint(0, 9, (4,)), None)
    torch.testing.assert_close(logits.detach(), before, rtol=0, atol=0)


@pytest.mark.parametrize("overrides, message", [
    (["model.cross_entropy_fusion_impl=triton"], "model.cross_entropy_loss_fusion=false runs the unfused one"),
    pytest.param(["model.cross_entropy_loss_fusion=true", "model.cross_entropy_fusion_impl=te"],
                 "transformer_engine does not import here",
                 marks=pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None,
                                          reason="Transformer Engine is installed here")),
])
def test_a_cross_entropy_that_would_not_run_is_refused(cli, overrides, message):
    result = cli("config", "validate", "recipe=tiny", *overrides)
    assert result.exit_code == 2 and "model.cross_entropy_fusion_impl" in result.stderr and message in result.stderr
