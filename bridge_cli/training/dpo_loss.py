"""The DPO loss (Rafailov et al. 2023), its conservative (cDPO) and IPO (Azar et al. 2023) variants,
and the rewards it reports, in the token-weighted ``(loss, count, report)`` form of
:mod:`bridge_cli.training.losses` with pairs in place of tokens.

A micro-batch holds whole (chosen, rejected) pairs. Each response token carries a bin,
``2 p`` for pair ``p``'s chosen sequence and ``2 p + 1`` for its rejected one, so a sequence's
log-probability is a sum over its bin, whether the sequences sit in rows of their own or are packed
several to a row. A pair counts when both of its sequences have a response token (a packed row's
padding makes pairs that do not). Everything stays on the device: no ``.item()``, no boolean
indexing, so a micro-batch never waits for the host.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bridge_cli.training.losses import validate_loss

REPORT_KEYS = ("dpo loss", "chosen reward", "rejected reward", "reward margin", "reward accuracy")
"""What the log line, TensorBoard and validation show, each averaged over the pairs of the global batch."""


def pair_logps(token_logps: torch.Tensor, loss_mask: torch.Tensor, bins: torch.Tensor, num_pairs: int,
               average: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen, rejected, valid): each pair's log-probability of its two responses (summed over their
    tokens, or averaged with ``average``) and whether both responses have a token."""
    mask = loss_mask.reshape(-1).float()
    index = bins.reshape(-1).long()
    zeros = torch.zeros(2 * num_pairs, dtype=torch.float32, device=token_logps.device)
    sums = zeros.index_add(0, index, token_logps.reshape(-1).float() * mask)
    counts = zeros.index_add(0, index, mask)
    if average:
        sums = sums / counts.clamp(min=1)
    sums, counts = sums.view(num_pairs, 2), counts.view(num_pairs, 2)
    return sums[:, 0], sums[:, 1], (counts > 0).all(dim=1)


def preference_losses(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, reference_chosen: torch.Tensor,
                      reference_rejected: torch.Tensor, beta: float, label_smoothing: float = 0.0,
                      loss_type: str = "sigmoid") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per pair: the loss, the chosen reward and the rejected reward (``beta`` x log-ratio to the reference).

    sigmoid: ``(1 - eps) * -log sigmoid(beta h) + eps * -log sigmoid(-beta h)`` (eps = ``label_smoothing``,
    0 for DPO); ipo: ``(h - 1 / (2 beta))^2``; h is the chosen log-ratio minus the rejected one.
    """
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    h = chosen_ratio - rejected_ratio
    if loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    return losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach()


def dpo_loss(loss_mask: torch.Tensor, bins: torch.Tensor, num_pairs: int, reference_logps: torch.Tensor,
             output_tensor: torch.Tensor, beta: float, label_smoothing: float = 0.0, loss_type: str = "sigmoid",
             check_for_nan_in_loss: bool = True, check_for_spiky_loss: bool = False):
    """The schedule's loss function: ``output_tensor`` is the policy's per-token cross entropy and
    ``reference_logps`` the reference's per-token log-probabilities, both shaped like ``loss_mask``.

    Returns the sum of the pair losses, the number of pairs and a ``[sum, pairs]`` report per
    :data:`REPORT_KEYS`, which :func:`~bridge_cli.training.losses.reduce_loss_dict` averages over the
    pairs of every micro-batch and data-parallel rank.
    """
    average = loss_type == "ipo"  # IPO's log-likelihoods are per-token means
    policy = pair_logps(-output_tensor, loss_mask, bins, num_pairs, average)
    reference = pair_logps(reference_logps.detach(), loss_mask, bins, num_pairs, average)
    valid = policy[2]
    losses, chosen, rejected = preference_losses(policy[0], policy[1], reference[0], reference[1], beta,
                                                 label_smoothing, loss_type)
    weight = valid.float()
    loss = torch.sum(torch.where(valid, losses, torch.zeros_like(losses)))
    pairs = weight.sum()
    per_pair = (losses.detach(), chosen, rejected, chosen - rejected, (chosen > rejected).float())
    report = {key: torch.stack([torch.sum(value * weight), pairs]) for key, value in zip(REPORT_KEYS, per_pair)}
    report["dpo loss"] = torch.stack([loss.detach(), pairs])
    validate_loss(loss, check_for_nan_in_loss, check_for_spiky_loss)
    return loss, pairs.to(torch.int), report
