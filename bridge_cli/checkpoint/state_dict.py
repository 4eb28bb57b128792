"""What a checkpoint holds: the sharded state dict handed to megatron-core's dist_checkpointing.

Keys follow Megatron-LM's ``torch_dist`` checkpoints: ``model`` (``model0``, ``model1``, ... with
virtual pipeline stages), ``optimizer``, ``rng_state``, ``opt_param_scheduler``, ``iteration``,
``checkpoint_version``, ``num_floating_point_operations_so_far`` and, when megatron-core's rerun state
machine has state to keep, ``rerun_state_machine``. ``train_state`` (bridge's
progress counters, whose consumed samples are the data position) and ``bridge`` (a marker) are
added. A run with adapters (LoRA, see :mod:`bridge_cli.checkpoint.adapters`) saves only their tensors
under ``model``, and ``peft`` (the adapter settings and the base checkpoint's path) in the common
state. Model and optimizer tensors are ``ShardedTensor``s with global shapes, so a checkpoint
loads under another tensor/pipeline/data-parallel layout; everything else is the common state
(``common.pt``; megatron-core 0.19 keeps it among the shards) except the RNG states, one
``ShardedObject`` per (pipeline, tensor) rank.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

import numpy as np
import torch

CHECKPOINT_VERSION = 3.0
FORMAT = "bridge_cli torch_dist v1"


def content_metadata(use_distributed_optimizer: bool, checkpoint_cfg=None) -> dict[str, Any]:
    """How model and optimizer state are sharded; saved in the checkpoint, as Megatron-LM does.

    The distributed optimizer's state is ``dp_reshardable`` (Megatron-LM's default), or ``fully_reshardable`` where
    ``checkpoint_cfg.dist_ckpt_optim_fully_reshardable`` asks (see checkpoint/distributed_optimizer.py)."""
    metadata: dict[str, Any] = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if use_distributed_optimizer:
        fully = checkpoint_cfg is not None and checkpoint_cfg.dist_ckpt_optim_fully_reshardable
        metadata["distrib_optim_sharding_type"] = "fully_reshardable" if fully else "dp_reshardable"
        if fully and checkpoint_cfg.distrib_optim_fully_reshardable_mem_efficient:
            metadata["distrib_optim_fully_reshardable_mem_efficient"] = True
    return metadata


def model_chunks(model: list) -> list:
    """The GPTModels inside megatron-core's DDP and Float16Module wrappers."""
    from megatron.core.utils import unwrap_model

    return unwrap_model(model)


def model_keys(model: list) -> list[str]:
    return ["model"] if len(model) == 1 else [f"model{i}" for i in range(len(model))]


Selector = Optional[Callable[[str], bool]]
"""Which model keys a checkpoint holds (None: all of them)."""


def model_sharded_state_dict(model: list, metadata: dict, select: Selector = None) -> dict:
    """``{"model": ...}`` (or ``model0``, ``model1``, ... per virtual pipeline stage), the keys ``select`` keeps."""
    from bridge_cli.runtime.fsdp import fix_gated_linear_shards

    out = {}
    for key, chunk in zip(model_keys(model), model_chunks(model)):
        sharded = chunk.sharded_state_dict(metadata=metadata)
        fix_gated_linear_shards(chunk, sharded)  # FSDP2's shards of SwiGLU's fc1
        out[key] = {k: v for k, v in sharded.items() if select(k)} if select else sharded
    return out


def header(train_state) -> dict[str, Any]:
    """The common-state keys every checkpoint starts with: format, iteration and progress counters."""
    return {
        "checkpoint_version": CHECKPOINT_VERSION,
        "bridge": FORMAT,
        "iteration": train_state.step,
        "train_state": train_state.state_dict(),
        "num_floating_point_operations_so_far": train_state.floating_point_operations_so_far,
    }


def build(train_state, model: list, optimizer, scheduler, *, metadata: dict, optim: bool, rng: bool, is_cuda: bool,
          is_loading: bool = False, select: Selector = None) -> dict:
    """The sharded state dict of this rank (for saving, or as the template ``load`` fills in).

    ``select`` keeps only some model keys (an adapter policy's); ``scheduler`` may be None for a
    weights-only checkpoint.
    """
    sharded: dict[str, Any] = header(train_state)
    if scheduler is not None:
        sharded["opt_param_scheduler"] = scheduler.state_dict()
    sharded.update(model_sharded_state_dict(model, metadata, select))
    if optim:
        sharded["optimizer"] = optimizer.sharded_state_dict(sharded, is_loading=is_loading, metadata=metadata)
    if rng:
        sharded["rng_state"] = rng_sharded_object(is_cuda)
    return sharded


def rerun_state(data_iterator=None) -> dict[str, Any]:
    """``{"rerun_state_machine": ...}`` where megatron-core's rerun state machine has state to keep, else {}.

    It has when a step is to be re-run from this checkpoint (the step's micro-batches from
    ``data_iterator`` included); from megatron-core 0.19 on, also at every save while it is enabled.
    Its run-level state goes into the common state, its per-rank state into one ``ShardedObject`` per rank.
    """
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    saved = get_rerun_state_machine().state_dict(data_iterator=data_iterator, ckpt_format="torch_dist")
    return {"rerun_state_machine": saved} if saved else {}


def rerun_template() -> dict[str, Any]:
    """The ``rerun_state_machine`` entry for ``dist_checkpointing.load`` to fill in."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    return {"rerun_state_machine": get_rerun_state_machine().state_dict(data_iterator=None, ckpt_format="torch_dist",
                                                                        force=True)}


def rng_sharded_object(is_cuda: bool):
    """This rank's RNG states, keyed by its (pipeline, tensor) rank; data-parallel replicas share one."""
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    offset = (ps.get_pipeline_model_parallel_rank(), ps.get_tensor_model_parallel_rank())
    return ShardedObject("rng_state", [rng_states(is_cuda)], rng_layout(), offset,
                         replica_id=ps.get_data_parallel_rank(with_context_parallel=True))


def rng_layout() -> tuple[int, int]:
    """(pipeline, tensor) parallel sizes: the grid the RNG states are saved on."""
    from megatron.core import parallel_state as ps

    return ps.get_pipeline_model_parallel_world_size(), ps.get_tensor_model_parallel_world_size()


def rng_states(is_cuda: bool) -> dict[str, Any]:
    """Python, NumPy, torch (and CUDA) generators plus megatron-core's RNG tracker, as Megatron-LM saves them."""
    from megatron.core import tensor_parallel

    states = {
        "random_rng_state": random.getstate(),
        "np_rng_state": np.random.get_state(),
        "torch_rng_state": torch.get_rng_state(),
        "rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    if is_cuda:
        states["cuda_rng_state"] = torch.cuda.get_rng_state()
    return states


def restore_rng_states(states: dict[str, Any]) -> None:
    from megatron.core import tensor_parallel

    random.setstate(states["random_rng_state"])
    np.random.set_state(states["np_rng_state"])
    torch.set_rng_state(states["torch_rng_state"])
    if "cuda_rng_state" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state(states["cuda_rng_state"])
    tensor_parallel.get_cuda_rng_tracker().set_states(states["rng_tracker_states"])
