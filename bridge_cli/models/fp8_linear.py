"""FP8 GEMMs without Transformer Engine: megatron-core's tensor-parallel linear layers whose matrix
multiplies run as ``torch._scaled_mm`` (NVIDIA sm89 and newer: Ada, Hopper, Blackwell).

Scaling is dynamic ("current scaling"): each GEMM casts its two operands with scales taken from
their own absolute maximum in that call, so there is no amax history to keep or checkpoint.

``tensorwise``  one scale per tensor. Forward operands in e4m3; the output gradient in e5m2 with
                ``model.fp8=hybrid``, e4m3 with ``model.fp8=e4m3``. The forward's fp8 input is what
                the backward keeps (half the activation memory of bf16).
``rowwise``     one scale per row of each operand along the GEMM's reduction dimension, rounded
                down to a power of two; every operand in e4m3 (as torchao's rowwise recipe). More
                accurate for outliers; the backward re-casts along the other dimension, so it keeps
                the bf16 input.

Only the GEMM inputs are fp8: parameters stay in their dtype (bf16, fp32 main copies in the
optimizer) and so do the checkpoints, which load into a bf16 run unchanged and back. The
tensor-parallel communication is megatron-core's own (its copy/gather mappings around the GEMM).
A linear layer whose partition has a dimension that is not a multiple of 16 (what the FP8 GEMM
needs) stays in bf16, as do MoE routers and experts, which megatron-core builds outside these
layers, and the output layer unless ``model.fp8_output_layer`` is set.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
from megatron.core.tensor_parallel.mappings import (
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)

RECIPES = ("tensorwise", "rowwise")
GEMM_MULTIPLE = 16
"""torch._scaled_mm needs both dimensions of its second operand, and the first's inner one, to be multiples of 16."""


@dataclass(frozen=True)
class Fp8Scaling:
    """How one layer casts its GEMM operands: ``model.fp8``, ``model.fp8_recipe``, ``model.fp8_wgrad``."""

    recipe: str
    grad_dtype: torch.dtype
    wgrad: bool = True
    """Run the weight-gradient GEMM in fp8 too (false: in the input's dtype, from the kept input)."""

    @classmethod
    def from_config(cls, config) -> "Fp8Scaling":
        grad_dtype = torch.float8_e5m2 if config.fp8 == "hybrid" else torch.float8_e4m3fn
        return cls(recipe=config.fp8_recipe, grad_dtype=grad_dtype, wgrad=config.fp8_wgrad)

    @property
    def rowwise(self) -> bool:
        return self.recipe == "rowwise"


