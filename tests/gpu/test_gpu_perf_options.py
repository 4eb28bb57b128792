"""Performance options on the GPU path (bf16, distributed optimizer): each Adam kernel, each SDPA kernel, compiled
layers and the weight-gradient accumulation fusion train like the defaults, and the Adam kernels resume like an
uninterrupted run."""

from __future__ import annotations

import os

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
    """bridge's Triton Adam (the default), SDPA kernel picked by torch, eager layers."""
    found = curve()
    assert len(found) == 10
    return found


@pytest.mark.parametrize("kernel", ["fused", "foreach"])
def test_torchs_adam_kernels_train_like_the_triton_one(default_curve, kernel):
    """The Triton step writes the bf16 model weights and megatron-core's copy is skipped: were they not written,
    the model would not train as torch's kernels (followed by the copy) train it."""
    assert curve(f"optimizer.adam_kernel={kernel}") == pytest.approx(default_curve, rel=2e-3)


def test_the_triton_adam_writes_the_model_weights_of_megatron_cores_other_mixed_precision_optimizer():
    """Without the distributed optimizer megatron-core's Float16OptimizerWithFloat16Params copies after the step."""
    plain = "optimizer.use_distributed_optimizer=false"
    assert curve(plain) == pytest.approx(curve(plain, "optimizer.adam_kernel=fused"), rel=2e-3)


@pytest.mark.parametrize("kernel", ["triton", "fused"])
def test_adam_resumes_like_an_uninterrupted_run(default_curve, tmp_path, kernel):
    curve(f"optimizer.adam_kernel={kernel}", f"checkpoint.save={tmp_path}", "checkpoint.save_interval=5")
    resumed = curve("optimizer.adam_kernel=triton", f"checkpoint.load={tmp_path}", "checkpoint.ckpt_step=5")
    assert resumed == pytest.approx(default_curve[5:], rel=2e-3)


@pytest.mark.parametrize("decoupled", [True, False])
@pytest.mark.parametrize("numel, model_dtype",
                         [(5000, "bfloat16"), (2048, None), (1, "bfloat16"), (3_000_001, "float16")])
