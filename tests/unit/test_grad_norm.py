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
