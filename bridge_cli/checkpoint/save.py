"""write_checkpoint(): write one torch_dist checkpoint folder, atomically from a reader's side.

Every rank writes its shards into ``iter_XXXXXXX.incomplete`` (megatron-core's
``dist_checkpointing.save``); after a barrier rank 0 adds ``run_config.yaml``, renames the folder
into place, moves the tracker and prunes old checkpoints (see :mod:`bridge_cli.checkpoint.layout`).
An async save returns its request, whose finalization does that last step once the shards are
written on every rank. Training saves through :class:`bridge_cli.checkpoint.manager.CheckpointManager`;
conversion and LoRA merging call this directly.
"""

from __future__ import annotations

import queue
from contextlib import contextmanager
from functools import partial
from pathlib import Path
from typing import Any

import torch.distributed as dist

from bridge_cli.checkpoint import layout

RUN_CONFIG = "run_config.yaml"
NON_PERSISTENT = "non_persistent"


def write_checkpoint(root: Path, iteration: int, sharded: dict, run_record: dict[str, Any], *,
                     content_metadata: dict, strategy=None, async_save: bool = False, keep: int = -1,
                     clear_interrupted: bool = True):
    """Write ``sharded`` (every rank's part) as ``root/iter_<iteration>``; returns (its path, the async
    request or None). ``run_record`` becomes its run_config.yaml; ``keep`` > 0 prunes all but the
    newest ``keep`` checkpoints; ``clear_interrupted`` deletes folders that crashed saves left behind."""
    from megatron.core import dist_checkpointing

    tmp = layout.incomplete_dir(root, iteration)
    if dist.get_rank() == 0:
        layout.start(root, iteration)
        if clear_interrupted:
            layout.remove_incomplete(root, keep=tmp)
    dist.barrier()
    with _results_in_this_process(async_save):
        request = dist_checkpointing.save(sharded, str(tmp), strategy, async_sharded_save=async_save,
                                          content_metadata=content_metadata, **_async_strategy(async_save))
    finish = partial(_publish, Path(root), iteration, run_record, keep)
    if request is None:
        finish()
    else:
        request.add_finalize_fn(finish)
    return layout.checkpoint_dir(root, iteration), request


def save_root(ckpt_cfg, non_persistent: bool) -> Path:
    """Where this kind of checkpoint goes: ``checkpoint.save``, or the non-persistent folder."""
    if not non_persistent:
        return Path(ckpt_cfg.save)
    return Path(ckpt_cfg.non_persistent_global_ckpt_dir or Path(ckpt_cfg.save) / NON_PERSISTENT)


def _publish(root: Path, iteration: int, run_record: dict, keep: int) -> None:
    """After every rank has written its shards: the config, the rename, the tracker, the pruning."""
    dist.barrier()
    if dist.get_rank() == 0:
        from omegaconf import OmegaConf

        (layout.incomplete_dir(root, iteration) / RUN_CONFIG).write_text(OmegaConf.to_yaml(run_record))
        layout.publish(root, iteration)
        layout.prune(root, keep, protect=iteration)
    dist.barrier()


@contextmanager
def _results_in_this_process(async_save: bool):
    """megatron-core's torch_dist writer passes its write results through a multiprocessing Manager
    that it starts with "spawn" at a process's first save: a fresh interpreter that imports torch to
    unpickle them, 2 of the 2.3 s a tiny model's first save took on the CPU machine, and torch's
    import time again on every rank of every run (3.6-6.7 s on the GPU machine). A synchronous save
    writes and collects its results in this process, so for it an in-process queue does; an async
    save's writer runs in another process and keeps megatron-core's manager."""
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    if async_save or not hasattr(filesystem_async, "_results_queue"):  # megatron-core 0.16-0.19's cache
        yield
        return
    kept = filesystem_async._results_queue
    filesystem_async._results_queue = queue.Queue()
    try:
        yield
    finally:
        filesystem_async._results_queue = kept


def _async_strategy(async_save: bool) -> dict[str, str]:
    """megatron-core 0.19+ writes async saves with NVIDIA Resiliency Extension by default; use its own
    writer, which needs no extra package and whose requests AsyncCallsQueue schedules."""
    import inspect

    from megatron.core import dist_checkpointing

    if async_save and "async_strategy" in inspect.signature(dist_checkpointing.save).parameters:
        return {"async_strategy": "mcore"}
    return {}

