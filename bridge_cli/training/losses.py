"""Loss functions (masked next-token cross entropy in the token-weighted (loss, tokens, report) form)
and the reduction of what they report over micro-batches and data-parallel ranks."""

from __future__ import annotations

import functools
import math
from typing import Optional

import torch
import torch.distributed as dist


SPIKY_LOSS_FACTOR = 10
"""A loss this many times the largest of the first 100 is spiky (Megatron-LM's factor)."""


def masked_next_token_loss(loss_mask: torch.Tensor, output_tensor: torch.Tensor, check_for_nan_in_loss: bool = True,
                           check_for_spiky_loss: bool = False):
    """Sum of per-token losses where ``loss_mask`` is 1, the number of such tokens, and the report.

    Stays on the device: no ``.item()`` and no tensor built from a Python number, so a
    micro-batch never waits for the host (such a wait cost 11% of a step on an H100:
    docs/architecture.md), unless the rerun state machine is on: the checks are reported to it
    (:func:`validate_loss`).
    """
    losses = output_tensor.float().view(-1)
    mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([loss.detach(), num_tokens.detach().float()])
    validate_loss(loss, check_for_nan_in_loss, check_for_spiky_loss)
    return loss, num_tokens, {"lm loss": report}


def validate_loss(loss: torch.Tensor, check_for_nan_in_loss: bool, check_for_spiky_loss: bool) -> None:
    """Report this rank's micro-batch loss to megatron-core's rerun state machine, as Megatron-LM's
    ``pretrain_gpt.loss_func`` does: NaN and Inf (fatal), spiky (not fatal).

    Nothing while the machine is disabled: its checks read the loss on the host, and the loop stops
    on a NaN/Inf loss or gradient norm anyway.
    """
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    machine = get_rerun_state_machine()
    if machine.get_mode() == RerunMode.DISABLED:
        return
    # The machine keeps the tensor it rejected to compare with the re-run's; megatron-core's schedule
    # divides the returned loss in place afterwards, so it must keep a copy.
    result = loss.detach().clone()
    if check_for_nan_in_loss:
        for reject, what in ((torch.isnan, "NaN"), (torch.isinf, "Inf")):
            machine.validate_result(result=result, rejection_func=reject, tolerance=0.0, fatal=True,
                                    message=f"found {what} in local forward loss calculation")
    if check_for_spiky_loss:
        machine.validate_result(
            result=result, message="Spiky loss", tolerance=0.0, fatal=False,
            rejection_func=functools.partial(machine.is_unexpectedly_large, threshold=SPIKY_LOSS_FACTOR, context="loss"))


def reduce_loss_dict(losses_reduced: list[dict]) -> dict[str, torch.Tensor]:
    """One value per reported key, over every micro-batch and data-parallel rank; stays on the device.

    A ``[sum, tokens]`` pair (the token-weighted pattern) is summed and divided once, so every
    token counts the same however the batch is split; a scalar (the ``(loss, dict)`` pattern) is
    averaged over micro-batches and ranks.
    """
    from megatron.core import parallel_state

    group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    reduced = {}
    for key in losses_reduced[0]:
        values = [torch.as_tensor(x[key]).detach().float().view(-1) for x in losses_reduced]
        if values[0].numel() == 2:
            total = torch.stack(values).sum(dim=0)
            dist.all_reduce(total, group=group)
            reduced[key] = total[0] / total[1].clamp(min=1)
        else:
            mean = torch.stack([v.mean() for v in values]).mean()
            dist.all_reduce(mean, group=group)
            reduced[key] = mean / dist.get_world_size(group)
    return reduced


def grad_norm_is_finite(grad_norm: Optional[float]) -> bool:
    return grad_norm is None or math.isfinite(grad_norm)