def quantize(t: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``t`` cast to ``dtype`` and the scale that multiplies it back: one per tensor, or one per row
    (a power of two) when ``rowwise``."""
    if t.is_cuda and not torch.compiler.is_compiling():
        return _compiled_quantize()(t, dtype, rowwise)
    return _quantize(t, dtype, rowwise)


def _quantize(t: torch.Tensor, dtype: torch.dtype, rowwise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    largest = torch.finfo(dtype).max
    amax = (t.abs().amax(dim=-1, keepdim=True) if rowwise else t.abs().amax()).float()
    scale = largest / amax.clamp(min=1e-12)
    if rowwise:
        scale = torch.exp2(torch.floor(torch.log2(scale)))
    return (t.float() * scale).clamp(-largest, largest).to(dtype), scale.reciprocal()


@functools.cache
def _compiled_quantize():
    """:func:`_quantize` as one fused kernel pair (amax, then scale-and-cast) for any shape."""
    return torch.compile(_quantize, dynamic=True)


def _pad_rows(t: torch.Tensor) -> torch.Tensor:
    """``t`` with zero rows appended up to a multiple of 16 (the rows a GEMM reduces over)."""
    missing = -t.shape[0] % GEMM_MULTIPLE
    if not missing:
        return t
    if t.element_size() == 1:  # fp8 has no pad kernel; its zero is the zero byte
        return torch.nn.functional.pad(t.view(torch.uint8), (0, 0, 0, missing)).view(t.dtype)
    return torch.nn.functional.pad(t, (0, 0, 0, missing))


def _gemm(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
          out_dtype: torch.dtype) -> torch.Tensor:
    """``a @ b`` for ``a`` [m, k] row-major and ``b`` [k, n] column-major, both fp8, with their scales."""
    return torch._scaled_mm(a, b, scale_a=a_scale, scale_b=b_scale, out_dtype=out_dtype)


class _Fp8Matmul(torch.autograd.Function):
    """``x @ weight.t()`` with FP8 GEMMs in forward and backward; ``x`` is [tokens, in]."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, scaling: Fp8Scaling) -> torch.Tensor:
        rowwise = scaling.rowwise
        x8, x_scale = quantize(x, torch.float8_e4m3fn, rowwise)
        w8, w_scale = quantize(weight, torch.float8_e4m3fn, rowwise)
        y = _gemm(x8, x_scale, w8.t(), w_scale.t() if rowwise else w_scale, x.dtype)
        ctx.scaling = scaling
        if rowwise or not scaling.wgrad:
            ctx.save_for_backward(x, weight, None, None)
        else:  # tensorwise: both backward GEMMs reuse the forward's fp8 operands
            ctx.save_for_backward(x8, w8, x_scale, w_scale)
        return y

    @staticmethod
    def backward(ctx, grad_y: torch.Tensor):
        scaling: Fp8Scaling = ctx.scaling
        x, weight, x_scale, w_scale = ctx.saved_tensors
        grad_y = grad_y.contiguous()
        out_dtype = grad_y.dtype
        need_x, need_w = ctx.needs_input_grad[:2]
        grad_x = grad_w = None
        if scaling.rowwise:
            if need_x:  # [t, out] @ [out, in]: reduce over out
                g8, g_scale = quantize(grad_y, torch.float8_e4m3fn, True)
                wt8, wt_scale = quantize(weight.t().contiguous(), torch.float8_e4m3fn, True)
                grad_x = _gemm(g8, g_scale, wt8.t(), wt_scale.t(), out_dtype)
            if need_w and scaling.wgrad:  # [out, t] @ [t, in]: reduce over tokens
                gt8, gt_scale = quantize(_pad_rows(grad_y).t().contiguous(), torch.float8_e4m3fn, True)
                xt8, xt_scale = quantize(_pad_rows(x).t().contiguous(), torch.float8_e4m3fn, True)
                grad_w = _gemm(gt8, gt_scale, xt8.t(), xt_scale.t(), out_dtype)
        else:
            g8, g_scale = quantize(grad_y, scaling.grad_dtype, False)
            w8 = weight
            if x_scale is None:  # the bf16 operands were kept (model.fp8_wgrad=false)
                w8, w_scale = quantize(weight, torch.float8_e4m3fn, False)
            if need_x:  # [t, out] @ [out, in]
                grad_x = _gemm(g8, g_scale, w8.t().contiguous().t(), w_scale, out_dtype)
            if need_w and scaling.wgrad:  # [out, t] @ [t, in]
                grad_w = _gemm(_pad_rows(g8).t().contiguous(), g_scale,
                               _pad_rows(x).t().contiguous().t(), x_scale, out_dtype)
        if need_w and not scaling.wgrad:
            grad_w = grad_y.t() @ x
        return grad_x, grad_w, None


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], scaling: Fp8Scaling) -> torch.Tensor:
    """``x @ weight.t() + bias`` for ``x`` of any leading shape, the GEMMs in fp8."""
    y = _Fp8Matmul.apply(x.reshape(-1, x.shape[-1]), weight, scaling).view(*x.shape[:-1], weight.shape[0])
    return y + bias if bias is not None else y


