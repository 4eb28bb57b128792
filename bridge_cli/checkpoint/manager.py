"""CheckpointManager: when a run saves and stops, and what it keeps between saves.

Built once per run from the checkpoint section and the run's model, optimizer, scheduler and
progress counters. It alone decides whether to save and whether to stop: after each step
(:meth:`CheckpointManager.after_step`: the rerun state machine, an exit signal, ``save_interval``,
``non_persistent_save_interval``, ``train.exit_duration_in_mins``, ``train.exit_interval``) and once
training ends (:meth:`CheckpointManager.at_end`: the last step, unless saved). The loop carries its
:class:`Decision` out. Saves go through :func:`bridge_cli.checkpoint.save.write_checkpoint`; the
manager owns the state saving needs across the run: the cached save plan, the async queue, which
folders had their interrupted saves cleared, the last saved step and the progress log
(``logger.log_progress``).

It also guards the folder: one run at a time per ``checkpoint.save`` (:mod:`folder_lock`), a
save that fails (disk full, read-only, permissions) stops the run naming the folder, the cause and
the checkpoint that still loads, and a save that would not fit in the free space (the size of the
last one) is refused before it starts.
"""

from __future__ import annotations

import shutil
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch.distributed as dist

from bridge_cli.checkpoint import folder_lock, layout, state_dict
from bridge_cli.checkpoint.adapters import AdapterPolicy
from bridge_cli.checkpoint.errors import FolderInUse, SaveFailed
from bridge_cli.checkpoint.save import save_root, write_checkpoint
from bridge_cli.runtime.collectives import on_any_rank

if TYPE_CHECKING:
    from bridge_cli.config.loop_configs import TrainingConfig


@dataclass(frozen=True)
class Decision:
    """What the run does now, as the CheckpointManager decides: after a step, or once training ends."""

    save: bool = False
    """Save the current step (always False without checkpoint.save)."""
    non_persistent: bool = False
    """Save it into the non-persistent folder (checkpoint.non_persistent_save_interval), not checkpoint.save."""
    stop: bool = False
    """Training stops here."""
    exit_code: int = 0
    """The process's exit code; not 0 only where the rerun state machine stops the run (16, 17)."""
    reason: Optional[str] = None
    """The line that says why training stops; None for the rerun state machine, whose line the loop writes
    (it names the checkpoint saved, and the machine's state says what to do)."""


