"""A gradient norm that never waits for the GPU, where megatron-core's fallback waits once per tensor.

Without Transformer Engine or Apex, megatron-core's ``clip_grads`` takes the L2 norm of the
gradients with ``megatron.core.utils.local_multi_tensor_l2_norm``, which norms each gradient on the
GPU and then builds a host tensor from the norms: one device-to-host copy, so one wait, per
gradient (99 a step for llama1b, measured with ``torch.cuda.set_sync_debug_mode``). This norm is
``torch._foreach_norm`` and one more norm over those, all on the device; megatron-core reads the
result once, as it does with Transformer Engine's kernel.
"""

from __future__ import annotations

import torch


def multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``'s contract: ``([1] fp32 norm of all the tensors, None)``."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)))
    return total.reshape(1), None


def use_sync_free_grad_norm() -> None:
    """Make megatron-core's ``clip_grads`` use :func:`multi_tensor_l2_norm` where it would use its own
    fallback (Transformer Engine's or Apex's kernel, when importable, stays)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm

    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = multi_tensor_l2_norm
