"""The training loop: train() runs train_step() until an exit condition, evaluating on schedule."""

from __future__ import annotations

import gc
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.distributed as dist

from bridge_cli.checkpoint.layout import checkpoint_dir
from bridge_cli.logging.nvrx_stragglers import start_nvrx_straggler_detection
from bridge_cli.logging.timers import timed
from bridge_cli.logging.training_logger import TrainingDiverged, TrainingLogger
from bridge_cli.training.forward_step_func_types import ForwardStepCallable
from bridge_cli.training.profiling import StepProfiler
from bridge_cli.runtime.collectives import is_last_rank, weights_match_across_dp_replicas
from bridge_cli.runtime.errors import OutOfGPUMemory
from bridge_cli.training import rerun
from bridge_cli.training.losses import grad_norm_is_finite, reduce_loss_dict
from bridge_cli.training.state import GlobalState
from bridge_cli.training.state_injection import prepare_forward_step_func
from bridge_cli.training.objective_flops import flops_per_sample
from bridge_cli.training.objectives import build_frozen_models, pipeline_micro_batch

if TYPE_CHECKING:
    from bridge_cli.checkpoint.manager import Decision


def train_step(forward_step_func: ForwardStepCallable, data_iterator, model: list, optimizer, scheduler,
               global_state: GlobalState):
    """One optimizer step over a global batch.

    Returns (loss_dict, skipped_iter, should_checkpoint, should_exit, exit_code, grad_norm,
    num_zeros_in_grad), as Megatron-Bridge's train_step does. ``loss_dict`` is empty off the last
    pipeline stage; its values are device tensors (no host sync here).
    """
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size, get_num_microbatches
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    from bridge_cli.runtime.schedules import get_forward_backward_func

    cfg = global_state.cfg
    forward_backward = get_forward_backward_func(global_state.runtime)
    rerun_state_machine = get_rerun_state_machine()
    runs = 0
    while rerun_state_machine.should_run_forward_backward(data_iterator):
        runs += 1
        for chunk in model:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        # megatron-core's schedules time themselves ("forward-backward" and below) through model.timers.
        losses_reduced = forward_backward(
            forward_step_func=forward_step_func,
            data_iterator=data_iterator,
            model=model,
            num_microbatches=get_num_microbatches(),
            seq_length=cfg.model.seq_length,
            micro_batch_size=pipeline_micro_batch(cfg),
            decoder_seq_length=cfg.model.seq_length,
            forward_only=False,
        )
    should_checkpoint, should_exit, exit_code = rerun_state_machine.should_checkpoint_and_exit()
    if should_exit:
        return {}, True, should_checkpoint, should_exit, exit_code, None, None
    went_on = rerun.went_on_line(global_state.train_state.step + 1, runs)
    if went_on:
        _say(went_on)

    with timed(global_state.timers, "optimizer", log_level=1, barrier=cfg.model.barrier_with_L1_time):
        update_successful, grad_norm, num_zeros_in_grad = optimizer.step()
    if update_successful:
        scheduler.step(increment=get_current_global_batch_size())
    if cfg.train.empty_unused_memory_level >= 1 and global_state.runtime.is_cuda:
        torch.cuda.empty_cache()
    loss_dict = reduce_loss_dict(losses_reduced) if parallel_state.is_pipeline_last_stage(ignore_virtual=True) else {}
    return loss_dict, int(not update_successful), should_checkpoint, should_exit, exit_code, grad_norm, num_zeros_in_grad


