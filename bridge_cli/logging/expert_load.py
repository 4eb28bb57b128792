"""How evenly expert parallelism spreads the work: ``ep load max/mean`` on the log line (and
``moe/ep-load-max-over-mean`` in the metric writers).

Where the experts are spread over ranks (expert parallelism or expert TP, bridge's token dispatch), each rank runs
the (token, expert) pairs the router sends to its experts, and every rank then waits at the layer's reduce-scatter
for the busiest one. The figure is that rank's pairs over the group's mean, summed over the layers and micro-batches
of the log interval, the worst group's over the world: 1.00 is an even spread, 1.25 means the busiest rank ran a
quarter more expert work than the mean (one GPU holding every expert does not wait on anyone). Each rank's count
stays on its device between log lines; reading it is three small collectives on every rank at a log step.
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
        """The busiest rank's pairs over the mean since the last lap (1.0 when no pair ran); counters reset."""
        local = torch.stack(self.counters).sum().to(torch.float64)
        for counter in self.counters:
            counter.zero_()
        total, busiest = local.clone(), local.clone()
        dist.all_reduce(total, group=self.group)
        dist.all_reduce(busiest, op=dist.ReduceOp.MAX, group=self.group)
        mean = total / dist.get_world_size(self.group)
        ratio = busiest / mean if float(mean) > 0 else torch.ones_like(mean)
        dist.all_reduce(ratio, op=dist.ReduceOp.MAX)
        return float(ratio)
