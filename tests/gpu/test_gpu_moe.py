"""MoE on the GPU: torch._grouped_mm experts equal the per-expert GEMM loop in bf16, the grouped weight
gradient added into main_grad by the Triton kernel equals the separate add, tiny_moe trains with
grouped experts in bf16 (with and without that fusion), the token dispatcher's row kernels skip the unused tail, and (on
two GPUs) expert parallelism over NCCL, eager and compiled, follows one GPU and resumes exactly with its
distributed-optimizer state."""

from __future__ import annotations

import pytest
import torch

from bridge_cli.models.moe_experts import _grouped_mm_supported, grouped_linear
from tests.conftest import bridge, torchrun
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


def test_row_kernels_and_grouped_gemm_stop_at_the_count_on_the_gpu():
    """The dispatcher's buffers hold more rows than the count on the GPU: the Triton gather and per-token sum
    and the grouped GEMM compute the rows below it as torch does, whatever the tail holds."""
    from bridge_cli.models.moe_rows import gather_rows, sum_rows

    src = torch.randn(300, 2048 + 64, device="cuda", dtype=torch.bfloat16)
    index = torch.randint(0, 300, (1000,), device="cuda")
    count = torch.tensor(613, device="cuda")
    gathered = gather_rows(src, index, count)
    assert torch.equal(gathered[:613], src[index[:613]])
    rows = torch.randint(-1, 613, (300, 8), device="cuda")
    summed = sum_rows(gathered, rows)
    expected = torch.where((rows >= 0).unsqueeze(-1), gathered[rows.clamp_min(0)].float(), 0).sum(1)
    torch.testing.assert_close(summed.float(), expected, rtol=1e-2, atol=1e-2)
    weight = torch.randn(4, 256, 2048 + 64, device="cuda", dtype=torch.bfloat16)
    counts = torch.tensor([100, 0, 313, 200], device="cuda")
    padded = torch.cat([gathered[:613], torch.full_like(gathered[613:], float("nan"))])
    out = grouped_linear(padded, weight, counts)
    assert out.shape[0] == 1000 and _grouped_mm_supported(padded, weight)
    loop = torch.cat([piece @ weight[e].t() for e, piece in enumerate(torch.split(gathered[:613], counts.tolist()))])
    torch.testing.assert_close(out[:613].float(), loop.float(), rtol=2e-2, atol=2e-1)