def evaluate(global_state: GlobalState, forward_step_func: ForwardStepCallable, data_iterator, model: list,
             eval_iters: int, process_non_loss_data_func: Optional[Callable] = None,
             non_loss_data_func: Optional[Callable] = None) -> tuple[dict[str, float], Any]:
    """Mean of each reported loss over ``eval_iters`` global batches, and any collected non-loss data."""
    from megatron.core import parallel_state
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size, get_num_microbatches

    from bridge_cli.runtime.schedules import get_forward_backward_func

    cfg = global_state.cfg
    forward_backward = get_forward_backward_func(global_state.runtime)
    step_func = prepare_forward_step_func(forward_step_func, global_state)
    build_frozen_models(forward_step_func, global_state)
    fb_args = dict(model=model, num_microbatches=get_num_microbatches(), seq_length=cfg.model.seq_length,
                   micro_batch_size=pipeline_micro_batch(cfg), decoder_seq_length=cfg.model.seq_length,
                   forward_only=True)
    for chunk in model:
        chunk.eval()
    if cfg.train.manual_gc and cfg.train.manual_gc_eval:
        gc.collect()
    totals: dict[str, torch.Tensor] = {}
    collected = None
    with torch.no_grad(), rerun.paused():
        for _ in range(eval_iters):
            with global_state.fault_tolerance.section("step"):
                losses = forward_backward(forward_step_func=step_func, data_iterator=data_iterator, **fb_args)
            if parallel_state.is_pipeline_last_stage(ignore_virtual=True):
                for key, value in reduce_loss_dict(losses).items():
                    totals[key] = totals.get(key, 0.0) + value
            global_state.train_state.consumed_valid_samples += get_current_global_batch_size()
        if process_non_loss_data_func is not None:
            if non_loss_data_func is not None:
                collected = non_loss_data_func(model)
            else:
                collected = forward_backward(forward_step_func=step_func, data_iterator=data_iterator,
                                             collect_non_loss_data=True, **fb_args)
    if cfg.train.manual_gc and cfg.train.manual_gc_eval:
        gc.collect()
    for chunk in model:
        chunk.train()
    return {key: float(value) / eval_iters for key, value in totals.items()}, collected


def post_training_step_callbacks(model: list, iteration: int, global_state: GlobalState) -> None:
    """Per-step housekeeping: manual GC, host/device sync, DP weight-hash check."""
    train_cfg = global_state.cfg.train
    if train_cfg.manual_gc and train_cfg.manual_gc_interval and iteration % train_cfg.manual_gc_interval == 0:
        gc.collect()
    if train_cfg.train_sync_interval and iteration % train_cfg.train_sync_interval == 0 and global_state.runtime.is_cuda:
        torch.cuda.synchronize()
    interval = train_cfg.check_weight_hash_across_dp_replicas_interval
    if interval and iteration % interval == 0:
        if not weights_match_across_dp_replicas(model, global_state.runtime.device):
            raise RuntimeError(f"iteration {iteration}: weights differ across data-parallel replicas.")


class ExitSignal:
    """Remembers which of ``signums`` arrived first; after the step, the checkpoint manager has the loop
    save and stop.

    Ctrl-C (SIGINT) among them says so; a second Ctrl-C exits at once (KeyboardInterrupt).
    """

    def __init__(self, *signums: int):
        self.signum: Optional[int] = None
        """The signal received, None until one arrives."""
        self._previous = {signum: signal.signal(signum, self._handle) for signum in dict.fromkeys(signums)}

    @property
    def received(self) -> bool:
        return self.signum is not None

    def _handle(self, signum, frame) -> None:
        if signum == signal.SIGINT and self.received:
            self.restore()
            raise KeyboardInterrupt
        self.signum = self.signum or signum
        if signum == signal.SIGINT and is_last_rank():
            print("\nCtrl-C: finishing this iteration, saving a checkpoint, then exiting "
                  "(Ctrl-C again exits at once, without saving).", file=sys.stderr, flush=True)

    def restore(self) -> None:
        for signum, previous in self._previous.items():
            signal.signal(signum, previous)


def should_disable_forward_pre_hook(use_megatron_fsdp: bool, use_distributed_optimizer: bool,
                                    overlap_param_gather: bool) -> bool:
    """Whether saving must pause the forward pre-hooks (distributed optimizer gathering params in the forward)."""
    return not use_megatron_fsdp and use_distributed_optimizer and overlap_param_gather


def enable_forward_pre_hook(model: list) -> None:
    for chunk in model:
        chunk.enable_forward_pre_hook()


def disable_forward_pre_hook(model: list, param_sync: bool = True) -> None:
    for chunk in model:
        chunk.disable_forward_pre_hook(param_sync=param_sync)


