"""Adam's state saved under one expert-parallel layout, loaded under another, parameter by parameter.

With a plain (not distributed) optimizer, megatron-core saves each weight's Adam moments as
``optimizer.state.exp_avg.<weight>`` and ``optimizer.state.exp_avg_sq.<weight>``, sharded like the weight
itself: global shapes that load under any tensor, pipeline or expert layout. What does not move is the
rest: with expert parallelism megatron-core chains a second optimizer for the expert weights, so the
state dict's nesting, its param groups (matched by their ``is_expert_parallel`` flag) and the step count's
place differ between layouts, and megatron-core's own load refuses or mismatches them.

So a changed expert layout loads only the moments, by weight name, into this run's optimizer: its param
groups stay this run's (their learning rate and weight decay follow the scheduler, which loads as usual),
and the step count is the checkpoint's (one count for every weight, as megatron-core saves it).
megatron-core's mixed-precision and distributed optimizers keep more state, laid out by their buffers;
for those a changed layout still starts a fresh optimizer (:func:`supported` tells which).
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from bridge_cli.runtime.optimizer_chain import members


def supported(optimizer) -> bool:
    """Whether every member is megatron-core's plain fp32 optimizer (the state :func:`load` knows)."""
    from megatron.core.optimizer.optimizer import FP32Optimizer

    return all(isinstance(member, FP32Optimizer) for member in members(optimizer))


def template(optimizer, model_sharded: dict, metadata: dict) -> dict:
    """The optimizer's sharded state dict reduced to its sharded tensors (the moments), for ``dist_checkpointing.load``."""
    from megatron.core.dist_checkpointing.dict_utils import extract_matching_values
    from megatron.core.dist_checkpointing.mapping import ShardedBase, ShardedTensorFactory

    full = optimizer.sharded_state_dict(model_sharded, is_loading=True, metadata=metadata)
    tensors, _ = extract_matching_values(full, lambda v: isinstance(v, (ShardedBase, ShardedTensorFactory)))
    return tensors


def load(optimizer, tensors: dict, loaded: dict, saved_common: dict) -> None:
    """Put the moments of ``loaded`` (the filled :func:`template`, which the checkpoint's common state was merged
    into) into ``optimizer``, with this run's param groups and the checkpoint's step count."""
    step = saved_step(saved_common)
    chain = members(optimizer)
    for index, member in enumerate(chain):
        own = tensors[index] if len(chain) > 1 else tensors
        filled = loaded[index] if len(chain) > 1 else loaded
        state = member.optimizer.state_dict()
        state["state"] = {param: {key: filled["state"][param][key] for key in moments}
                          for param, moments in own.get("state", {}).items()}
        if step is not None:
            for moments in state["state"].values():
                moments["step"] = _as_tensor_step(step)
        member.optimizer.load_state_dict(state)


def saved_step(common_optimizer: Any) -> Optional[Any]:
    """The step count megatron-core saved with the optimizer (``state.common_step``, at any nesting)."""
    if isinstance(common_optimizer, dict):
        state = common_optimizer.get("state")
        if isinstance(state, dict) and "common_step" in state:
            return state["common_step"]
        for value in common_optimizer.values():
            found = saved_step(value)
            if found is not None:
                return found
    return None


def _as_tensor_step(step: Any) -> torch.Tensor:
    """torch's Adam keeps its step as a float32 scalar tensor."""
    return step.detach().clone().float() if isinstance(step, torch.Tensor) else torch.tensor(float(step))
