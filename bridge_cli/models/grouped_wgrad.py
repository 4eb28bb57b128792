"""Expert weight gradients added into ``main_grad`` inside the grouped GEMM: what
``model.gradient_accumulation_fusion`` does for grouped experts on CUDA.

``torch._grouped_mm`` has no accumulating form: its weight gradient is a bf16 tensor the size of
every expert's weights, which megatron-core's data-parallel wrapper then adds into the fp32
``main_grad`` in a kernel of its own, once per micro-batch. In the MoE proxy that is 4.8B expert
parameters read in bf16, read and written in fp32, per micro-batch. :func:`accumulate` is one Triton
kernel that computes ``main_grad[e] += dy_e^T @ x_e`` for every expert ``e``, accumulating in fp32
registers and adding into ``main_grad`` once per output tile.

:func:`accumulate_op` is the same addition as a custom op that mutates ``main_grad``: a compiled
backward keeps it in its graph (AOTAutograd holds a backward mutation of a forward input), so a compiled
MoE layer stays one graph. Where Triton or CUDA is missing the op adds one accumulating GEMM per expert (the dense linears' own).
"""

from __future__ import annotations

import functools

import torch

from bridge_cli.models.wgrad_accumulation import wgrad_gemm_accum_fp32
from bridge_cli.runtime.triton_support import available as triton_available


def accumulate(grad_output: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, main_grad: torch.Tensor,
               block: tuple = (128, 128, 32, 4, 4)) -> None:
    """``main_grad[e] += grad_output[rows of e]^T @ x[rows of e]`` for every expert ``e``.

    ``grad_output`` [tokens, out] and ``x`` [tokens, in]: rows sorted by expert, expert ``e`` owning
    rows ``ends[e-1]:ends[e]`` (``ends``: int32 cumulative counts on the GPU); ``main_grad``
    [experts, out, in], contiguous, fp32 or bf16. ``block``: (out tile, in tile, token step, warps,
    pipeline stages).
    """
    experts, out_features, in_features = main_grad.shape
    assert grad_output.shape[1] == out_features and x.shape[1] == in_features and main_grad.is_contiguous()
    grad_output, x = grad_output.contiguous(), x.contiguous()
    block_n, block_k, block_m, warps, stages = block
    tiles = _cdiv(out_features, block_n) * _cdiv(in_features, block_k)
    _kernel()[(tiles, experts)](
        grad_output, x, ends, main_grad, out_features, in_features,
        BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_M=block_m, num_warps=warps, num_stages=stages)


@torch.library.custom_op("bridge::accumulate_grouped_wgrad", mutates_args=("main_grad",))
def accumulate_op(grad_output: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, main_grad: torch.Tensor) -> None:
    """:func:`accumulate` where the Triton kernel runs (CUDA), else one GEMM per expert into ``main_grad``."""
    if main_grad.is_cuda and triton_available():
        accumulate(grad_output, x, ends, main_grad)
        return
    start = 0
    for expert, end in enumerate(ends.tolist()):
        wgrad_gemm_accum_fp32(x[start:end], grad_output[start:end], main_grad[expert])
        start = end


@accumulate_op.register_fake
def _(grad_output: torch.Tensor, x: torch.Tensor, ends: torch.Tensor, main_grad: torch.Tensor) -> None:
    return None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@functools.cache
def _kernel():
    """The Triton kernel, compiled on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def grouped_wgrad_accumulate(dy_ptr, x_ptr, ends_ptr, out_ptr, N, K,
                                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr):
        expert = tl.program_id(1)
        tiles_k = tl.cdiv(K, BLOCK_K)
        tile_n, tile_k = tl.program_id(0) // tiles_k, tl.program_id(0) % tiles_k
        start = tl.load(ends_ptr + expert - 1, mask=expert > 0, other=0)
        end = tl.load(ends_ptr + expert)
        if end > start:
            cols_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
            cols_k = tile_k * BLOCK_K + tl.arange(0, BLOCK_K)
            acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
            for row in range(start, end, BLOCK_M):
                rows = row + tl.arange(0, BLOCK_M)
                in_rows = rows < end
                dy = tl.load(dy_ptr + rows[:, None].to(tl.int64) * N + cols_n[None, :],
                             mask=in_rows[:, None] & (cols_n[None, :] < N), other=0.0)
                x = tl.load(x_ptr + rows[:, None].to(tl.int64) * K + cols_k[None, :],
                            mask=in_rows[:, None] & (cols_k[None, :] < K), other=0.0)
                acc = tl.dot(tl.trans(dy), x, acc)
            out = out_ptr + expert.to(tl.int64) * N * K + cols_n[:, None] * K + cols_k[None, :]
            inside = (cols_n[:, None] < N) & (cols_k[None, :] < K)
            acc += tl.load(out, mask=inside).to(tl.float32)
            tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=inside)

    return grouped_wgrad_accumulate
