"""``model.cross_entropy_fusion_impl=triton``: the vocab-parallel cross entropy without an fp32 copy of the logits.

megatron-core's fused cross entropy (``native``) upcasts the bf16 logits, keeps their fp32 softmax for the
backward and makes its gradient from it: per micro-batch of gpt2_124m (65,536 tokens x 50,304) that is a
13 GB fp32 tensor written, then read, on top of the logits' own passes (profiled on an H100: 18 ms of
kernels a micro-batch, 13% of the step). Here the forward reads the bf16 logits once (each token's max,
sum of exponentials and label logit, accumulated online in fp32) and keeps the logits and one fp32
log-sum-exp per token; the backward reads the logits once more and writes ``softmax - one-hot`` times
the loss's gradient straight in the logits' dtype, into the logits' own storage when the caller's logits
are spent after the loss (a model's are), so the logits and their gradient never coexist.

Across tensor-parallel ranks, each holding a slice of the vocabulary, the three per-token numbers are
combined with all-reduces as megatron-core's ``vocab_parallel_cross_entropy`` combines them. On CUDA
the passes are two Triton kernels (CUDA builds of torch ship Triton); elsewhere (the CPU) the same
math runs as torch passes over the whole logits, for correctness, not speed.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from bridge_cli.models import linear_cross_entropy as passes
from bridge_cli.runtime.triton_support import available as triton_available

BLOCK = 4096  # vocabulary entries a kernel reads per step
WARPS = 8


class VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token ``logsumexp(logits) - logits[label]`` over a vocabulary split across ``group``.

    ``logits`` [tokens, vocab / ranks] (this rank's columns, any float dtype), ``labels`` [tokens] (ids
    in the whole vocabulary). Returns fp32 [tokens]; the gradient comes back in the logits' dtype. With
    ``in_place`` the backward writes it into the logits' storage and moves their version counter: an op
    that kept the same logits for its own backward then fails loudly instead of reading gradients.
    """

    @staticmethod
    def forward(ctx, logits: torch.Tensor, labels: torch.Tensor, group, in_place: bool = False) -> torch.Tensor:
        logits, labels = logits.contiguous(), labels.contiguous()
        first = 0 if group is None else dist.get_rank(group) * logits.shape[1]
        peak, sum_exp, target = _row_stats(logits, labels, first)
        if group is not None:  # the vocabulary's whole: rescale each rank's sum to the common max
            local_peak = peak.clone()
            dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=group)
            sum_exp.mul_((local_peak - peak).exp_())
            dist.all_reduce(sum_exp, group=group)
            dist.all_reduce(target, group=group)
        log_sum_exp = peak + sum_exp.log()
        ctx.save_for_backward(logits, labels, log_sum_exp)
        ctx.first, ctx.in_place = first, in_place
        return log_sum_exp - target

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        logits, labels, log_sum_exp = ctx.saved_tensors
        grad = _grad_logits(logits, labels, ctx.first, log_sum_exp, grad_losses.contiguous(), ctx.in_place)
        return grad, None, None, None


def selected(config) -> bool:
    """Whether a model config asks for this cross entropy."""
    return config.cross_entropy_loss_fusion and config.cross_entropy_fusion_impl == "triton"


def language_model_loss(labels: torch.Tensor, logits: torch.Tensor, group, in_place: bool = True) -> torch.Tensor:
    """megatron-core's ``compute_language_model_loss`` contract: ``labels`` [b, s], ``logits`` [s, b, vocab /
    ranks] -> fp32 losses [b, s]. ``group``: the tensor-parallel group, None for one rank. ``in_place``: the
    logits are spent after the loss (a model's are), so their storage takes the gradient."""
    seq, batch, vocab = logits.shape
    losses = VocabParallelCrossEntropy.apply(logits.reshape(seq * batch, vocab), labels.t().reshape(-1), group,
                                             in_place)
    return losses.view(seq, batch).t().contiguous()


def _row_stats(logits: torch.Tensor, labels: torch.Tensor, first: int):
    """Each row's max, sum of ``exp(logit - max)`` and label logit (0 where another rank holds the label), fp32."""
    rows, vocab = logits.shape
    if not (logits.is_cuda and triton_available()):
        local = passes.local_labels(labels, first, vocab)
        peak, target = passes.EAGER.peak_and_target(logits, local, None)
        # the pass works in place on fp32 logits, which the backward still needs
        return peak, passes.EAGER.sum_exp(logits.clone(), peak, None), target
    peak, sum_exp, target = (torch.empty(rows, dtype=torch.float32, device=logits.device) for _ in range(3))
    if rows:
        _kernels()[0][(rows,)](logits, labels, peak, sum_exp, target, vocab, first, BLOCK=BLOCK, num_warps=WARPS)
    return peak, sum_exp, target


def _grad_logits(logits: torch.Tensor, labels: torch.Tensor, first: int, log_sum_exp: torch.Tensor,
                 grad_losses: torch.Tensor, in_place: bool) -> torch.Tensor:
    """``(softmax - one-hot(label)) * grad_losses`` per row, in the logits' dtype: in their storage with
    ``in_place``, else in a new tensor."""
    rows, vocab = logits.shape
    if not (logits.is_cuda and triton_available()):
        local = passes.local_labels(labels, first, vocab)
        # the pass works in place on fp32 logits and makes a new tensor for narrower ones
        grad = passes.EAGER.grad_logits(logits if in_place else logits.clone(), log_sum_exp, local, grad_losses, None)
        return logits.copy_(grad) if in_place and grad is not logits else grad
    grad = logits if in_place else torch.empty_like(logits)
    if rows:
        _kernels()[1][(rows,)](logits, labels, log_sum_exp, grad_losses, grad, vocab, first, BLOCK=BLOCK,
                               num_warps=WARPS)
    if in_place:
        torch.autograd.graph.increment_version(logits)
    return grad


@functools.cache
def _kernels():
    """The forward and backward Triton kernels, compiled on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def row_stats(logits_ptr, labels_ptr, peak_ptr, sum_ptr, target_ptr, vocab, first, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * vocab
        peak = float("-inf")
        total = 0.0
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            x = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
            new_peak = tl.maximum(peak, tl.max(x, axis=0))
            total = total * tl.exp(peak - new_peak) + tl.sum(tl.exp(x - new_peak), axis=0)
            peak = new_peak
        label = tl.load(labels_ptr + row) - first
        on_rank = (label >= 0) & (label < vocab)
        target = tl.load(base + tl.where(on_rank, label, 0), mask=on_rank, other=0.0).to(tl.float32)
        tl.store(peak_ptr + row, peak)
        tl.store(sum_ptr + row, total)
        tl.store(target_ptr + row, target)

    @triton.jit
    def grad_logits(logits_ptr, labels_ptr, lse_ptr, grad_loss_ptr, grad_ptr, vocab, first, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        base = row * vocab
        label = tl.load(labels_ptr + row) - first
        log_sum_exp = tl.load(lse_ptr + row)
        scale = tl.load(grad_loss_ptr + row).to(tl.float32)
        for start in range(0, vocab, BLOCK):
            cols = start + tl.arange(0, BLOCK)
            inside = cols < vocab
            x = tl.load(logits_ptr + base + cols, mask=inside, other=0.0).to(tl.float32)
            grad = tl.exp(x - log_sum_exp) - tl.where(cols == label, 1.0, 0.0)
            tl.store(grad_ptr + base + cols, (grad * scale).to(grad_ptr.dtype.element_ty), mask=inside)

    return row_stats, grad_logits
