"""MoE on the GPU: torch._grouped_mm experts equal the per-expert GEMM loop in bf16, and tiny_moe
trains with grouped experts in bf16."""

from __future__ import annotations

import pytest
import torch

from bridge_cli.models.moe_experts import _grouped_mm_supported, grouped_linear
from tests.conftest import bridge
from tests.integration.test_pretrain_cpu import losses

pytestmark = pytest.mark.gpu


def test_grouped_mm_equals_the_per_expert_loop_forward_and_backward():
    x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(8, 384, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    counts = torch.tensor([300, 0, 17, 200, 1, 182, 150, 150], device="cuda")
    assert _grouped_mm_supported(x, weight), "needs torch._grouped_mm and a Hopper or newer GPU"
    out = grouped_linear(x, weight, counts)
    out.float().square().sum().backward()
    grads = x.grad.clone(), weight.grad.clone()
    x.grad, weight.grad = None, None
    pieces = torch.split(x, counts.tolist())
    reference = torch.cat([piece @ weight[e].t() for e, piece in enumerate(pieces)])
    reference.float().square().sum().backward()
    for ours, theirs in ((out, reference), (grads[0], x.grad), (grads[1], weight.grad)):
        # bf16 rounds each product once; the two kernels differ by that rounding, not by more
        assert (ours.float() - theirs.float()).norm() / theirs.float().norm() < 1e-2


def test_tiny_moe_trains_with_grouped_experts_in_bf16():
    result = bridge("pretrain", "recipe=tiny_moe", "mixed_precision=bf16_mixed", "model.moe_grouped_gemm=true",
                    "train.train_iters=30", "logger.log_interval=5", "train.eval_iters=0")
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert curve[-1] < 0.7 * curve[0], curve


def test_lora_on_grouped_experts_fine_tunes_in_bf16(tmp_path):
    """The adapters' grouped GEMMs (rank 32 and rank 4, which falls back to the expert loop) on torch._grouped_mm."""
    run = ["recipe=tiny_moe", "mixed_precision=bf16_mixed", "model.moe_grouped_gemm=true", "train.eval_iters=0",
           "logger.log_interval=5"]
    base = tmp_path / "base"
    assert bridge("pretrain", *run, "train.train_iters=5", f"checkpoint.save={base}").returncode == 0
    for rank in (32, 4):
        result = bridge("finetune", *run, "peft=lora", f"peft.dim={rank}", "train.train_iters=20",
                        f"checkpoint.pretrained_checkpoint={base}")
        assert result.returncode == 0, result.stderr[-3000:]
        curve = losses(result.stdout)
        assert curve[-1] < curve[0], curve