@pytest.mark.parametrize("ffn", [768, 1408, 100])  # moe_proxy's, DeepSeek-V2-Lite's, and less than a block
def test_the_counted_expert_activation_equals_torchs_below_the_count(ffn):
    """expert_activation's Triton kernels on a buffer whose tail holds NaN: below the count the values and both
    gradients are those of torch's SwiGLU times the probabilities (fp32 math, one rounding); past it the
    probabilities' gradient is zero and nothing is NaN-poisoned above it."""
    from bridge_cli.models.expert_activation import swiglu_probs

    torch.manual_seed(0)
    rows, count = 1000, 613
    x = torch.randn(rows, 2 * ffn, device="cuda", dtype=torch.bfloat16)
    x[count:] = float("nan")
    x.requires_grad_()
    probs = torch.rand(rows, device="cuda", requires_grad=True)
    grad = torch.randn(rows, ffn, device="cuda", dtype=torch.bfloat16)
    out = swiglu_probs(x, probs, torch.tensor(count, device="cuda"))
    out.backward(grad)
    ours = out[:count].float(), x.grad[:count].float(), probs.grad.clone()
    x.grad = probs.grad = None
    gate, up = x[:count].float().chunk(2, dim=-1)
    expected = torch.nn.functional.silu(gate) * up * probs[:count].unsqueeze(-1)
    expected.backward(grad[:count].float())
    torch.testing.assert_close(ours[0], expected.detach().to(torch.bfloat16).float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(ours[1], x.grad[:count].float(), rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(ours[2][:count], probs.grad[:count], rtol=1e-3, atol=1e-3)
    assert (ours[2][count:] == 0).all() and torch.isfinite(ours[0]).all() and torch.isfinite(ours[1]).all()


def test_tiny_moe_trains_with_grouped_experts_in_bf16():
    result = bridge("pretrain", "recipe=tiny_moe", "mixed_precision=bf16_mixed", "model.moe_grouped_gemm=true",
                    "train.train_iters=30", "logger.log_interval=5", "train.eval_iters=0")
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert curve[-1] < 0.7 * curve[0], curve


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_grouped_wgrad_kernel_adds_into_main_grad(grad_dtype):
    """Uneven counts, empty experts, and sizes that are no multiple of the kernel's tiles."""
    from bridge_cli.models import grouped_wgrad

    torch.manual_seed(0)
    counts = torch.tensor([300, 0, 17, 200, 1, 182, 150, 0], device="cuda")
    ends = torch.cumsum(counts, 0, dtype=torch.int32)
    dy = torch.randn(int(counts.sum()), 200, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(int(counts.sum()), 136, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.randn(8, 200, 136, device="cuda", dtype=grad_dtype)
    expected = main_grad.double()
    for e, (dy_e, x_e) in enumerate(zip(torch.split(dy, counts.tolist()), torch.split(x, counts.tolist()))):
        expected[e] += dy_e.double().t() @ x_e.double()
    grouped_wgrad.accumulate(dy, x, ends, main_grad)
    error = (main_grad.double() - expected).abs().max() / expected.abs().max()
    assert error < (1e-5 if grad_dtype == torch.float32 else 1e-2), error


def test_grouped_linear_into_main_grad_equals_the_separate_add():
    """Two micro-batches as megatron-core's data-parallel wrapper sees them: the fused path of a weight flagged as
    the wrap flags it (moe_experts.flag_main_grad_weights) leaves the sum of both weight gradients in main_grad, and
    the input gradients are the same."""
    torch.manual_seed(0)
    counts = torch.tensor([300, 0, 17, 200, 1, 182, 150, 150], device="cuda")
    weight = torch.randn(8, 384, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    weight.main_grad = torch.zeros(weight.shape, device="cuda")
    weight.grad_added_to_main_grad = True
    expected_main_grad = torch.zeros(weight.shape, device="cuda")
    for _ in range(2):
        x = torch.randn(1000, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        grouped_linear(x, weight, counts, into_main_grad=True).float().square().sum().backward()
        fused_x_grad, weight.grad, x.grad = x.grad, None, None
        grouped_linear(x, weight, counts).float().square().sum().backward()
        expected_main_grad += weight.grad.float()
        assert (fused_x_grad.float() - x.grad.float()).norm() / x.grad.float().norm() < 1e-3
        weight.grad = None
    error = (weight.main_grad - expected_main_grad).norm() / expected_main_grad.norm()
    assert error < 1e-2, error  # the separate add rounds each gradient to bf16 first


@pytest.mark.parametrize("compiled", ["false", "true"])
def test_tiny_moe_with_gradient_accumulation_fusion_trains_like_the_separate_add(compiled):
    run = ["recipe=tiny_moe", "mixed_precision=bf16_mixed", "model.moe_grouped_gemm=true", "train.train_iters=10",
           "logger.log_interval=1", "train.eval_iters=0", f"model.compile_layers={compiled}"]
    curves = []
    for fusion in ("false", "true"):
        result = bridge("pretrain", *run, f"model.gradient_accumulation_fusion={fusion}")
        assert result.returncode == 0, result.stderr[-3000:]
        curves.append(losses(result.stdout))
    assert len(curves[1]) == 10 and curves[1] == pytest.approx(curves[0], rel=1e-2)


def test_lora_on_grouped_experts_fine_tunes_in_bf16(tmp_path):
    """The adapters' grouped GEMMs (rank 32 and rank 4, which falls back to the expert loop) on torch._grouped_mm."""
    run = ["recipe=tiny_moe", "mixed_precision=bf16_mixed", "model.moe_grouped_gemm=true", "train.eval_iters=0",
           "logger.log_interval=5"]
    base = tmp_path / "base"
    assert bridge("pretrain", *run, "train.train_iters=5", f"checkpoint.save={base}").returncode == 0
    for rank in (32, 4):
        # alpha = rank: the adapters' scale stays 1 (alpha 32 at rank 4 scales by 8, and the loss climbs at this lr)
        result = bridge("finetune", *run, "peft=lora", f"peft.dim={rank}", f"peft.alpha={rank}", "train.train_iters=20",
                        f"checkpoint.pretrained_checkpoint={base}")
        assert result.returncode == 0, result.stderr[-3000:]
        curve = losses(result.stdout)
        assert curve[-1] < curve[0], curve


TWO_GPU_RUN = ["recipe=tiny_moe", "mixed_precision=bf16_mixed", "model.moe_grouped_gemm=true", "train.eval_iters=0",
               "logger.log_interval=1", "train.train_iters=12", "model.use_cpu_initialization=true",
               "optimizer.use_distributed_optimizer=true"]
EP2 = "model.expert_model_parallel_size=2"


def _two_gpus() -> bool:
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


@pytest.mark.slow
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs")
def test_expert_parallel_two_over_nccl_follows_one_gpu():
    one = bridge("pretrain", *TWO_GPU_RUN)
    ep = torchrun(2, "pretrain", *TWO_GPU_RUN, EP2)
    assert one.returncode == 0 and ep.returncode == 0, (one.stderr[-2000:], ep.stderr[-2000:])
    assert losses(ep.stdout) == pytest.approx(losses(one.stdout), rel=2e-2)


@pytest.mark.slow
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs")
@pytest.mark.parametrize("dropping", [[], ["model.moe_expert_capacity_factor=1.0"]], ids=["dropless", "capacity"])
def test_expert_parallel_two_with_compiled_layers_follows_one_gpu(dropping):
    """bridge's dispatcher keeps every count on the GPU, so the MoE layers compile under EP (no graph break
    allowed in them), and every MoE layer runs the same graph: no recompilation names what megatron-core's routers
    record per layer (their layer number, the loss tracker's entries) nor the log line's pair counters (on 4 H100s
    with megatron-core 0.19.2 these compiled the MoE layer once per layer, then once more for the tracker). With a
    capacity factor each rank's router drops pairs from its own micro-batch, as one GPU does micro-batch by
    micro-batch."""
    compiled = ["model.compile_layers=true", "model.gradient_accumulation_fusion=false"]
    one = bridge("pretrain", *TWO_GPU_RUN, *dropping)
    ep = torchrun(2, "pretrain", *TWO_GPU_RUN, EP2, *compiled, *dropping, env={"TORCH_LOGS": "graph_breaks,recompiles"})
    assert one.returncode == 0 and ep.returncode == 0, (one.stderr[-2000:], ep.stderr[-2000:])
    assert "Graph break" not in ep.stderr, ep.stderr[-3000:]
    reasons = [line for line in ep.stderr.splitlines() if "__recompiles" in line]
    per_layer = [line for line in reasons if any(name in line for name in (
        "layer_number", "load_balancing_loss", "z_loss", "_metrics", "pairs", "exchange"))]
    assert not per_layer, "\n".join(reasons)
    assert losses(ep.stdout) == pytest.approx(losses(one.stdout), rel=2e-2)


@pytest.mark.slow
@pytest.mark.skipif(not _two_gpus(), reason="needs 2 GPUs")
def test_expert_parallel_resume_loads_the_chained_distributed_optimizer(tmp_path):
    """With EP > 1 megatron-core chains a dense and an expert distributed optimizer and saves their state
    under ``chained_<i>.optimizer.*``; resuming must load it, not start a fresh optimizer."""
    straight = torchrun(2, "pretrain", *TWO_GPU_RUN, EP2)
    save = f"checkpoint.save={tmp_path / 'ckpt'}"
    first = torchrun(2, "pretrain", *TWO_GPU_RUN, EP2, save, "train.exit_interval=6")
    resumed = torchrun(2, "pretrain", *TWO_GPU_RUN, EP2, save)
    for result in (straight, first, resumed):
        assert result.returncode == 0, result.stderr[-3000:]
    assert "optimizer starts fresh" not in resumed.stdout
    # a fresh Adam state would move the resumed curve by far more than bf16's non-deterministic sums
    assert losses(resumed.stdout) == pytest.approx(losses(straight.stdout)[6:], rel=5e-3)
