"""The sync-free gradient norm bridge gives megatron-core's clip_grads in place of its per-tensor fallback."""

from __future__ import annotations

import pytest
import torch

from bridge_cli.runtime.grad_norm import multi_tensor_l2_norm, use_sync_free_grad_norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norm_of_all_the_tensors_in_fp32(dtype):
    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator).to(dtype) for shape in [(64, 32), (7,), (3, 5, 2)]]
    norm, per_tensor = multi_tensor_l2_norm(2048 * 32, None, [grads], False)
    expected = torch.linalg.vector_norm(torch.cat([g.float().flatten() for g in grads]))
    assert norm.shape == (1,) and norm.dtype == torch.float32 and per_tensor is None
    torch.testing.assert_close(norm[0], expected, rtol=1e-6, atol=0)


def test_megatron_core_fallback_is_replaced(monkeypatch):
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    monkeypatch.setattr(clip_grads, "l2_norm_impl", local_multi_tensor_l2_norm)  # this machine has no TE/Apex
    use_sync_free_grad_norm()
    assert clip_grads.l2_norm_impl is multi_tensor_l2_norm
    kernel = object()  # Transformer Engine's or Apex's kernel stays
    monkeypatch.setattr(clip_grads, "l2_norm_impl", kernel)
    use_sync_free_grad_norm()
    assert clip_grads.l2_norm_impl is kernel


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
