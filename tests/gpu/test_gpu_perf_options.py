"""Performance options on the GPU path (bf16, distributed optimizer): fused AdamW, each SDPA kernel, compiled
layers and the weight-gradient accumulation fusion train like the defaults, and a fused AdamW resumes like an
uninterrupted run."""

from __future__ import annotations

import pytest

from tests.conftest import bridge
from tests.integration.test_pretrain_cpu import losses

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

RUN = ["recipe=tiny", "mixed_precision=bf16_mixed", "optimizer.use_distributed_optimizer=true",
       "train.train_iters=10", "logger.log_interval=1", "train.eval_iters=0"]


def curve(*overrides: str) -> list[float]:
    result = bridge("pretrain", *RUN, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(result.stdout)


@pytest.fixture(scope="module")
def default_curve() -> list[float]:
    """Fused AdamW (the default), SDPA kernel picked by torch, eager layers."""
    found = curve()
    assert len(found) == 10
    return found


def test_fused_adamw_trains_like_foreach(default_curve):
    assert curve("optimizer.use_torch_fused_adam=false") == pytest.approx(default_curve, rel=2e-3)


def test_fused_adamw_resumes_like_an_uninterrupted_run(default_curve, tmp_path):
    curve(f"checkpoint.save={tmp_path}", "checkpoint.save_interval=5")
    resumed = curve(f"checkpoint.load={tmp_path}", "checkpoint.ckpt_step=5")
    assert resumed == pytest.approx(default_curve[5:], rel=2e-3)


@pytest.mark.parametrize("backend", ["flash", "cudnn", "math"])
def test_each_sdpa_backend_trains_like_auto(default_curve, backend):
    assert curve(f"model.sdpa_backend={backend}") == pytest.approx(default_curve, rel=1e-2)


def test_efficient_attention_trains_like_auto_without_grouped_query_attention():
    """torch 2.11's memory-efficient kernel takes no grouped keys/values: refused with GQA, so one group per head."""
    one_group_per_head = "model.num_query_groups=4"
    assert curve(one_group_per_head, "model.sdpa_backend=efficient") == pytest.approx(curve(one_group_per_head), rel=1e-2)


def test_compiled_layers_train_like_eager(default_curve):
    assert curve("model.compile_layers=true") == pytest.approx(default_curve, rel=1e-2)


def test_fused_linear_cross_entropy_trains_like_the_unfused_loss(default_curve):
    """bf16 on CUDA, chunks that do not divide the tokens (tiny: 4 x 128 tokens a micro-batch)."""
    fused = curve("model.fused_linear_cross_entropy=true", "model.linear_cross_entropy_chunk=200")
    assert fused == pytest.approx(default_curve, rel=1e-2)


def test_fused_linear_cross_entropy_with_compiled_layers(default_curve):
    fused = curve("model.fused_linear_cross_entropy=true", "model.compile_layers=true")
    assert fused == pytest.approx(default_curve, rel=1e-2)


def test_gradient_accumulation_fusion_trains_like_the_separate_add(default_curve):
    """Two micro-batches a step: the second GEMM adds into the first's main_grad; the tied output weight
    takes megatron-core's zeroed-placeholder path."""
    assert curve("model.gradient_accumulation_fusion=true") == pytest.approx(default_curve, rel=1e-2)


def test_gradient_accumulation_fusion_with_compiled_layers(default_curve):
    fused = curve("model.gradient_accumulation_fusion=true", "model.compile_layers=true")
    assert fused == pytest.approx(default_curve, rel=1e-2)


@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_wgrad_gemm_adds_into_main_grad(grad_dtype):
    import torch

    from bridge_cli.models.wgrad_accumulation import wgrad_gemm_accum_fp32

    torch.manual_seed(0)
    x = torch.randn(2, 64, 96, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(2, 64, 48, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.randn(48, 96, device="cuda", dtype=getattr(torch, grad_dtype))
    expected = main_grad.double() + dy.reshape(-1, 48).double().t() @ x.reshape(-1, 96).double()
    wgrad_gemm_accum_fp32(x, dy, main_grad)
    tolerance = 1e-4 if grad_dtype == "float32" else 1e-1
    assert torch.allclose(main_grad.double(), expected, atol=tolerance, rtol=1e-2 if grad_dtype != "float32" else 1e-5)
