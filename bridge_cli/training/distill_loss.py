"""Knowledge distillation's loss (Hinton et al. 2015): the forward KL from a teacher's softened distribution
to the model's, on vocab-parallel logits, optionally mixed with the data's cross entropy, in the
token-weighted ``(loss, count, report)`` form of :mod:`bridge_cli.training.losses`.

Per token, with p = softmax(teacher / T) and q = softmax(model / T) over the tokenizer's vocabulary (the
embedding's padding rows are left out of both):

    loss = (1 - w) T^2 KL(p || q) + w CE(labels),   KL(p || q) = sum_v p_v (log p_v - log q_v)

T^2 keeps the KL's gradient, which is (q - p) / T per logit, on the scale of the cross entropy's as T changes.
Under tensor parallelism each rank holds a slice of the vocabulary; the softmax's maxima and sums and the KL's
sum over the vocabulary are all-reduced over the tensor-parallel group, as megatron-core's vocab-parallel cross
entropy does, so the KL is the one-process value. Nothing reads back to the host.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from bridge_cli.training.losses import validate_loss

REPORT_KEYS = ("distill loss", "kl loss", "lm loss")
"""What the log line, TensorBoard and validation show, each averaged over the loss tokens of the global batch:
the loss trained on, KL(teacher || model) at distill.temperature (without the T^2), and the cross entropy."""


class _VocabParallelKL(torch.autograd.Function):
    """KL(softmax(teacher / T) || softmax(model / T)) per token over vocab-parallel logits ``[..., V / TP]``."""

    @staticmethod
    def forward(ctx, logits, teacher_logits, temperature: float, vocab_size: int, group):
        tp = dist.get_world_size(group) if group is not None and dist.is_initialized() else 1
        rank = dist.get_rank(group) if tp > 1 else 0
        local = logits.shape[-1]
        columns = torch.arange(local, device=logits.device) + rank * local
        padding = columns >= vocab_size  # the embedding's padding rows: no token of the vocabulary
        log_q, q = _log_softmax(logits.float() / temperature, padding, group, tp)
        log_p, p = _log_softmax(teacher_logits.float() / temperature, padding, group, tp)
        kl = torch.sum(p * (log_p - log_q).masked_fill(padding, 0.0), dim=-1)
        if tp > 1:
            dist.all_reduce(kl, group=group)
        ctx.save_for_backward(q, p)
        ctx.temperature, ctx.dtype = temperature, logits.dtype
        return kl

    @staticmethod
    def backward(ctx, grad_kl):
        q, p = ctx.saved_tensors
        grad = (q - p).mul_(grad_kl.unsqueeze(-1) / ctx.temperature)
        return grad.to(ctx.dtype), None, None, None, None


def _log_softmax(scaled: torch.Tensor, padding: torch.Tensor, group, tp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-softmax, softmax) of ``scaled`` over the whole (vocab-parallel) last dimension, padding at probability 0."""
    scaled = scaled.masked_fill(padding, float("-inf"))
    top = scaled.max(dim=-1, keepdim=True).values
    if tp > 1:
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    shifted = scaled - top
    total = shifted.exp().sum(dim=-1, keepdim=True)
    if tp > 1:
        dist.all_reduce(total, group=group)
    log_softmax = shifted - total.log()
    return log_softmax, log_softmax.exp()


def vocab_parallel_kl(logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float, vocab_size: int,
                      group=None) -> torch.Tensor:
    """Per-token KL(teacher || model) at ``temperature`` over the first ``vocab_size`` columns of logits that
    ``group``'s ranks each hold a slice of (None: one process holds them all); differentiable in ``logits``."""
    return _VocabParallelKL.apply(logits, teacher_logits.detach(), temperature, vocab_size, group)


def distill_loss(loss_mask: torch.Tensor, labels: torch.Tensor, teacher_logits: torch.Tensor,
                 output_tensor: torch.Tensor, temperature: float = 1.0, ce_weight: float = 0.0,
                 vocab_size: int | None = None, group=None, check_for_nan_in_loss: bool = True,
                 check_for_spiky_loss: bool = False):
    """The schedule's loss function: ``output_tensor`` is the model's logits ``[b, s, V / TP]`` and
    ``teacher_logits`` the teacher's, ``labels`` and ``loss_mask`` ``[b, s]``.

    Returns the sum of the per-token losses where ``loss_mask`` is 1, the number of such tokens, and a
    ``[sum, tokens]`` report per :data:`REPORT_KEYS`.
    """
    from bridge_cli.models.cross_entropy import VocabParallelCrossEntropy

    vocab_size = vocab_size or output_tensor.shape[-1]
    mask = loss_mask.float()
    kl = vocab_parallel_kl(output_tensor, teacher_logits, temperature, vocab_size, group)
    with torch.set_grad_enabled(ce_weight > 0 and torch.is_grad_enabled()):  # reported only: no graph
        ce = VocabParallelCrossEntropy.apply(output_tensor.reshape(-1, output_tensor.shape[-1]), labels.reshape(-1),
                                             group, False).view_as(labels)
    per_token = (1 - ce_weight) * temperature ** 2 * kl + (ce_weight * ce if ce_weight > 0 else 0.0)
    loss = torch.sum(per_token * mask)
    tokens = mask.sum()
    report = {key: torch.stack([torch.sum(value.detach() * mask), tokens])
              for key, value in zip(REPORT_KEYS, (per_token, kl, ce))}
    validate_loss(loss, check_for_nan_in_loss, check_for_spiky_loss)
    return loss, tokens.to(torch.int), report