class _Fp8Gemm:
    """Mixin for megatron-core's parallel linears: the GEMM in fp8, megatron-core's TP mappings around it."""

    bf16_class: type
    """The megatron-core linear this one becomes where it runs in bf16 (:func:`run_in_bf16`)."""

    def __init__(self, *args, fp8: Fp8Scaling, **kwargs):
        super().__init__(*args, **kwargs)
        self.fp8: Optional[Fp8Scaling] = fp8
        """None: a linear built for fp8 that runs in bf16 (then of megatron-core's own class)."""
        if not _fits_fp8(self.weight):
            run_in_bf16(self)

    def _forward_impl(self, input, weight, bias=None, allreduce_dgrad=False, sequence_parallel=False, tp_group=None,
                      **rest):
        if sequence_parallel:  # forward all-gather of the sequence, backward reduce-scatter
            input = gather_from_sequence_parallel_region(input, group=tp_group)
        elif allreduce_dgrad:  # forward identity, backward all-reduce of the input gradient
            input = copy_to_tensor_model_parallel_region(input, group=tp_group)
        return fp8_linear(input, weight, bias, self.fp8)


class Fp8ColumnParallelLinear(_Fp8Gemm, ColumnParallelLinear):
    """megatron-core's ColumnParallelLinear with an FP8 GEMM (same parameters and state-dict keys)."""

    bf16_class = ColumnParallelLinear


class Fp8RowParallelLinear(_Fp8Gemm, RowParallelLinear):
    """megatron-core's RowParallelLinear with an FP8 GEMM (same parameters and state-dict keys)."""

    bf16_class = RowParallelLinear


def _fits_fp8(weight: Optional[torch.Tensor]) -> bool:
    return weight is not None and all(d % GEMM_MULTIPLE == 0 for d in weight.shape)


def run_in_bf16(linear: _Fp8Gemm) -> None:
    """Turn an FP8 linear back into megatron-core's own (same module and parameters), marked ``fp8 = None``.
    As megatron-core's class it takes every path a bf16 linear takes: ``model.gradient_accumulation_fusion``'s
    in-graph accumulation, which keeps a compiled layer one graph (megatron-core's linear breaks it)."""
    linear.fp8 = None
    linear.__class__ = linear.bf16_class


def keep_layers_in_bf16(model: torch.nn.Module, config) -> int:
    """Switch the FP8 linears of the layers ``model.first_last_layers_bf16`` names back to bf16; how many."""
    from megatron.core.fp8_utils import is_first_last_bf16_layer
    from megatron.core.transformer.transformer_layer import TransformerLayer

    switched = 0
    for layer in model.modules():
        if isinstance(layer, TransformerLayer) and is_first_last_bf16_layer(config, layer.layer_number - 1):
            for module in layer.modules():
                if isinstance(module, _Fp8Gemm):
                    run_in_bf16(module)
                    switched += 1
    return switched


def output_layer_in_fp8(model: torch.nn.Module, config) -> None:
    """Run ``model``'s output layer (megatron-core's ColumnParallelLinear, given the embedding's weight
    when the two are tied) as an FP8 GEMM: ``model.fp8_output_layer``."""
    layer = model.output_layer
    weight = layer.weight if layer.weight is not None else model.shared_embedding_or_output_weight()
    layer.fp8 = Fp8Scaling.from_config(config) if _fits_fp8(weight) else None
    if layer.fp8 is not None:
        layer.__class__ = Fp8ColumnParallelLinear  # the same module and parameters; only _forward_impl differs


def fp8_linear_count(model: torch.nn.Module) -> tuple[int, int]:
    """(linears running in fp8, linears built for fp8 that run in bf16) in ``model``."""
    fp8 = sum(isinstance(m, _Fp8Gemm) for m in model.modules())
    bf16 = sum(isinstance(m, (ColumnParallelLinear, RowParallelLinear)) and vars(m).get("fp8", False) is None
               for m in model.modules())
    return fp8, bf16