class CheckpointManager:
    def __init__(self, cfg, *, model: list, optimizer, scheduler, train_state, run_record: dict[str, Any],
                 use_distributed_optimizer: bool, is_cuda: bool, world_size: int, seq_length: int,
                 adapters: Optional[AdapterPolicy] = None):
        self.cfg = cfg
        self.model, self.optimizer, self.scheduler, self.train_state = model, optimizer, scheduler, train_state
        self.run_record = run_record
        self.metadata = state_dict.content_metadata(use_distributed_optimizer, cfg)
        self.is_cuda, self.world_size, self.seq_length = is_cuda, world_size, seq_length
        self.adapters = adapters
        self.base_checkpoint: Optional[str] = None
        """The base model adapter checkpoints name (set once loading has found it)."""
        self.last_saved_step: Optional[int] = None
        """The last step saved to checkpoint.save (non-persistent saves do not count)."""
        self._strategy = None
        self._async_queue = None
        self._cleared: set[Path] = set()
        self._job_start: Optional[tuple[float, float]] = None
        self._last_size = 0
        self._locked = False
        self._trained = False
        self._rerun_stopped = False
        if cfg.save:
            self._lock()

    def close(self) -> None:
        """Give the folder's lock back (however the run ended; train() has finished the saves)."""
        if self._locked:
            folder_lock.release(Path(self.cfg.save))
            self._locked = False

    def _lock(self) -> None:
        refused = None
        if dist.get_rank() == 0:
            try:
                for note in folder_lock.acquire(Path(self.cfg.save)):
                    print(f"checkpoint: {note}", flush=True)
                self._locked = True
            except FolderInUse as err:
                refused = err
        if on_any_rank(refused is not None):
            raise refused or FolderInUse(f"checkpoint.save={self.cfg.save}: another run holds this folder (see rank 0).")

    def after_step(self, train_cfg: "TrainingConfig", *, start_time: float, exit_signal=None,
                   rerun_stop: Optional[tuple[bool, int]] = None, stop_reason: Optional[str] = None) -> Decision:
        """Whether to save ``train_state.step`` and whether to stop; one call per step, on every rank.

        In order: the rerun state machine stopping the run in the middle of the next step
        (``rerun_stop``, its should_checkpoint and exit code: save the step before it if it asks);
        an exit signal that arrived on any rank (``exit_signal``, the loop's handler with the
        ``signum`` received or None; None when the run watches no signal): save, stop; ``stop_reason``, the
        same on every rank (NVRx's straggler detection with stop_if_detected): save, stop; a save due at
        ``save_interval`` (persistent), else at ``non_persistent_save_interval``; then
        ``train.exit_duration_in_mins`` since ``start_time`` and ``train.exit_interval``, which save
        first unless this step does already. Saving needs ``checkpoint.save``.
        """
        self.finalize(blocking=False)
        step, save = self.train_state.step, bool(self.cfg.save)
        if rerun_stop is not None:
            should_checkpoint, exit_code = rerun_stop
            self._rerun_stopped = True
            return Decision(save=save and should_checkpoint, stop=True, exit_code=exit_code)
        self._trained = True
        if exit_signal is not None and on_any_rank(exit_signal.signum is not None):
            name = signal.Signals(exit_signal.signum).name if exit_signal.signum else "a signal on another rank"
            return Decision(save=save, stop=True, reason=f"exiting at iteration {step}: received {name}")
        if stop_reason:
            return Decision(save=save, stop=True, reason=stop_reason)
        due = self._due(step)
        minutes = train_cfg.exit_duration_in_mins
        if minutes and on_any_rank(time.time() - start_time > minutes * 60):
            return Decision(save=save, non_persistent=due.non_persistent, stop=True,
                            reason=f"exiting at iteration {step}: train.exit_duration_in_mins={minutes} reached")
        if train_cfg.exit_interval and step % train_cfg.exit_interval == 0:
            return Decision(save=save, non_persistent=due.non_persistent, stop=True,
                            reason=f"exiting at iteration {step} (train.exit_interval={train_cfg.exit_interval})")
        return due

    def at_end(self) -> Decision:
        """Once training has stopped, however it did: save its last step, unless this run trained none,
        that step is saved already, or the rerun state machine stopped the run (it asked for the
        checkpoint it needs)."""
        step = self.train_state.step
        save = bool(self.cfg.save) and self._trained and not self._rerun_stopped and self.last_saved_step != step
        return Decision(save=save, stop=True)

    def _due(self, step: int) -> Decision:
        """A save at ``save_interval`` (persistent), else at ``non_persistent_save_interval``."""
        if not self.cfg.save:
            return Decision()
        if self.cfg.save_interval and step % self.cfg.save_interval == 0:
            return Decision(save=True)
        if self.cfg.non_persistent_save_interval and step % self.cfg.non_persistent_save_interval == 0:
            return Decision(save=True, non_persistent=True)
        return Decision()

    def save(self, non_persistent: bool = False, data_iterator=None) -> Path:
        """Save model, optimizer, scheduler, RNG and progress at the current step, and the rerun state
        machine's state (with ``data_iterator``, the training data's, for a step it will re-run);
        returns the folder."""
        ckpt, step = self.cfg, self.train_state.step
        root = save_root(ckpt, non_persistent)
        select = self.adapters.is_adapter_key if self.adapters else None
        sharded = state_dict.build(self.train_state, self.model, self.optimizer, self.scheduler, metadata=self.metadata,
                                   optim=ckpt.save_optim and self.optimizer is not None, rng=ckpt.save_rng,
                                   is_cuda=self.is_cuda, select=select)
        sharded.update(state_dict.rerun_state(data_iterator))
        if self.adapters:
            sharded["peft"] = self.adapters.entry(self.base_checkpoint)
        self._check_free_space(root, step)
        try:
            path, request = write_checkpoint(root, step, sharded, self.run_record, content_metadata=self.metadata,
                                             strategy=self._save_strategy(), async_save=ckpt.async_save,
                                             keep=1 if non_persistent else ckpt.most_recent_k,
                                             clear_interrupted=root not in self._cleared)
        except BaseException as err:  # torch's checkpoint writer raises CheckpointException, a BaseException
            if isinstance(err, (KeyboardInterrupt, SystemExit)):
                raise
            raise SaveFailed(f"saving iteration {step} into {root} failed: {_failure(root, step, err)} "
                             f"{_still_loads(root)}") from err
        self._cleared.add(root)
        if dist.get_rank() == 0 and request is None:
            self._last_size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        if request is not None:
            self._queue().schedule_async_request(request)
        if not non_persistent:
            self.last_saved_step = step
            self._log_saved()
        return path

    def finalize(self, blocking: bool) -> None:
        """Publish the async saves that have finished on every rank (all of them when ``blocking``)."""
        if self._async_queue is None:
            return
        self._async_queue.maybe_finalize_async_calls(blocking=blocking)
        if blocking:
            self._async_queue.close()
            self._async_queue = None

    def start_job(self) -> None:
        """With logger.log_progress: a 'Starting job' line in checkpoint.save/progress.txt."""
        from bridge_cli.logging.progress_log import append_to_progress_log

        append_to_progress_log(self.cfg.save, "Starting job", self.world_size)
        self._job_start = (time.time(), self.train_state.floating_point_operations_so_far)

    def _log_saved(self) -> None:
        if self._job_start is None:
            return
        from bridge_cli.logging.progress_log import log_saved_checkpoint

        ts, (job_start, flops_at_job_start) = self.train_state, self._job_start
        log_saved_checkpoint(self.cfg.save, ts.step, ts.consumed_train_samples * self.seq_length,
                             ts.floating_point_operations_so_far, flops_at_job_start, job_start, self.world_size)

    def _check_free_space(self, root: Path, step: int) -> None:
        """Refuse a save that cannot fit: the last one's size, against the free space of the folder."""
        short = None
        if dist.get_rank() == 0 and self._last_size:
            free = shutil.disk_usage(root if root.exists() else root.parent).free
            if free < self._last_size * 1.05:
                short = (f"saving iteration {step} into {root} needs about {_size(self._last_size)} (the size "
                         f"of the last checkpoint) and {_size(free)} are free. {_still_loads(root)} Free "
                         "space, lower checkpoint.most_recent_k, or point checkpoint.save elsewhere and resume.")
        if on_any_rank(short is not None):
            raise SaveFailed(short or f"saving iteration {step} into {root}: no room on rank 0's disk (see rank 0).")

    def _save_strategy(self):
        """torch_dist, with the writing spread over data-parallel ranks unless fully_parallel_save is off.

        Kept for the whole run, as Megatron-LM does: with ckpt_assume_constant_structure it caches
        the save plan of the first save and skips planning afterwards.
        """
        if self._strategy is None:
            from megatron.core import parallel_state as ps
            from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
            from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

            constant = self.cfg.ckpt_assume_constant_structure
            strategy = TorchDistSaveShardedStrategy("torch_dist", 1, cached_metadata=constant)
            if self.cfg.fully_parallel_save and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
                strategy = FullyParallelSaveStrategyWrapper(strategy, ps.get_data_parallel_group(with_context_parallel=True),
                                                            constant)
            self._strategy = strategy
        return self._strategy

    def _queue(self):
        if self._async_queue is None:
            from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

            self._async_queue = AsyncCallsQueue(persistent=self.cfg.use_persistent_ckpt_worker)
        return self._async_queue


