"""``model.gradient_accumulation_fusion`` through megatron-core's parallel linears, in a form ``torch.compile`` traces.

megatron-core's linear adds each weight gradient into the fp32 ``main_grad`` inside its backward, then sets
two Python attributes on the weight there (``weight.main_grad``, ``weight.grad_added_to_main_grad``), which a
compiled backward cannot hold: under ``model.compile_layers`` that backward ran outside the compiled graph, its
bias-gradient sums and the adds around it as separate eager kernels. In the graph they become compiled kernels
of about the same cost (no speed change on gpt2_124m or llama1b, docs/performance.md); what this also gives
is the option on the CPU, where megatron-core's linear cannot run it (its placeholder gradients are CUDA tensors).

:func:`install` gives each parallel linear of the wrapped model a forward whose backward writes nothing but
tensors: the weight gradient is one custom op that adds ``grad_output^T @ input`` into ``main_grad``, an
input of the compiled graph that the op mutates (torch's AOTAutograd keeps such a backward mutation of a
forward input in the graph), and the weight's own gradient is megatron-core's unused placeholder. The flag
megatron-core's linear sets in each backward, which tells the data-parallel wrapper not to add that
placeholder, is set once here instead, and the weight leaves the wrapper's list of flags it resets each step.

The tensor-parallel all-reduce of the input gradient (column-parallel layers without sequence parallelism)
is a functional collective issued before the weight-gradient GEMM, as megatron-core overlaps it. Calls this
does not cover keep megatron-core's linear: sequence parallelism (whose backward gathers the input again
rather than keeping it), frozen weights, deferred embedding gradients, a weight without ``main_grad``
(a model not wrapped for training).
"""

from __future__ import annotations

import functools

import torch

from bridge_cli.models.moe_experts import flag_main_grad_weights
from bridge_cli.models.wgrad_accumulation import wgrad_gemm_accum_fp32


@torch.library.custom_op("bridge::accumulate_wgrad", mutates_args=("main_grad",))
def accumulate_wgrad(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    """``main_grad += grad_output^T @ total_input`` in one GEMM (both [..., features], any leading dims)."""
    wgrad_gemm_accum_fp32(total_input, grad_output, main_grad)


@accumulate_wgrad.register_fake
def _(total_input: torch.Tensor, grad_output: torch.Tensor, main_grad: torch.Tensor) -> None:
    return None


class _LinearIntoMainGrad(torch.autograd.Function):
    """``input @ weight.T + bias`` whose weight gradient :func:`accumulate_wgrad` adds into ``main_grad``."""

    @staticmethod
    def forward(ctx, input, weight, bias, main_grad, zero_placeholder, dgrad_group):
        ctx.save_for_backward(input, weight)
        # Not saved for backward: a weight used twice (a shared output layer) would fail torch's version
        # check once the first backward has added into it. megatron-core keeps it on ctx for the same reason.
        ctx.main_grad = main_grad
        ctx.use_bias = bias is not None
        ctx.zero_placeholder = zero_placeholder
        ctx.dgrad_group = dgrad_group
        output = torch.matmul(input, weight.t())
        return output + bias if bias is not None else output

    @staticmethod
    def backward(ctx, grad_output):
        input, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight)
        if ctx.dgrad_group is not None:  # issued before the weight-gradient GEMM, waited for when used
            from torch.distributed import _functional_collectives as funcol

            grad_input = funcol.all_reduce(grad_input, "sum", ctx.dgrad_group)
        accumulate_wgrad(input, grad_output, ctx.main_grad)
        # What autograd hands the data-parallel wrapper's hook, which skips it (the flag set by install);
        # zeros where the hook adds it anyway (a weight shared with the embedding, megatron's zero_out_wgrad).
        placeholder = torch.zeros_like(weight) if ctx.zero_placeholder else torch.empty_like(weight)
        grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0) if ctx.use_bias else None
        return grad_input, placeholder, grad_bias, None, None, None


def _forward_impl(layer, megatron_impl, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                  sequence_parallel, grad_output_buffer=None, wgrad_deferral_limit=None, tp_group=None, **rest):
    """A parallel linear's ``_forward_impl``: this module's linear where it applies, else megatron-core's."""
    # flagged by install, or shared with the embedding (whose hook adds the zero placeholder and the lookup's grad)
    owned = getattr(weight, "grad_added_to_main_grad", False) or getattr(weight, "zero_out_wgrad", False)
    if not (gradient_accumulation_fusion and weight.requires_grad and hasattr(weight, "main_grad") and owned
            and not sequence_parallel and grad_output_buffer is None and rest.get("gtp_remat_size", 1) == 1):
        return megatron_impl(input=input, weight=weight, bias=bias,
                             gradient_accumulation_fusion=gradient_accumulation_fusion,
                             allreduce_dgrad=allreduce_dgrad, sequence_parallel=sequence_parallel,
                             grad_output_buffer=grad_output_buffer, wgrad_deferral_limit=wgrad_deferral_limit,
                             tp_group=tp_group, **rest)
    group = (tp_group if tp_group is not None else layer.tp_group) if allreduce_dgrad else None
    return _LinearIntoMainGrad.apply(input, weight, bias, weight.main_grad,
                                     getattr(weight, "zero_out_wgrad", False), group)


def install(ddp_chunks: list) -> None:
    """Route the parallel linears of these DDP-wrapped chunks through :class:`_LinearIntoMainGrad` and flag
    their weights for the wrapper once. Call after the DDP wrap, before training.

    Layers that replace megatron-core's ``_forward_impl`` (bridge's FP8 linears) keep their own. Grouped
    experts (:mod:`~bridge_cli.models.moe_experts`) are flagged here too."""
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    for chunk in ddp_chunks:
        flagged = set()
        for module in chunk.modules():
            if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                continue
            base = ColumnParallelLinear if isinstance(module, ColumnParallelLinear) else RowParallelLinear
            if type(module)._forward_impl is not base._forward_impl or not module.gradient_accumulation_fusion:
                continue
            module._forward_impl = functools.partial(_forward_impl, module, module._forward_impl)
            weight = module.weight
            if weight is not None and hasattr(weight, "main_grad") and not getattr(weight, "zero_out_wgrad", False):
                weight.grad_added_to_main_grad = True
                flagged.add(weight)
        flagged |= flag_main_grad_weights(chunk)  # grouped experts: the same, through their own function
        # megatron-core's DDP resets every flag to False at each zero_grad_buffer; these stay set
        chunk.params_with_grad = [p for p in chunk.params_with_grad if p not in flagged]
