"""megatron-core's gradient clipping without its per-tensor fallbacks: a norm that never waits for the
GPU, and a clip that scales the gradients in place.

Without Transformer Engine or Apex, megatron-core's ``clip_grads`` takes the L2 norm of the
gradients with ``megatron.core.utils.local_multi_tensor_l2_norm``, which norms each gradient on the
GPU and then builds a host tensor from the norms: one device-to-host copy, so one wait, per
gradient (99 a step for llama1b, measured with ``torch.cuda.set_sync_debug_mode``). This norm is
``torch._foreach_norm`` and one more norm over those, all on the device; megatron-core reads the
result once, as it does with Transformer Engine's kernel.

When the norm is above ``optimizer.clip_grad``, its fallback scale ``local_multi_tensor_scale`` writes
``grad * coefficient`` to a new tensor and copies it back, gradient by gradient: two passes over every
fp32 gradient and a temporary the size of the largest. Here it is one in-place ``torch._foreach_mul_``
(a 4-layer proxy on one H100: 2.8 -> 2.3 ms of kernels a step), or no pass at all where the gradients belong
to an Adam that scales them as it reads them (:func:`clip_inside_adam`): torch's fused kernel takes the kept
coefficient as its ``grad_scale``, bridge's Triton Adam (:mod:`~bridge_cli.runtime.triton_adam`) as a factor of
its own.
"""

from __future__ import annotations

import weakref
from typing import Callable, Optional

import torch

_SCALING_ADAMS: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Callable[[torch.optim.Optimizer], bool]]" = (
    weakref.WeakKeyDictionary())
"""torch Adams whose step can apply a kept clip coefficient -> whether it can now (:func:`clip_inside_adam`)."""
_KEPT: dict[int, float] = {}
"""A gradient's storage address -> the clip coefficient megatron-core asked for, until its Adam steps."""


def multi_tensor_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``'s contract: ``([1] fp32 norm of all the tensors, None)``."""
    tensors = [t for tensor_list in tensor_lists for t in tensor_list]
    total = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(tensors, 2, dtype=torch.float32)))
    return total.reshape(1), None


def multi_tensor_scale(chunk_size, noop_flag, tensor_lists, scale):
    """``amp_C.multi_tensor_scale``'s contract (each target = its source times ``scale``), in place when
    sources and targets are one list, as megatron-core's clipping passes them."""
    sources, targets = tensor_lists
    if sources is not targets:
        torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))
        return
    targets = [t for t in targets if t.numel()]
    owned = _scaling_adam_grads()
    if owned and all(t.data_ptr() in owned for t in targets):
        _KEPT.update((t.data_ptr(), scale) for t in targets)
    else:
        torch._foreach_mul_(targets, scale)


def clip_inside_fused_adam(optimizer: torch.optim.Optimizer) -> None:
    """Let ``optimizer`` (a torch Adam/AdamW) take the clip coefficient of its gradients as its fused kernel's
    ``grad_scale`` instead of :func:`multi_tensor_scale` scaling them first. While it is not fused (a
    foreach Adam takes no ``grad_scale``), its gradients are scaled in place as before. Call once per optimizer."""
    if optimizer not in _SCALING_ADAMS:
        optimizer.register_step_pre_hook(_apply_kept_coefficient)
    clip_inside_adam(optimizer, _is_fused)


def clip_inside_adam(optimizer: torch.optim.Optimizer, scales: Callable[[torch.optim.Optimizer], bool]) -> None:
    """Keep the clip coefficient of ``optimizer``'s gradients for its step to apply (:func:`pop_kept_coefficients`)
    while ``scales(optimizer)`` says it does, instead of scaling them in place first."""
    _SCALING_ADAMS[optimizer] = scales


def pop_kept_coefficients(grads: list[torch.Tensor]) -> list[Optional[float]]:
    """The clip coefficient kept for each of ``grads`` (None: none kept), forgotten once read."""
    return [_KEPT.pop(g.data_ptr(), None) for g in grads]


def _is_fused(optimizer: torch.optim.Optimizer) -> bool:
    return all(group.get("fused") for group in optimizer.param_groups)


def _grads(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The gradients ``optimizer`` steps with, as megatron-core's clip scales them: under FSDP2 each DTensor's local
    shard (the DTensor itself has no storage address to keep a coefficient by)."""
    from bridge_cli.runtime.fsdp import local_shard

    grads = (local_shard(p.grad) for group in optimizer.param_groups for p in group["params"] if p.grad is not None)
    return [g for g in grads if g.numel()]


def _scaling_adam_grads() -> set[int]:
    return {g.data_ptr() for optimizer, scales in list(_SCALING_ADAMS.items()) if scales(optimizer)
            for g in _grads(optimizer)}


def _apply_kept_coefficient(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    """Before the step: one kept coefficient for all the gradients becomes ``grad_scale`` (1 / coefficient);
    anything else kept (some gradients only, or several coefficients) is applied in place now."""
    grads = _grads(optimizer)
    kept = pop_kept_coefficients(grads)
    optimizer.grad_scale = None
    if all(k is None for k in kept):
        return
    if len(set(kept)) == 1 and _is_fused(optimizer):
        optimizer.grad_scale = torch.full((), 1.0 / kept[0], dtype=torch.float32, device=grads[0].device)
        return
    for grad, coefficient in zip(grads, kept):
        if coefficient is not None:
            grad.mul_(coefficient)


def use_foreach_clip_grads() -> None:
    """Make megatron-core's ``clip_grads`` use :func:`multi_tensor_l2_norm` and :func:`multi_tensor_scale`
    where it would use its own fallbacks (Transformer Engine's or Apex's kernels, when importable, stay)."""
    from megatron.core.optimizer import clip_grads
    from megatron.core.utils import local_multi_tensor_l2_norm, local_multi_tensor_scale

    if clip_grads.l2_norm_impl is local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = multi_tensor_l2_norm
    if clip_grads.multi_tensor_scale_impl is local_multi_tensor_scale:
        clip_grads.multi_tensor_scale_impl = multi_tensor_scale