def _failure(root: Path, step: int, err: BaseException) -> str:
    """Why ``step``'s save into ``root`` failed, naming a full disk as one (torch's writers report a short
    write as "unexpected pos ..."); rank 0 removes the partial folder, freeing what it took."""
    reason, partial = _reason(err), layout.incomplete_dir(root, step)
    written = sum(f.stat().st_size for f in partial.rglob("*") if f.is_file()) if partial.is_dir() else 0
    usage = shutil.disk_usage(root) if root.is_dir() else None
    if dist.get_rank() == 0:
        shutil.rmtree(partial, ignore_errors=True)
    full = usage is not None and usage.free < max(64 * 2**20, usage.total / 100)
    if "No space left" in reason or full:
        free = f"{_size(usage.free)} free " if usage is not None else ""
        return (f"the device holding it is full ({free}after writing {_size(written)} of this checkpoint; "
                f"{reason}). The partial save was removed. Free space, lower checkpoint.most_recent_k, or point "
                "checkpoint.save elsewhere and resume.")
    return f"{reason}. The partial save was removed. Check the free space and permissions there."


def _size(nbytes: float) -> str:
    return f"{nbytes / 2**30:.2f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def _reason(err: BaseException) -> str:
    """The operating system's words for a failed save where torch and megatron-core kept them, else the
    first line of what they raised."""
    seen, first = set(), err
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError):
            return f"{err.strerror or err}{f' ({err.filename})' if err.filename else ''}"
        nested = [e for e in getattr(err, "failures", {}).values() if isinstance(e, BaseException)]  # torch DCP
        err = err.__cause__ or err.__context__ or (nested[0] if nested else None)
    return (str(first).strip().splitlines() or [type(first).__name__])[-1][:300]


def _still_loads(root: Path) -> str:
    tracked = layout.read_tracker(root) if root.is_dir() else None
    return (f"The previous checkpoint ({layout.iter_name(int(tracked))}) is still the one that loads."
            if tracked and tracked.isdigit() else "No earlier checkpoint is there.")
