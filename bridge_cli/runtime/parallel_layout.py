"""The parallel layout of a run, as lines for the log: sizes, and which ranks form which group.

The groups are computed the way megatron-core's ``initialize_model_parallel`` builds them (its
``RankGenerator``, default order tp-cp-ep-dp-pp), so every rank can describe the whole world
without a collective.
"""

from __future__ import annotations

import math
from typing import Optional

MAX_GROUPS_SHOWN = 8


def world_step(tp: int, pp: int, cp: int, ep: int, etp: int) -> int:
    """The fewest ranks a layout fits (every world it runs on is a multiple): its dense groups (TP x PP x CP) and
    its expert groups (expert-TP x EP x PP) both divide the world."""
    return math.lcm(tp * pp * cp, etp * ep * pp)


def model_world_step(model) -> int:
    """:func:`world_step` of a model config's sizes (expert-TP defaults to TP, as megatron-core's does)."""
    tp = model.tensor_model_parallel_size
    return world_step(tp, model.pipeline_model_parallel_size, model.context_parallel_size,
                      model.expert_model_parallel_size, model.expert_tensor_parallel_size or tp)


def _groups(ranks: list[list[int]]) -> str:
    shown = " ".join("[" + ",".join(map(str, group)) + "]" for group in ranks[:MAX_GROUPS_SHOWN])
    more = len(ranks) - MAX_GROUPS_SHOWN
    return shown + (f" ... ({len(ranks)} groups)" if more > 0 else "")


def parallel_layout(world_size: int, tp: int, pp: int, cp: int, ep: int, vpp: Optional[int],
                    ranks_per_node: Optional[int] = None) -> list[str]:
    """One line of sizes, one per kind of group (those of size > 1, and data parallel), and a
    warning when a tensor-parallel group would span nodes (its traffic is per layer, so it belongs
    on NVLink)."""
    from megatron.core.parallel_state import RankGenerator

    dp = world_size // (tp * pp * cp)
    generator = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order="tp-cp-ep-dp-pp")
    sizes = f"TP {tp} x CP {cp} x PP {pp} x DP {dp}" + (f" (EP {ep})" if ep > 1 else "")
    lines = [f"parallel layout: world {world_size} = {sizes}" +
             (f", {vpp} virtual stages per pipeline rank" if vpp else "")]
    for name, key, size in (("tensor", "tp", tp), ("context", "cp", cp), ("pipeline", "pp", pp), ("data", "dp", dp)):
        if size > 1 or key == "dp":
            lines.append(f"  {name}-parallel groups: {_groups(generator.get_ranks(key))}")
    if ranks_per_node and world_size > ranks_per_node and ranks_per_node % (tp * cp):
        lines.append(f"  warning: tensor x context parallel groups of {tp * cp} ranks span nodes of {ranks_per_node} "
                     "GPUs; keep model.tensor_model_parallel_size x context_parallel_size within a node.")
    return lines
