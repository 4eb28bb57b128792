"""The sync-free gradient norm and in-place clip bridge gives megatron-core's clip_grads in place of its per-tensor fallbacks."""

from __future__ import annotations

import pytest
import torch

from bridge_cli.runtime.grad_norm import multi_tensor_l2_norm, multi_tensor_scale, use_foreach_clip_grads


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_of_all_the_tensors_in_fp32(dtype):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator).to(dtype) for shape in [(64, 32), (7,), (3, 5, 2)]]
    norm, per_tensor = multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    expected = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in grads]))
    assert norm.shape == (1,) and norm.dtype == torch.float32 and per_tensor is None
    torch.testing.assert_close(norm[0], expected, rtol=1e-6, atol=0)


def test_scale_in_place_equals_megatron_cores_fallback():
    from megatron.core.utils import local_multi_tensor_scale

    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) for shape in [(64, 32), (7,), (3, 5, 2)]]
    expected = [g.clone() for g in grads]
    local_multi_tensor_scale(2048 * 32, None, [expected, expected], 0.37)
    storage = [g.data_ptr() for g in grads]
    multi_tensor_scale(2048 * 32, None, [grads, grads], 0.37)
    assert [g.data_ptr() for g in grads] == storage
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_scale_into_other_tensors_leaves_the_sources():
    sources = [torch.full((4,), 2.0), torch.full((2, 3), -1.0)]
    targets = [torch.zeros(4), torch.zeros(2, 3)]
    multi_tensor_scale(2048 * 32, None, [sources, targets], 0.5)
    assert [t.tolist() for t in targets] == [[1.0] * 4, [[-0.5] * 3] * 2]
    assert sources[0].tolist() == [2.0] * 4


def test_megatron_core_fallbacks_are_replaced(monkeypatch):
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    # this machine has no TE/Apex
    monkeypatch.setattr(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", local_multi_tensor_scale)
    use_foreach_clip_grads()
    assert clip_grads.l2_norm_impl is multi_tensor_l2_norm
    assert clip_grads.multi_tensor_scale_impl is multi_tensor_scale
    norm_kernel, scale_kernel = object(), object()  # Transformer Engine's or Apex's kernels stay
    monkeypatch.setattr(clip_grads, "l2_norm_impl", norm_kernel)
    monkeypatch.setattr(clip_grads, "multi_tensor_scale_impl", scale_kernel)
    use_foreach_clip_grads()
    assert clip_grads.l2_norm_impl is norm_kernel and clip_grads.multi_tensor_scale_impl is scale_kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_the_gpu_it_equals_megatron_cores_fallback_without_waiting():
    from megatron.core.utils import local_multi_tensor_l2_norm

    grads = [torch.randn(shape, device="cuda") for shape in [(1024, 512), (4096,), (8, 8, 8)]]
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # any device-to-host wait raises
    try:
        norm, _ = multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected, _ = local_multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    torch.testing.assert_close(norm, expected, rtol=1e-5, atol=0)


def _twin_parameters():
    generator = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(8, 4), (3,)]]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for p, twin in zip(params, twins):
        p.grad = torch.randn(p.shape, generator=generator)
        twin.grad = p.grad.clone()
    return params, twins


def test_a_fused_adam_takes_the_clip_coefficient_as_its_grad_scale():
    """Scaling in place then stepping (megatron-core's order) and stepping with the kept coefficient agree."""
    from megatron.core.utils import local_multi_tensor_scale

    from bridge_cli.runtime.grad_norm import clip_inside_fused_adam

    scaled, kept = _twin_parameters()
    first = torch.optim.AdamW(scaled, lr=0.1, fused=True)
    second = torch.optim.AdamW(kept, lr=0.1, fused=True)
    clip_inside_fused_adam(second)
    grads = [p.grad for p in scaled]
    local_multi_tensor_scale(2048 * 32, None, [grads, grads], 0.3)
    before = [p.grad.clone() for p in kept]
    grads = [p.grad for p in kept]
    multi_tensor_scale(2048 * 32, None, [grads, grads], 0.3)
    assert all(torch.equal(p.grad, b) for p, b in zip(kept, before))  # kept, not applied yet
    first.step()
    second.step()
    assert second.grad_scale is not None and second.grad_scale.item() == pytest.approx(1 / 0.3)
    for a, b in zip(scaled, kept):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    second.step()  # a step with nothing kept runs without a scale
    assert second.grad_scale is None


@pytest.mark.parametrize("fused", [True, False])
def test_gradients_no_fused_adam_steps_are_scaled_in_place(fused):
    from bridge_cli.runtime.grad_norm import clip_inside_fused_adam

    owned, other = _twin_parameters()
    optimizer = torch.optim.AdamW(owned, lr=0.1, fused=fused)
    clip_inside_fused_adam(optimizer)
    grads = [owned[0].grad, other[0].grad]  # one gradient of the optimizer's, one of no fused Adam's
    expected = [g * 0.5 for g in grads]
    multi_tensor_scale(2048 * 32, None, [grads, grads], 0.5)
    for got, want in zip(grads, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    optimizer.step()
    assert optimizer.grad_scale is None