def save_checkpoint_and_time(state: GlobalState, model: list, optimizer, opt_param_scheduler,
                             num_floating_point_operations_so_far: float, checkpointing_context: dict[str, Any],
                             non_persistent_ckpt: bool = False, train_data_iterator=None) -> None:
    """Save a checkpoint of the current step through ``state.checkpoint_manager`` and print where and how long.

    ``num_floating_point_operations_so_far`` is what the checkpoint records as the FLOPs so far;
    the data position is the consumed-sample count, and ``train_data_iterator`` matters only to the
    rerun state machine (a step it will re-run). The model, optimizer and scheduler are the ones
    the manager was built with; the signature (``checkpointing_context`` included) is Megatron-Bridge's.
    """
    ddp = state.cfg.ddp
    toggle_hooks = should_disable_forward_pre_hook(ddp.use_megatron_fsdp, ddp.use_distributed_optimizer,
                                                   ddp.overlap_param_gather)
    if toggle_hooks:
        disable_forward_pre_hook(model)
    started = time.time()
    state.train_state.floating_point_operations_so_far = num_floating_point_operations_so_far
    with state.fault_tolerance.section("checkpointing"):
        path = state.checkpoint_manager.save(non_persistent=non_persistent_ckpt, data_iterator=train_data_iterator)
    if toggle_hooks:
        enable_forward_pre_hook(model)
    kind = "non-persistent checkpoint" if non_persistent_ckpt else "checkpoint"
    how = "started in the background" if state.cfg.checkpoint.async_save else "saved"
    _say(f"{kind} {path} {how} in {time.time() - started:.2f} s")
    if state.cfg.checkpoint.export_hf_each_save and not non_persistent_ckpt:
        from bridge_cli.convert.hf_training import export_checkpoint

        export_checkpoint(state.cfg.checkpoint, state.train_state.step)


def checkpoint_and_decide_exit(state: GlobalState, model: list, optimizer, opt_param_scheduler,
                               num_floating_point_operations_so_far: float, checkpointing_context: dict[str, Any],
                               train_data_iterator=None) -> bool:
    """Save when a checkpoint is due after this step; True when the loop must stop.

    Megatron-Bridge's per-step hook over ``state.checkpoint_manager``, which decides
    (:meth:`~bridge_cli.checkpoint.manager.CheckpointManager.after_step`: an exit signal,
    ``save_interval``, ``non_persistent_save_interval``, ``train.exit_duration_in_mins``,
    ``train.exit_interval``); this carries the decision out and says why the loop stops.
    """
    decision = _after_step(state)
    _carry_out(decision, state, model, optimizer, opt_param_scheduler, num_floating_point_operations_so_far,
               checkpointing_context, train_data_iterator)
    return decision.stop


def _after_step(state: GlobalState, rerun_stop: Optional[tuple[bool, int]] = None,
                stop_reason: Optional[str] = None) -> Decision:
    """The checkpoint manager's decision after this step (``rerun_stop``: the rerun state machine's
    should_checkpoint and exit code, where it stops the run; ``stop_reason``: why to save and stop, as
    NVRx's straggler detection asks)."""
    return state.checkpoint_manager.after_step(state.cfg.train, start_time=state.start_time,
                                               exit_signal=state.signal_handler, rerun_stop=rerun_stop,
                                               stop_reason=stop_reason)


def _carry_out(decision: Decision, state: GlobalState, model: list, optimizer, scheduler, flops: float,
               checkpointing_context: dict[str, Any], train_data_iterator) -> None:
    """Save as the checkpoint manager decided, then say why training stops, if it does."""
    if decision.save:
        save_checkpoint_and_time(state, model, optimizer, scheduler, flops, checkpointing_context,
                                 decision.non_persistent, train_data_iterator)
    if decision.exit_code:  # the rerun state machine's stop: its line names the checkpoint it asked for
        save_dir, step = state.cfg.checkpoint.save, state.train_state.step
        saved = checkpoint_dir(Path(save_dir), step) if decision.save else None
        _say(rerun.exit_line(decision.exit_code, step + 1, saved, save_dir))
    elif decision.reason:
        _say(decision.reason)


def _say(line: str) -> None:
    if is_last_rank():
        print(line, flush=True)


def _run_evaluation(global_state, forward_step_func, data_iterator, model, logger: TrainingLogger, label: str,
                    process_non_loss_data_func=None, non_loss_data_func=None, split: str = "validation") -> dict[str, float]:
    started = time.time()
    results, collected = evaluate(global_state, forward_step_func, data_iterator, model,
                                  global_state.cfg.train.eval_iters, process_non_loss_data_func, non_loss_data_func)
    if process_non_loss_data_func is not None and collected is not None:
        process_non_loss_data_func(collected, global_state.train_state.step, logger.writer.tensorboard)
    logger.validation(label, results, split)
    logger.exclude(time.time() - started)
    return results


