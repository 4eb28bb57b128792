"""The routed experts' SwiGLU times their routing probabilities, over the rows below a count.

:class:`~bridge_cli.models.moe_experts.GroupedGemmExperts` computes ``silu(gate) * up * prob`` for every row of the
token dispatcher's buffer. Where a rank holds only some of the experts (or a capacity factor drops pairs) that
buffer has room for the most pairs the rank can receive (:func:`~bridge_cli.models.dispatch_room.room`: at EP=4
without a capacity, 4x the expected rows), and compiled layers ran this elementwise work, forward and backward,
over the whole buffer: on ``moe_proxy`` at EP=4 three fused kernels took 54 ms of a 560 ms step (4 x H200), most
of them on rows nothing reads. Here one Triton kernel each way reads the count from device memory and stops there,
as the row gathers of :mod:`bridge_cli.models.moe_rows` do; elsewhere (the CPU) plain torch ops compute the same
values. Both compute in fp32 and round once, as inductor's fused kernel does.

Rows at or past the count are left unwritten on the GPU (zero on the CPU); the probabilities' gradient is zero
there. Nothing downstream reads them: the grouped GEMMs stop at their last offset, the row sums skip the tail.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from bridge_cli.models.moe_rows import mask_rows
from bridge_cli.runtime.triton_support import available as triton_available


def applies(config) -> bool:
    """Whether :func:`swiglu_probs` computes the experts' activation of ``config``: SwiGLU with megatron-core's plain
    ``silu`` gate (no clamp, no offset on the linear half)."""
    return (config.gated_linear_unit and config.activation_func is F.silu
            and config.activation_func_clamp_value is None and not config.glu_linear_offset)


def swiglu_probs(x: torch.Tensor, probs: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up * probs`` of the rows of ``x`` (``[rows, 2 * ffn]``, gate first) below ``count`` (a 0-d
    integer tensor on ``x``'s device); ``[rows, ffn]`` in ``x``'s dtype."""
    return _SwigluProbs.apply(x, probs, count)


class _SwigluProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, probs, count):
        x, probs = x.contiguous(), probs.contiguous()  # as the kernels read them, saved so for the backward
        ctx.save_for_backward(x, probs, count)
        return torch.ops.bridge.swiglu_probs(x, probs, count)

    @staticmethod
    def backward(ctx, grad):
        x, probs, count = ctx.saved_tensors
        grad_x, grad_probs = torch.ops.bridge.swiglu_probs_backward(grad.contiguous(), x, probs, count)
        return grad_x, grad_probs, None


# Custom ops, so that compiled layers call them as they are (dynamo does not trace into Triton's launcher).
@torch.library.custom_op("bridge::swiglu_probs", mutates_args=())
def _forward(x: torch.Tensor, probs: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    rows, ffn = x.shape[0], x.shape[1] // 2
    if x.is_cuda and triton_available():
        out = torch.empty(rows, ffn, dtype=x.dtype, device=x.device)
        if rows:
            _kernels().forward[(rows,)](x, probs, count, out, ffn, BLOCK=_block(ffn))
        return out
    gate, up = _wide(x).chunk(2, dim=-1)
    return mask_rows(F.silu(gate) * up * _wide(probs).unsqueeze(-1), count).to(x.dtype)


@_forward.register_fake
def _(x, probs, count):
    return x.new_empty(x.shape[0], x.shape[1] // 2)


@torch.library.custom_op("bridge::swiglu_probs_backward", mutates_args=())
def _backward(grad: torch.Tensor, x: torch.Tensor, probs: torch.Tensor,
              count: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, ffn = x.shape[0], x.shape[1] // 2
    if x.is_cuda and triton_available():
        grad_x = torch.empty_like(x)
        grad_probs = torch.empty_like(probs)
        if rows:
            _kernels().backward[(rows,)](grad, x, probs, count, grad_x, grad_probs, ffn, BLOCK=_block(ffn))
        return grad_x, grad_probs
    gate, up = _wide(x).chunk(2, dim=-1)
    dy, p = _wide(grad), _wide(probs).unsqueeze(-1)
    sigmoid = torch.sigmoid(gate)
    silu = gate * sigmoid
    grad_gate = dy * p * up * (sigmoid * (1 + gate * (1 - sigmoid)))
    grad_up = dy * p * silu
    grad_x = mask_rows(torch.cat([grad_gate, grad_up], dim=-1), count).to(x.dtype)
    return grad_x, mask_rows((dy * (silu * up)).sum(-1), count).to(probs.dtype)


@_backward.register_fake
def _(grad, x, probs, count):
    return torch.empty_like(x), torch.empty_like(probs)


def _wide(t: torch.Tensor) -> torch.Tensor:
    """``t`` in fp32, or fp64 where it is (the CPU's math in the kernels' precision at least)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _block(ffn: int) -> int:
    """Columns a Triton program moves at a time: the power of two at or above ``ffn``, at most 1024."""
    return min(1024, 1 << max(ffn - 1, 0).bit_length())


@functools.cache
def _kernels():
    """The two Triton kernels, compiled on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def forward(x_ptr, p_ptr, count_ptr, out_ptr, ffn, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        if row < tl.load(count_ptr):
            p = tl.load(p_ptr + row).to(tl.float32)
            x_row = x_ptr + row.to(tl.int64) * 2 * ffn
            out_row = out_ptr + row.to(tl.int64) * ffn
            for start in range(0, ffn, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < ffn
                gate = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
                up = tl.load(x_row + ffn + cols, mask=inside, other=0.0).to(tl.float32)
                y = gate * tl.sigmoid(gate) * up * p
                tl.store(out_row + cols, y.to(out_ptr.dtype.element_ty), mask=inside)

    @triton.jit
    def backward(dy_ptr, x_ptr, p_ptr, count_ptr, dx_ptr, dp_ptr, ffn, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        acc = tl.zeros([BLOCK], dtype=tl.float32)  # the probability's gradient, column by column (zero past the count)
        if row < tl.load(count_ptr):
            p = tl.load(p_ptr + row).to(tl.float32)
            x_row = x_ptr + row.to(tl.int64) * 2 * ffn
            dx_row = dx_ptr + row.to(tl.int64) * 2 * ffn
            dy_row = dy_ptr + row.to(tl.int64) * ffn
            for start in range(0, ffn, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                inside = cols < ffn
                dy = tl.load(dy_row + cols, mask=inside, other=0.0).to(tl.float32)
                gate = tl.load(x_row + cols, mask=inside, other=0.0).to(tl.float32)
                up = tl.load(x_row + ffn + cols, mask=inside, other=0.0).to(tl.float32)
                sigmoid = tl.sigmoid(gate)
                silu = gate * sigmoid
                grad_gate = dy * p * up * (sigmoid * (1 + gate * (1 - sigmoid)))
                grad_up = dy * p * silu
                tl.store(dx_row + cols, grad_gate.to(dx_ptr.dtype.element_ty), mask=inside)
                tl.store(dx_row + ffn + cols, grad_up.to(dx_ptr.dtype.element_ty), mask=inside)
                acc += dy * (silu * up)
        tl.store(dp_ptr + row, tl.sum(acc, axis=0).to(dp_ptr.dtype.element_ty))

    return SimpleNamespace(forward=forward, backward=backward)
