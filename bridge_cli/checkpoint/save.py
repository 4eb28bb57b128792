"""save_checkpoint(): write one torch_dist checkpoint, atomically from a reader's side.

Every rank writes its shards into ``iter_XXXXXXX.incomplete`` (megatron-core's
``dist_checkpointing.save``); after a barrier rank 0 adds ``run_config.yaml``, renames the folder
into place, moves the tracker and prunes old checkpoints (see :mod:`bridge_cli.checkpoint.layout`).
With ``checkpoint.async_save`` (CUDA only) the shard writing runs in the background and that last
step runs when it has finished on every rank, from :func:`finalize_async_saves`.
"""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bridge_cli.checkpoint import layout, state_dict

RUN_CONFIG = "run_config.yaml"
NON_PERSISTENT = "non_persistent"


def save_root(cfg, non_persistent: bool) -> Path:
    """Where this kind of checkpoint goes: ``checkpoint.save``, or the non-persistent folder."""
    ckpt = cfg.checkpoint
    if not non_persistent:
        return Path(ckpt.save)
    return Path(ckpt.non_persistent_global_ckpt_dir or Path(ckpt.save) / NON_PERSISTENT)


def save_checkpoint(state, model: list, optimizer, scheduler, checkpointing_context: dict[str, Any],
                    non_persistent: bool = False) -> Path:
    """Save model, optimizer, scheduler, RNG and progress at ``state.train_state.step``; returns the folder.

    With ``peft`` the model part is the adapters alone (see :mod:`bridge_cli.checkpoint.state_dict`);
    ``optimizer`` and ``scheduler`` may be None for a weights-only checkpoint (a merged model).

    Non-persistent checkpoints (``checkpoint.non_persistent_ckpt_type=global``) use the same layout
    in their own folder, where only the newest is kept.
    """
    from megatron.core import dist_checkpointing

    cfg = state.cfg
    ckpt = cfg.checkpoint
    root, iteration = save_root(cfg, non_persistent), state.train_state.step
    tmp = layout.incomplete_dir(root, iteration)
    if dist.get_rank() == 0:
        layout.start(root, iteration)
        if not checkpointing_context.get(f"cleaned:{root}"):
            layout.remove_incomplete(root, keep=tmp)
            checkpointing_context[f"cleaned:{root}"] = True
    dist.barrier()
    sharded = state_dict.build(state, model, optimizer, scheduler, optim=ckpt.save_optim and optimizer is not None,
                               rng=ckpt.save_rng, select=state_dict.saved_model_keys(cfg))
    request = dist_checkpointing.save(
        sharded, str(tmp), _save_strategy(cfg, checkpointing_context),
        async_sharded_save=ckpt.async_save,
        content_metadata=state_dict.content_metadata(cfg),
        **_async_strategy(ckpt.async_save),
    )
    finish = partial(_publish, root, iteration, cfg.run_record(), ckpt.most_recent_k if not non_persistent else 1)
    if request is None:
        finish()
    else:
        request.add_finalize_fn(finish)
        _async_queue(checkpointing_context, ckpt.use_persistent_ckpt_worker).schedule_async_request(request)
    if not non_persistent:
        checkpointing_context["last_saved_step"] = iteration
    return layout.checkpoint_dir(root, iteration)


def finalize_async_saves(checkpointing_context: dict[str, Any], blocking: bool) -> None:
    """Publish the async saves that have finished on every rank (all of them when ``blocking``)."""
    queue = checkpointing_context.get("async_queue")
    if queue is None:
        return
    queue.maybe_finalize_async_calls(blocking=blocking)
    if blocking:
        queue.close()
        checkpointing_context.pop("async_queue")


def _publish(root: Path, iteration: int, run_config: dict, keep: int) -> None:
    """After every rank has written its shards: the config, the rename, the tracker, the pruning."""
    dist.barrier()
    if dist.get_rank() == 0:
        from omegaconf import OmegaConf

        (layout.incomplete_dir(root, iteration) / RUN_CONFIG).write_text(OmegaConf.to_yaml(run_config))
        layout.publish(root, iteration)
        layout.prune(root, keep, protect=iteration)
    dist.barrier()


def _save_strategy(cfg, checkpointing_context: dict[str, Any]):
    """torch_dist, with the writing spread over data-parallel ranks unless fully_parallel_save is off.

    Kept for the whole run, as Megatron-LM does: with ckpt_assume_constant_structure it caches
    the save plan of the first save and skips planning afterwards.
    """
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if "save_strategy" in checkpointing_context:
        return checkpointing_context["save_strategy"]
    ckpt = cfg.checkpoint
    strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=ckpt.ckpt_assume_constant_structure)
    if ckpt.fully_parallel_save and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        strategy = FullyParallelSaveStrategyWrapper(strategy, ps.get_data_parallel_group(with_context_parallel=True),
                                                    ckpt.ckpt_assume_constant_structure)
    checkpointing_context["save_strategy"] = strategy
    return strategy


def _async_strategy(async_save: bool) -> dict[str, str]:
    """megatron-core 0.19+ writes async saves with NVIDIA Resiliency Extension by default; use its own
    writer, which needs no extra package and whose requests AsyncCallsQueue schedules."""
    import inspect

    from megatron.core import dist_checkpointing

    if async_save and "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}


def _async_queue(checkpointing_context: dict[str, Any], persistent: bool):
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

    if "async_queue" not in checkpointing_context:
        checkpointing_context["async_queue"] = AsyncCallsQueue(persistent=persistent)
    return checkpointing_context["async_queue"]
