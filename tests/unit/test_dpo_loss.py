"""The DPO loss and rewards against the papers' formulas, written here per pair in plain Python (fp32, CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from bridge_cli.training.dpo_loss import dpo_loss

pytestmark = pytest.mark.usefixtures("leaves_no_rerun_state_machine")

BETA = 0.3


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x))


def paper_loss(h: float, beta: float, loss_type: str, eps: float) -> float:
    """DPO (Rafailov et al. 2023): -log sigmoid(beta h); cDPO: (1 - eps) of that + eps of the flipped one;
    IPO (Azar et al. 2023): (h - 1 / (2 beta))^2."""
    if loss_type == "ipo":
        return (h - 1 / (2 * beta)) ** 2
    return -(1 - eps) * log_sigmoid(beta * h) - eps * log_sigmoid(-beta * h)


def sequences():
    """Two rows of 8 tokens packing three pairs (bins 0-5) and padding; per-token log-probs of policy and reference."""
    torch.manual_seed(0)
    bins = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 3], [4, 4, 5, 5, 5, 5, 6, 6]])
    # the first token of each sequence is its prompt (no loss); bin 6 is padding
    mask = torch.tensor([[0, 1, 1, 0, 1, 0, 1, 1], [0, 1, 0, 1, 1, 1, 0, 0]], dtype=torch.float)
    policy = -torch.rand(2, 8) * 3
    reference = -torch.rand(2, 8) * 3
    return bins, mask, policy, reference


def by_hand(bins, mask, logps, average: bool) -> dict[int, float]:
    out = {}
    for b in range(6):
        values = [float(logps.view(-1)[i]) for i in range(16) if int(bins.view(-1)[i]) == b and mask.view(-1)[i]]
        out[b] = sum(values) / (len(values) if average else 1)
    return out


@pytest.mark.parametrize("loss_type, eps", [("sigmoid", 0.0), ("sigmoid", 0.2), ("ipo", 0.0)])
def test_loss_and_rewards_follow_the_papers(loss_type, eps):
    bins, mask, policy, reference = sequences()
    average = loss_type == "ipo"  # IPO averages log-probs over the response tokens
    pi, ref = by_hand(bins, mask, policy, average), by_hand(bins, mask, reference, average)
    losses, chosen, rejected = [], [], []
    for p in range(3):
        w, l = 2 * p, 2 * p + 1
        h = (pi[w] - ref[w]) - (pi[l] - ref[l])
        losses.append(paper_loss(h, BETA, loss_type, eps))
        chosen.append(BETA * (pi[w] - ref[w]))
        rejected.append(BETA * (pi[l] - ref[l]))

    output = (-policy).requires_grad_()
    loss, pairs, report = dpo_loss(mask, bins, 4, reference, output, BETA, eps, loss_type)
    assert int(pairs) == 3  # pair 3 (bins 6, 7) is padding
    assert float(loss) == pytest.approx(sum(losses), rel=1e-5)
    expected = {"dpo loss": sum(losses), "chosen reward": sum(chosen), "rejected reward": sum(rejected),
                "reward margin": sum(c - r for c, r in zip(chosen, rejected)),
                "reward accuracy": sum(float(c > r) for c, r in zip(chosen, rejected))}
    for key, total in expected.items():
        assert report[key].tolist() == pytest.approx([total, 3.0], rel=1e-5, abs=1e-6), key
    loss.backward()
    assert output.grad[mask == 0].abs().max() == 0  # prompts and padding get no gradient
    assert output.grad[mask == 1].abs().min() > 0


def test_an_untrained_policy_scores_log_2_and_no_rewards():
    bins, mask, _, reference = sequences()
    loss, pairs, report = dpo_loss(mask, bins, 4, reference, -reference, BETA)
    assert float(loss) == pytest.approx(3 * math.log(2), rel=1e-6)
    assert report["chosen reward"].tolist() == [0.0, 3.0] and report["reward accuracy"].tolist() == [0.0, 3.0]
