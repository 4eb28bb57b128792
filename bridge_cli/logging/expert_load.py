"""How evenly expert parallelism spreads the work: ``ep load max/mean`` on the log line (and
``moe/ep-load-max-over-mean`` in the metric writers).

Where the experts are spread over ranks (expert parallelism or expert TP, bridge's token dispatch), each rank runs
the (token, expert) pairs the router sends to its experts, and every rank then waits at the exchange's
reduce-scatter for the busiest one: in every MoE layer, every micro-batch. The figure is the expert work the group
waits for over the work it has, summed over the exchanges of the log interval: the busiest rank's pairs in each
exchange over the group's mean pairs, the worst group's over the world. 1.00 is an even spread in every exchange;
1.25 means the busiest rank of each exchange ran a quarter more expert work than the mean, so the others idled for
that long at the reduce-scatter (one GPU holding every expert does not wait on anyone). The busiest rank may differ
from layer to layer, which a sum over the interval would hide: two ranks each twice as busy in alternate layers
have equal totals and wait half of their expert time. Each rank's counts stay on its device between log lines;
reading them is three small collectives on every rank at a log step.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from bridge_cli.models.moe_dispatch import expert_pair_counters


class ExpertLoad:
    def __init__(self, counters: list[torch.Tensor], group):
        self.counters = counters
        self.group = group

    @classmethod
    def of(cls, chunks: list) -> Optional["ExpertLoad"]:
        """The model's load report, or None where no rank's experts are spread."""
        counters, group = expert_pair_counters(chunks)
        return cls(counters, group) if counters else None

    def lap(self) -> float:
        """The expert work the groups waited for over the work they had since the last lap (:func:`waited_for`;
        1.0 when no pair ran), the worst group's; counters reset."""
        counts = torch.stack(self.counters).to(torch.float64)
        for counter in self.counters:
            counter.zero_()
        busiest = counts.clone()
        dist.all_reduce(counts, group=self.group)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=self.group)
        ratio = waited_for(busiest, counts, dist.get_world_size(self.group))
        dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
        return float(ratio)


def waited_for(busiest: torch.Tensor, total: torch.Tensor, ranks: int) -> torch.Tensor:
    """The summed busiest rank's pairs of each exchange over the summed mean (``total / ranks``), as a 0-d tensor;
    1.0 where no pair ran. ``busiest`` and ``total`` hold the group's max and sum, exchange by exchange."""
    mean = total.sum() / ranks
    return busiest.sum() / mean if float(mean) > 0 else torch.ones((), dtype=total.dtype, device=total.device)