def test_triton_adam_kernel_equals_the_torch_update(numel, model_dtype, decoupled):
    import torch

    from bridge_cli.runtime.triton_adam import adam_update

    generator = torch.Generator().manual_seed(numel)
    tensors = [torch.randn(numel, generator=generator) for _ in range(3)] + [torch.rand(numel, generator=generator)]
    model = None if model_dtype is None else torch.empty(numel, dtype=getattr(torch, model_dtype))
    on_gpu = [t.cuda() for t in tensors] + [None if model is None else model.cuda()]
    for args in (tensors + [model], on_gpu):
        adam_update(*args, step=3, lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, decoupled=decoupled,
                    grad_factor=0.7)
    for want, got in zip(tensors, on_gpu):
        torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-7)
    if model is not None:  # rounded as torch rounds (the fp32 weights above may differ in their last bit)
        assert torch.equal(on_gpu[-1], on_gpu[0].to(model.dtype))


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
    takes the zeroed placeholder (megatron-core's zero_out_wgrad)."""
    assert curve("model.gradient_accumulation_fusion=true") == pytest.approx(default_curve, rel=1e-2)


def test_gradient_accumulation_fusion_with_compiled_layers(default_curve):
    """The linears' main_grad accumulation traces (bridge_cli/models/wgrad_in_graph.py): no layer breaks."""
    result = bridge("pretrain", *RUN, "model.gradient_accumulation_fusion=true", "model.compile_layers=true",
                    env={**os.environ, "TORCH_LOGS": "graph_breaks"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(result.stdout) == pytest.approx(default_curve, rel=1e-2)
    assert "Graph break" not in result.stderr, result.stderr[-3000:]


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


@pytest.mark.parametrize("compiled", [False, True])
def test_triton_cross_entropy_trains_like_the_unfused_one(default_curve, compiled):
    """model.cross_entropy_fusion_impl=triton against the unfused loss (the default curve), eager and compiled."""
    triton = curve("model.cross_entropy_loss_fusion=true", "model.cross_entropy_fusion_impl=triton",
                   f"model.compile_layers={str(compiled).lower()}")
    assert triton == pytest.approx(default_curve, rel=1e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("vocab, first", [(50257, 0), (4099, 4099), (1000, 0)])
def test_triton_cross_entropy_kernels_equal_float64(dtype, vocab, first):
    """The two kernels on a vocabulary that no block divides, and on a rank's slice (labels ``first`` onwards are
    its own): per-row max, sum of exponentials and label logit, then softmax minus one-hot times the gradient,
    into a new tensor and into the logits' own storage."""
    import torch

    from bridge_cli.models import cross_entropy

    torch.manual_seed(0)
    rows = 257
    logits = (torch.randn(rows, vocab, device="cuda") * 5).to(getattr(torch, dtype))
    labels = torch.randint(0, 2 * vocab, (rows,), device="cuda")  # half of them on another rank's slice
    upstream = torch.randn(rows, device="cuda")
    exact = logits.double()
    local = labels - first
    on_rank = (local >= 0) & (local < vocab)
    peak, sum_exp, target = cross_entropy._row_stats(logits, labels, first)
    torch.testing.assert_close(peak.double(), exact.max(-1).values, rtol=0, atol=0)
    want_sum = (exact - exact.max(-1, keepdim=True).values).exp().sum(-1)
    torch.testing.assert_close(sum_exp.double(), want_sum, rtol=1e-5, atol=0)  # fp32 sums of up to 50K terms
    want_target = torch.where(on_rank, exact.gather(-1, local.clamp(0, vocab - 1)[:, None])[:, 0], 0.0)
    torch.testing.assert_close(target.double(), want_target, rtol=0, atol=0)

    log_sum_exp = exact.logsumexp(-1)
    grad = cross_entropy._grad_logits(logits, labels, first, log_sum_exp.float(), upstream, False)
    want = (exact - log_sum_exp[:, None]).exp()
    want[on_rank.nonzero()[:, 0], local[on_rank]] -= 1.0
    want = (want * upstream.double()[:, None]).to(logits.dtype)
    assert grad.dtype == logits.dtype and grad.data_ptr() != logits.data_ptr()
    torch.testing.assert_close(grad, want, rtol=1e-5 if dtype == "float32" else 1.6e-2, atol=1e-6)
    spent = logits.clone()  # in place: the same numbers in the logits' storage, their version moved
    version = spent._version
    in_place = cross_entropy._grad_logits(spent, labels, first, log_sum_exp.float(), upstream, True)
    assert in_place.data_ptr() == spent.data_ptr() and spent._version > version
    torch.testing.assert_close(in_place, grad, rtol=0, atol=0)


@pytest.mark.parametrize("compiled", [False, True])
def test_fused_qkv_rope_trains_like_megatron_cores_split_and_rope(default_curve, compiled):
    """model.fused_single_qkv_rope (bridge's Triton kernels, no Transformer Engine) against the default curve."""
    fused = curve("model.fused_single_qkv_rope=true", f"model.compile_layers={str(compiled).lower()}")
    assert fused == pytest.approx(default_curve, rel=1e-2)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("tokens, groups, q_per_group, head, rotary, per_token", [
    (4096 * 2, 8, 4, 64, 64, False),  # the 1.5B proxy's shape
    (37 * 3, 2, 3, 80, 40, True),  # a partial rotary dimension, one angle row per token, tokens no block divides
    (64, 1, 1, 96, 96, False),  # one group, a head size no power of two
    (128, 2, 4, 128, 128, False),  # llama8b's head
])
def test_fused_qkv_rope_kernels_equal_float64(dtype, tokens, groups, q_per_group, head, rotary, per_token):
    """The forward and backward Triton kernels against the torch ops' math in float64."""
    import torch

    from bridge_cli.models import qkv_rope

    torch.manual_seed(0)
    batch = 3 if tokens % 3 == 0 else 2
    seq = tokens // batch
    mixed = torch.randn(seq, batch, groups, (q_per_group + 2) * head, device="cuda").to(getattr(torch, dtype))
    angles = torch.rand(seq, batch if per_token else 1, 1, rotary // 2, device="cuda") * seq
    freqs = torch.cat([angles, angles], dim=-1)
    outputs = torch.ops.bridge.qkv_rope(mixed, freqs, q_per_group)
    cpu = (mixed.double().cpu(), freqs.double().cpu())
    expected = qkv_rope.qkv_rope(*cpu, q_per_group)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == "float32" else dict(rtol=1.6e-2, atol=1.6e-2)
    for got, want in zip(outputs, expected):
        torch.testing.assert_close(got.double().cpu(), want, **tolerance)
    grads = [torch.randn_like(t) for t in outputs]
    grad_mixed = torch.ops.bridge.qkv_rope_backward(*grads, freqs)
    want = qkv_rope.qkv_rope_backward(*(g.double().cpu() for g in grads), cpu[1])
    torch.testing.assert_close(grad_mixed.double().cpu(), want, **tolerance)
