"""``model.gradient_accumulation_fusion`` without Apex or Transformer Engine.

megatron-core's parallel linears can add each weight gradient into the parameter's fp32 ``main_grad``
inside the weight-gradient GEMM, instead of writing a bf16 gradient that the data-parallel wrapper
then adds in a kernel of its own (once per micro-batch, over every parameter). megatron-core calls
Apex's ``fused_weight_gradient_mlp_cuda`` extension for it and refuses the option without Apex.
:func:`install` puts this module in that extension's place: the same two functions, each one cuBLAS
GEMM with ``main_grad`` as its accumulator (``torch.addmm`` with an fp32 output for bf16 operands,
torch >= 2.8 on CUDA). megatron-core's own code does the rest (the ``grad_added_to_main_grad`` flag,
the zeroed placeholder gradient of a weight shared with the embedding).

CUDA only: megatron-core allocates the placeholder gradients on the current CUDA device.
"""

from __future__ import annotations

import importlib.util

import torch

from bridge_cli.config.errors import ConfigError


def wgrad_gemm_accum_fp32(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` (both [tokens, features]), accumulated in ``main_grad``'s
    fp32 by the GEMM."""
    x, dy = total_input.reshape(-1, total_input.shape[-1]), grad_output.reshape(-1, grad_output.shape[-1])
    if dy.dtype == main_grad.dtype:
        main_grad.addmm_(dy.t(), x)
    else:
        torch.addmm(main_grad, dy.t(), x, out_dtype=main_grad.dtype, out=main_grad)


wgrad_gemm_accum_fp16 = wgrad_gemm_accum_fp32
"""The same for a bf16 or fp16 ``main_grad`` (``ddp.grad_reduce_in_fp32=false`` without the distributed optimizer)."""


def check(model) -> None:
    """Refuse ``gradient_accumulation_fusion`` where neither Apex nor this torch can run it (the validation
    pass calls this, so --dry-run refuses what a run would)."""
    if model.gradient_accumulation_fusion and not (_apex_has_it() or addmm_has_fp32_output()):
        raise ConfigError("model.gradient_accumulation_fusion",
                          f"needs Apex or torch >= 2.8 (torch.addmm with out_dtype); this is torch {torch.__version__}.",
                          "Set model.gradient_accumulation_fusion=false.")


def install() -> None:
    """Stand in for Apex's extension in megatron-core's linear layers, unless Apex provides it. Call
    before building a model with ``gradient_accumulation_fusion``."""
    import sys

    from megatron.core.tensor_parallel import layers

    if not layers._grad_accum_fusion_available:
        layers.fused_weight_gradient_mlp_cuda = sys.modules[__name__]
        layers._grad_accum_fusion_available = True


def addmm_has_fp32_output() -> bool:
    """Whether this torch has ``torch.addmm(..., out_dtype=...)`` (2.8 and newer)."""
    return "dtype_out" in torch.ops.aten.addmm.overloads()


def _apex_has_it() -> bool:
    return importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is not None
