"""Row gathers and per-token sums over a buffer whose valid length lives on the GPU.

Under expert parallelism the number of (token, local expert) pairs a rank receives changes from
step to step, and learning it on the host would make the host wait for the GPU. The token
dispatcher (:mod:`bridge_cli.models.moe_dispatch`) therefore sizes its buffers for the largest
possible count and keeps the real count ``n`` on the GPU: grouped GEMMs stop at their last offset,
and the two row operations here touch rows ``< n`` only, so the unused tail costs memory but no
time. On CUDA with Triton they are Triton kernels that read ``n`` from device memory; elsewhere
(the CPU, where reading ``n`` costs nothing) plain torch ops that compute the same values.

Rows past ``n`` of a buffer these functions write are left unwritten on the GPU (zero on the CPU):
nothing downstream reads them.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace
from typing import Optional

import torch

from bridge_cli.runtime.triton_support import available as triton_available


def gather_rows(src: torch.Tensor, index: torch.Tensor, count: Optional[torch.Tensor]) -> torch.Tensor:
    """``out[r] = src[index[r]]`` for ``r < count`` (a 0-d integer tensor; None: every row);
    ``out`` has ``len(index)`` rows."""
    if count is None:
        return src.index_select(0, index)
    return torch.ops.bridge.gather_rows(src.contiguous(), index, count)


def sum_rows(src: torch.Tensor, rows: torch.Tensor, complete: bool = False) -> torch.Tensor:
    """``out[t] = sum(src[rows[t, j]] for j where rows[t, j] >= 0)``, accumulated in fp32, rounded once.
    ``complete``: no entry of ``rows`` is -1."""
    if complete:
        return src.index_select(0, rows.reshape(-1)).view(*rows.shape, src.shape[1]).sum(1)
    return torch.ops.bridge.sum_rows(src.contiguous(), rows.contiguous())


# Custom ops, so that compiled layers call them as they are (dynamo does not trace into Triton's launcher).
@torch.library.custom_op("bridge::gather_rows", mutates_args=())
def _gather_rows(src: torch.Tensor, index: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    if src.is_cuda and triton_available():
        out = torch.empty(index.shape[0], src.shape[1], dtype=src.dtype, device=src.device)
        if index.shape[0]:
            _kernels().gather[(index.shape[0],)](src, index, count, out, src.shape[1], BLOCK=_BLOCK)
        return out
    return torch.where(_valid(index.shape[0], count, src.device).unsqueeze(-1), src.index_select(0, index), 0)


@_gather_rows.register_fake
def _(src, index, count):
    return src.new_empty(index.shape[0], src.shape[1])


@torch.library.custom_op("bridge::sum_rows", mutates_args=())
def _sum_rows(src: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    if src.is_cuda and triton_available():
        out = torch.empty(rows.shape[0], src.shape[1], dtype=src.dtype, device=src.device)
        if rows.shape[0]:
            _kernels().sum[(rows.shape[0],)](src, rows, out, src.shape[1], SLOTS=rows.shape[1], BLOCK=_BLOCK)
        return out
    padded = torch.cat([src, src.new_zeros(1, src.shape[1])])  # row -1 reads this zero row
    flat = torch.where(rows >= 0, rows, src.shape[0]).reshape(-1)
    return padded.index_select(0, flat).view(*rows.shape, src.shape[1]).float().sum(1).to(src.dtype)


@_sum_rows.register_fake
def _(src, rows):
    return src.new_empty(rows.shape[0], src.shape[1])


def mask_rows(x: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``x`` with every entry of row ``>= count`` zero (``x`` is 1-D or 2-D)."""
    valid = _valid(x.shape[0], count, x.device)
    return torch.where(valid if x.dim() == 1 else valid.unsqueeze(-1), x, 0)


def _valid(length: int, count: torch.Tensor, device) -> torch.Tensor:
    return torch.arange(length, device=device) < count


class GatherRows(torch.autograd.Function):
    """:func:`gather_rows` of the tokens; the gradient of a token sums its rows' gradients (:func:`sum_rows`)."""

    @staticmethod
    def forward(ctx, src, index, count, rows_of_src):
        ctx.save_for_backward(rows_of_src)
        ctx.complete = count is None
        return gather_rows(src, index, count)

    @staticmethod
    def backward(ctx, grad):
        (rows_of_src,) = ctx.saved_tensors
        return sum_rows(grad, rows_of_src, ctx.complete), None, None, None


class MaskGradient(torch.autograd.Function):
    """The identity, whose gradient is zero in rows ``>= count`` (rows nothing real flowed through)."""

    @staticmethod
    def forward(ctx, x, count):
        ctx.save_for_backward(count)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        (count,) = ctx.saved_tensors
        return mask_rows(grad, count), None


class SumRows(torch.autograd.Function):
    """:func:`sum_rows` of the expert outputs; the gradient of a row is its token's gradient (:func:`gather_rows`)."""

    @staticmethod
    def forward(ctx, src, rows, index, count):
        ctx.save_for_backward(index, count)
        return sum_rows(src, rows, count is None)

    @staticmethod
    def backward(ctx, grad):
        index, count = ctx.saved_tensors
        return gather_rows(grad, index, count), None, None, None


_BLOCK = 1024
"""Columns a Triton program moves at a time."""


@functools.cache
def _kernels():
    """The two Triton kernels, compiled on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def gather(src_ptr, index_ptr, count_ptr, out_ptr, width, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        if row < tl.load(count_ptr):
            source = tl.load(index_ptr + row).to(tl.int64)
            for start in range(0, width, BLOCK):
                cols = start + tl.arange(0, BLOCK)
                values = tl.load(src_ptr + source * width + cols, mask=cols < width)
                tl.store(out_ptr + row.to(tl.int64) * width + cols, values, mask=cols < width)

    @triton.jit
    def total(src_ptr, rows_ptr, out_ptr, width, SLOTS: tl.constexpr, BLOCK: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        for start in range(0, width, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            for slot in tl.static_range(SLOTS):
                row = tl.load(rows_ptr + token * SLOTS + slot).to(tl.int64)
                values = tl.load(src_ptr + row * width + cols, mask=(cols < width) & (row >= 0), other=0.0)
                acc += values.to(tl.float32)
            tl.store(out_ptr + token * width + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < width)

    return SimpleNamespace(gather=gather, sum=total)