def train(forward_step_func: ForwardStepCallable, model: list, optimizer, scheduler, train_data_iterator,
          valid_data_iterator, global_state: GlobalState, checkpointing_context: dict[str, Any],
          process_non_loss_data_func: Optional[Callable] = None, non_loss_data_func: Optional[Callable] = None) -> int:
    """Run training to ``train.train_iters`` or until the checkpoint manager stops it; returns the process
    exit code.

    After each step, ``global_state.checkpoint_manager`` decides whether to save and whether to stop,
    and once more when training ends (the last step, unless saved); train() carries its decisions
    out and returns once every save is complete.
    """
    from megatron.core.num_microbatches_calculator import get_current_global_batch_size, update_num_microbatches

    step_func = prepare_forward_step_func(forward_step_func, global_state)
    build_frozen_models(forward_step_func, global_state)
    cfg, ts, manager = global_state.cfg, global_state.train_state, global_state.checkpoint_manager
    train_cfg = cfg.train
    for chunk in model:
        chunk.train()
    if train_cfg.manual_gc:
        gc.disable()
        gc.collect()
    logger = global_state.training_logger = global_state.training_logger or TrainingLogger(global_state, model)
    sample_flops = flops_per_sample(cfg)  # with the reference's or teacher's forward pass (objective_flops.py)
    rerun.start_at(ts.step)
    profiler = StepProfiler(cfg.profiling, dist.get_rank(), global_state.runtime.is_cuda, cfg.logger.tensorboard_dir)
    stragglers = start_nvrx_straggler_detection(cfg.nvrx_straggler)
    straggler_stop = None
    exit_code = 0
    watched = ([train_cfg.exit_signal] if train_cfg.exit_signal_handler else []) + \
        ([signal.SIGINT] if cfg.checkpoint.save else [])  # Ctrl-C saves when there is somewhere to save
    if watched:
        global_state.signal_handler = ExitSignal(*watched)
    try:
        while ts.step < train_cfg.train_iters:
            update_num_microbatches(ts.consumed_train_samples, consistency_check=False)
            batch_size = get_current_global_batch_size()
            profiler.before_step(ts.step + 1)
            global_state.fault_tolerance.step_started()
            try:
                with stragglers.step():
                    loss_dict, skipped, should_checkpoint, should_exit, rerun_exit_code, grad_norm, num_zeros = \
                        train_step(step_func, train_data_iterator, model, optimizer, scheduler, global_state)
            except torch.OutOfMemoryError as err:
                raise OutOfGPUMemory.during_step(err, ts.step + 1, train_cfg, cfg.model, cfg.optimizer) from err
            if not should_exit:  # else the rerun state machine stops the run in the middle of the step, undone
                ts.step += 1
                ts.consumed_train_samples += batch_size
                ts.skipped_train_samples += skipped * batch_size
                flops = sample_flops * batch_size
                ts.floating_point_operations_so_far += flops
                if not grad_norm_is_finite(grad_norm) and not cfg.model.fp16:
                    raise TrainingDiverged(
                        f"iteration {ts.step}: the gradient norm is {grad_norm} (NaN/Inf loss or gradients). "
                        "Lower optimizer.lr, raise scheduler warmup, or check the data.")
                post_training_step_callbacks(model, ts.step, global_state)
                logger.after_step(loss_dict, skipped, grad_norm, num_zeros, optimizer, batch_size, flops)
                profiler.after_step(ts.step)
                straggler_stop = stragglers.after_step(ts.step, logger.writer)
            global_state.fault_tolerance.step_ended()  # the step's logging included; evaluation is timed per batch
            if (not should_exit and train_cfg.eval_interval and ts.step % train_cfg.eval_interval == 0
                    and valid_data_iterator is not None and train_cfg.eval_iters > 0):
                _run_evaluation(global_state, forward_step_func, valid_data_iterator, model, logger,
                                f"validation at iteration {ts.step}", process_non_loss_data_func, non_loss_data_func)
            checkpoint_started = time.time()
            decision = _after_step(global_state, (should_checkpoint, rerun_exit_code) if should_exit else None,
                                   straggler_stop)
            _carry_out(decision, global_state, model, optimizer, scheduler, ts.floating_point_operations_so_far,
                       checkpointing_context, train_data_iterator)
            if decision.stop:
                exit_code = decision.exit_code
                break
            logger.exclude(time.time() - checkpoint_started)
    finally:
        profiler.close()
        stragglers.close()
        if train_cfg.manual_gc:
            gc.enable()
        if global_state.signal_handler is not None:
            global_state.signal_handler.restore()
            global_state.signal_handler = None
    _carry_out(manager.at_end(), global_state, model, optimizer, scheduler, ts.floating_point_operations_so_far,
               checkpointing_context, train_data_iterator)
    manager.finalize(blocking=True)  # the saves are complete before the final evaluation, or the exit
    global_state.fault_tolerance.training_ended()
    return exit_code
