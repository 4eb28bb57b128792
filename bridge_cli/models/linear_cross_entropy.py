"""``model.fused_linear_cross_entropy``: the output projection and the cross entropy in chunks of tokens,
so the [tokens x vocabulary] logits never exist whole.

GPTModel's last stage projects every token onto the vocabulary (bf16 logits), upcasts them to fp32
and takes the vocab-parallel cross entropy, which keeps the fp32 logits (or their softmax) for the
backward: 32K tokens of a 128K vocabulary are 16 GiB, more than the rest of a 1B model's
activations. Here the forward projects ``chunk`` tokens at a time and keeps only each token's
log-sum-exp; the backward projects each chunk again and turns its softmax straight into the two
gradient GEMMs. One chunk's logits are alive at a time, at the cost of running the projection GEMM
a second time.

The numbers are the unfused path's: logits in the weight's dtype upcast to fp32, the vocab-parallel
max / sum / target logit all-reduced over the tensor-parallel group (megatron-core's
``vocab_parallel_cross_entropy``), gradients cast back to the weight's dtype before their GEMMs.
The weight gradient sums its chunks in fp32. ``model.final_logit_softcapping`` is applied in fp32
inside the chunk.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Optional

import torch
import torch.distributed as dist


class LinearCrossEntropy(torch.autograd.Function):
    """Per-token loss ``logsumexp(h W^T) - (h W^T)[label]`` over a vocabulary split across ``group``.

    ``hidden`` [tokens, hidden] (the same on every rank of ``group``), ``weight`` [vocab / ranks,
    hidden] (this rank's rows), ``labels`` [tokens] (ids in the whole vocabulary). Returns fp32
    [tokens]. The gradient of ``hidden`` is this rank's share; the caller sums it over ``group`` (as a
    column-parallel linear's input gradient is summed).
    """

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, group,
                chunk: int, softcap: Optional[float], math: "ChunkMath") -> torch.Tensor:
        first = _first_row(weight, group)
        losses = torch.empty(hidden.shape[0], dtype=_upcast(weight.dtype), device=hidden.device)
        log_sum_exp = torch.empty_like(losses)
        for start in range(0, hidden.shape[0], chunk):
            rows = slice(start, start + chunk)
            logits = hidden[rows] @ weight.t()
            local = local_labels(labels[rows], first, weight.shape[0])
            peak, target = math.peak_and_target(logits, local, softcap)
            _all_reduce(peak, group, dist.ReduceOp.MAX)
            sum_exp = math.sum_exp(logits, peak, softcap)
            _all_reduce(sum_exp, group)
            _all_reduce(target, group)
            log_sum_exp[rows] = peak + sum_exp.log()
            losses[rows] = log_sum_exp[rows] - target
        ctx.save_for_backward(hidden, weight, labels, log_sum_exp)
        ctx.chunk, ctx.softcap, ctx.group, ctx.math = chunk, softcap, group, math
        return losses

    @staticmethod
    def backward(ctx, grad_losses: torch.Tensor):
        hidden, weight, labels, log_sum_exp = ctx.saved_tensors
        first = _first_row(weight, ctx.group)
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros(weight.shape, dtype=_upcast(weight.dtype), device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk):
            rows = slice(start, start + ctx.chunk)
            local = local_labels(labels[rows], first, weight.shape[0])
            grad = ctx.math.grad_logits(hidden[rows] @ weight.t(), log_sum_exp[rows], local, grad_losses[rows],
                                        ctx.softcap)
            grad_hidden[rows] = grad @ weight
            if weight.dtype == grad_weight.dtype:
                grad_weight.addmm_(grad.t(), hidden[rows])
            else:  # each chunk's GEMM in the weight's dtype, their sum in fp32
                grad_weight.add_(grad.t() @ hidden[rows])
        return grad_hidden, grad_weight.to(weight.dtype), None, None, None, None, None


class ChunkMath(NamedTuple):
    """The passes over one chunk's logits between its GEMMs: eager, or each fused into one kernel."""

    peak_and_target: Callable
    sum_exp: Callable
    grad_logits: Callable


def _peak_and_target(logits: torch.Tensor, local: torch.Tensor, softcap: Optional[float]):
    """Each token's largest logit and its label's logit (0 where another rank holds the label), in fp32."""
    logits = _upcast_and_cap(logits, softcap)
    target = logits.gather(-1, local.clamp(min=0).unsqueeze(-1)).squeeze(-1) * (local >= 0)
    return logits.max(dim=-1).values, target


def _sum_exp(logits: torch.Tensor, peak: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    return _upcast_and_cap(logits, softcap).sub_(peak.unsqueeze(-1)).exp_().sum(dim=-1)


def _grad_logits(logits: torch.Tensor, log_sum_exp: torch.Tensor, local: torch.Tensor, grad_losses: torch.Tensor,
                 softcap: Optional[float]) -> torch.Tensor:
    """d loss / d logits = (softmax - one-hot(label)) times the loss's gradient, in the logits' dtype."""
    grad = _upcast_and_cap(logits, softcap)
    capped = grad.clone() if softcap else None
    grad.sub_(log_sum_exp.unsqueeze(-1)).exp_()
    on_rank = (local >= 0).to(grad.dtype).unsqueeze(-1)
    grad.scatter_add_(-1, local.clamp(min=0).unsqueeze(-1), -on_rank)
    grad.mul_(grad_losses.unsqueeze(-1))
    if softcap:  # through cap * tanh(z / cap): 1 - tanh^2
        grad.mul_(1.0 - capped.div_(softcap).square_())
    return grad.to(logits.dtype)


EAGER = ChunkMath(_peak_and_target, _sum_exp, _grad_logits)


@functools.cache
def compiled_chunk_math() -> ChunkMath:
    """The same passes through ``torch.compile``: each reads the chunk's logits once (``model.compile_layers``)."""
    return ChunkMath(*(torch.compile(f, dynamic=False) for f in EAGER))


def _upcast_and_cap(logits: torch.Tensor, softcap: Optional[float]) -> torch.Tensor:
    """One chunk's logits in fp32 (or wider), soft-capped if asked: a new tensor, except for fp32 (or wider)
    logits without a cap, which the in-place passes above may then overwrite (their callers' logits are spent)."""
    logits = logits.to(_upcast(logits.dtype))
    return torch.tanh(logits / softcap) * softcap if softcap else logits


def _upcast(dtype: torch.dtype) -> torch.dtype:
    """fp32, or the weight's dtype where that is wider."""
    return torch.promote_types(dtype, torch.float32)


def local_labels(labels: torch.Tensor, first: int, rows: int) -> torch.Tensor:
    """Each label's row in this rank's share of the vocabulary, -1 where another rank holds it."""
    local = labels - first
    return torch.where((local >= 0) & (local < rows), local, -1)


def _first_row(weight: torch.Tensor, group) -> int:
    """The vocabulary id of this rank's first row of the output weight."""
    return 0 if group is None else dist.get_rank(group) * weight.shape[0]


def _all_reduce(tensor: torch.Tensor, group, op=dist.ReduceOp.SUM) -> None:
    if group is not None:
        dist.all_reduce(tensor, op=op, group=group)
