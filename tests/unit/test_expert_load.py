"""``ep load max/mean``'s arithmetic (bridge_cli/logging/expert_load.py): the busiest rank of each exchange against
the group's mean, summed over the exchanges. The collectives that give each exchange's max and sum are run by the
EP=2 run of tests/integration/test_moe_parallel_cpu.py."""

from __future__ import annotations

import pytest
import torch

from bridge_cli.logging.expert_load import waited_for


def reduced(per_rank: list[list[list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
    """The group's max and sum, exchange by exchange, of each rank's [layer][exchange] pair counts."""
    counts = torch.tensor(per_rank, dtype=torch.float64)
    return counts.amax(0), counts.sum(0)


def test_an_even_spread_waits_for_nothing():
    busiest, total = reduced([[[10, 12], [8, 8]], [[10, 12], [8, 8]]])
    assert float(waited_for(busiest, total, 2)) == 1.0


def test_ranks_busy_in_turn_wait_though_their_totals_are_equal():
    """Rank 0 has all of layer 1's pairs, rank 1 all of layer 2's: each rank's total is the same (a sum over the
    interval would say 1.00), yet in each layer one rank idles while the other works: twice the mean."""
    busiest, total = reduced([[[20], [0]], [[0], [20]]])
    assert float(waited_for(busiest, total, 2)) == pytest.approx(2.0)
    assert float(total.sum(dim=(0, 1))) == 40


def test_one_busier_rank_in_one_exchange():
    # exchange 1: 30 against 10 (mean 20, max 30); exchange 2: 20 and 20. (30 + 20) / (20 + 20)
    busiest, total = reduced([[[30, 20]], [[10, 20]]])
    assert float(waited_for(busiest, total, 2)) == pytest.approx(1.25)


def test_no_pair_is_an_even_spread():
    busiest, total = reduced([[[0, 0]], [[0, 0]]])
    assert float(waited_for(busiest, total, 2)) == 1.0
