"""``optimizer.adam_kernel=triton``: torch's Adam step as one Triton kernel per weight that also writes the
weight's bf16 model copy.

Without Transformer Engine or Apex, megatron-core steps its fp32 main weights with torch's Adam, then copies
every main weight into its bf16 model weight (``_copy_main_params_to_model_params``): a second pass over all
the weights. torch's fused kernel also writes every gradient back when it applies the clip coefficient as its
``grad_scale``. Here each weight's kernel reads the weight, its gradient and both moments once and writes the
weight, the moments and the model weight: the 1.5B proxy's 1.5e9 weights step in 15.4 ms on one H100, where
torch's fused Adam and megatron-core's copy take 21.7 (docs/performance.md).

The optimizer stays torch's Adam/AdamW object: its param groups, state (``step``, ``exp_avg``, ``exp_avg_sq``)
and state dict are torch's, so checkpoints do not depend on the kernel; only its ``step`` is this module's,
with torch's update (decoupled or L2 weight decay, bias-corrected moments). The model weights it writes are the
ones megatron-core's copy writes (its ``_get_model_and_main_params_data_float16`` pairs), so that copy, which
follows the step, has nothing left to do and is skipped. On the CPU, or where Triton does not import, the same
update runs as torch ops. Under torch FSDP2 the weights, gradients and moments are DTensors: the kernel steps each
one's local shard (:func:`~bridge_cli.runtime.fsdp.local_shard`), and the state keeps the DTensors checkpoints save.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Iterator, Optional

import torch

from bridge_cli.runtime import optimizer_chain
from bridge_cli.runtime.fsdp import local_shard
from bridge_cli.runtime.grad_norm import clip_inside_adam, pop_kept_coefficients
from bridge_cli.runtime.triton_support import available as triton_available

BLOCK = 2048
WARPS = 8


def use_triton_adam(optimizer) -> None:
    """Step each torch Adam/AdamW inside megatron-core's ``optimizer`` with :class:`TritonAdamStep`, writing the
    model weights megatron-core would copy. Call after building it and again after loading its state."""
    for member, inner in torch_adams(optimizer):
        model_weights = _model_weights(member)
        set_torch_kernel(inner, fused=False)  # the step counter stays on the host (torch's default)
        for state in inner.state.values():
            if "step" in state:  # one host counter each (megatron-core's load hands every state one tensor)
                state["step"] = torch.tensor(float(state["step"]), dtype=torch.float32)
        inner.step = TritonAdamStep(inner, model_weights)
        clip_inside_adam(inner, lambda _: True)
        if model_weights:
            member._copy_main_params_to_model_params = _CopyUnlessStepped(
                member._copy_main_params_to_model_params, inner.step)


def torch_adams(optimizer) -> Iterator[tuple[Any, torch.optim.Adam]]:
    """Each member of megatron-core's ``optimizer`` that steps a torch Adam/AdamW, with that Adam (Transformer
    Engine's and Apex's FusedAdam are no torch Adam)."""
    for member in optimizer_chain.members(optimizer):
        inner = getattr(member, "optimizer", None)
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            yield member, inner


def set_torch_kernel(adam: torch.optim.Adam, fused: bool) -> None:
    """Choose torch's fused kernel (``fused``) or its per-tensor one for ``adam``'s own step, now and for groups
    added later."""
    for group in (adam.defaults, *adam.param_groups):
        group["fused"], group["foreach"] = fused, False


def _model_weights(member) -> dict[int, torch.Tensor]:
    """Main weight's storage address -> the model weight megatron-core copies it into after each step."""
    pairs = getattr(member, "_get_model_and_main_params_data_float16", None)
    if pairs is None:  # an fp32 run: the main weights are the model's
        return {}
    model, main = pairs()
    return {local_shard(m).data_ptr(): local_shard(w) for w, m in zip(model, main) if m is not None}


class TritonAdamStep:
    """A torch Adam's ``step`` (no closure, no AMSGrad or maximize), one kernel per weight."""

    def __init__(self, optimizer: torch.optim.Adam, model_weights: dict[int, torch.Tensor]):
        for group in optimizer.param_groups:
            if group.get("amsgrad") or group.get("maximize") or group.get("differentiable"):
                raise ValueError("bridge's Triton Adam steps without amsgrad, maximize or differentiable")
        self.optimizer = optimizer
        self.model_weights = model_weights
        self.stepped = False  # set by a step, cleared by the copy it makes unnecessary

    @torch.no_grad()
    def __call__(self, closure=None) -> None:
        if closure is not None:
            raise ValueError("bridge's Triton Adam takes no closure")
        for group in self.optimizer.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            grads = [local_shard(p.grad) for p in params]
            decoupled = group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
            for param, grad, coefficient in zip(params, grads, pop_kept_coefficients(grads)):
                state = self.optimizer.state[param]
                if not state:  # like the weight: under FSDP2 DTensors, as torch's Adam makes them and checkpoints save
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                state["step"] += 1
                weight = local_shard(param)  # the update is elementwise: each shard steps on its own
                adam_update(weight, grad, local_shard(state["exp_avg"]), local_shard(state["exp_avg_sq"]),
                            self.model_weights.get(weight.data_ptr()), step=int(state["step"].item()),
                            lr=_number(group["lr"]), betas=group["betas"], eps=group["eps"],
                            weight_decay=group["weight_decay"], decoupled=decoupled,
                            grad_factor=1.0 if coefficient is None else coefficient)
        self.stepped = True


class _CopyUnlessStepped:
    """megatron-core's main-to-model copy, skipped once after each step that wrote the model weights itself."""

    def __init__(self, copy, step: TritonAdamStep):
        self.copy = copy.copy if isinstance(copy, _CopyUnlessStepped) else copy  # installed again after a load
        self.step = step

    def __call__(self) -> None:
        if not self.step.stepped:
            self.copy()
        self.step.stepped = False


def adam_update(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor,
                model_weight: Optional[torch.Tensor], *, step: int, lr: float, betas: tuple[float, float], eps: float,
                weight_decay: float, decoupled: bool, grad_factor: float = 1.0) -> None:
    """torch's Adam update of ``param`` and its moments in place, from ``grad`` times ``grad_factor`` (the
    clip coefficient), at ``step`` (1 for the first); then ``model_weight``, if given, = ``param`` in its dtype.
    In fp32, whatever the tensors' dtypes."""
    beta1, beta2 = betas
    step_size, bias_correction2_sqrt = lr / (1 - beta1 ** step), math.sqrt(1 - beta2 ** step)
    if _runs_triton(param, grad, exp_avg, exp_avg_sq, model_weight):
        n = param.numel()
        if not n:  # a weight with no elements on this rank: no programs to launch
            return
        _kernel()[(-(-n // BLOCK),)](
            param, grad, exp_avg, exp_avg_sq, param if model_weight is None else model_weight, n,
            grad_factor, beta1, beta2, eps, weight_decay, 1 - lr * weight_decay, step_size, bias_correction2_sqrt,
            DECOUPLED=decoupled, WRITE_MODEL=model_weight is not None, BLOCK=BLOCK, num_warps=WARPS)
        return
    p, g = param.float(), grad.float() * grad_factor
    m, v = exp_avg.float(), exp_avg_sq.float()
    if decoupled:
        p = p * (1 - lr * weight_decay)
    elif weight_decay:
        g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    p = p - step_size * m / (v.sqrt() / bias_correction2_sqrt + eps)
    for tensor, value in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
        tensor.copy_(value)
    if model_weight is not None:
        model_weight.copy_(p.view_as(model_weight))


def _number(value) -> float:
    return value.item() if isinstance(value, torch.Tensor) else value


def _runs_triton(*tensors: Optional[torch.Tensor]) -> bool:
    present = [t for t in tensors if t is not None]
    return all(t.is_cuda and t.is_contiguous() for t in present) and triton_available()


@functools.cache
def _kernel():
    """The Triton kernel, compiled on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def adam(p_ptr, g_ptr, m_ptr, v_ptr, out_ptr, n, grad_factor, beta1, beta2, eps, weight_decay, decay,
             step_size, bias_correction2_sqrt, DECOUPLED: tl.constexpr, WRITE_MODEL: tl.constexpr,
             BLOCK: tl.constexpr):
        """BLOCK elements of one weight: its Adam update, then its model copy."""
        offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offsets < n
        p = tl.load(p_ptr + offsets, mask=mask).to(tl.float32)
        g = tl.load(g_ptr + offsets, mask=mask).to(tl.float32) * grad_factor
        m = tl.load(m_ptr + offsets, mask=mask).to(tl.float32)
        v = tl.load(v_ptr + offsets, mask=mask).to(tl.float32)
        if DECOUPLED:
            p = p * decay
        else:
            g = g + weight_decay * p
        m = beta1 * m + (1 - beta1) * g
        v = beta2 * v + (1 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bias_correction2_sqrt + eps)
        tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)
        tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
        tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)
        if WRITE_MODEL:
            tl.store(out_ptr + offsets, p.to(out_ptr.dtype.element_ty), mask=mask)

    return adam
