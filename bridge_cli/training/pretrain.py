"""pretrain(config, forward_step_func): set up, train, evaluate, tear down."""

from __future__ import annotations

import contextlib
import sys
from typing import Iterator

from bridge_cli.training.config import ConfigContainer
from bridge_cli.training.forward_step_func_types import ForwardStepCallable
from bridge_cli.training.state import GlobalState


def _describe(state: GlobalState, model: list) -> str:
    cfg, rt = state.cfg, state.runtime
    m = cfg.model
    params = sum(p.numel() for chunk in model for p in chunk.parameters())
    from bridge_cli.models.specs import default_spec_name

    spec = m.spec or default_spec_name()
    return (f"bridge: {rt.device.type} ({rt.backend}), world {rt.world_size} = TP {m.tensor_model_parallel_size} x "
            f"PP {m.pipeline_model_parallel_size} x CP {m.context_parallel_size} x DP {cfg.data_parallel_size}; "
            f"GPTModel {m.num_layers} layers, {params / 1e6:.2f}M parameters on rank {rt.rank} ({spec} spec); "
            f"{cfg.train.train_iters} iterations x {cfg.derived.global_batch_size} samples x {m.seq_length} tokens "
            f"({cfg.num_microbatches} micro-batches of {cfg.train.micro_batch_size})\n"
            + "\n".join(_layout(cfg, rt.world_size)))


def _layout(cfg: ConfigContainer, world_size: int) -> list[str]:
    import os

    from bridge_cli.runtime.parallel_layout import parallel_layout

    m = cfg.model
    per_node = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE", "").split("(")[0]
    return parallel_layout(world_size, m.tensor_model_parallel_size, m.pipeline_model_parallel_size,
                           m.context_parallel_size, m.expert_model_parallel_size,
                           m.virtual_pipeline_model_parallel_size, int(per_node) if per_node else None)


@contextlib.contextmanager
def run_session(config: ConfigContainer) -> Iterator[GlobalState]:
    """The ``GlobalState`` of one run of ``config``, validated; tears down loggers, megatron-core's
    global state and the process groups afterwards, however the run ends. pretrain(), finetune()
    and evaluation run inside one."""
    from megatron.core.num_microbatches_calculator import destroy_num_microbatches_calculator
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    from bridge_cli.runtime.distributed import destroy_distributed
    from bridge_cli.training import rerun

    config.validate()
    state = GlobalState(cfg=config)
    rerun.initialize(config.rerun_state_machine)
    try:
        yield state
    finally:
        state.fault_tolerance.close()
        if state.checkpoint_manager is not None:
            state.checkpoint_manager.close()
        if state.training_logger is not None:
            state.training_logger.close()
        destroy_num_microbatches_calculator()
        destroy_rerun_state_machine()
        destroy_distributed()


def pretrain(config: ConfigContainer, forward_step_func: ForwardStepCallable) -> None:
    """Train ``config``'s model with ``forward_step_func`` (any signature forward_step_func_types accepts).

    Evaluates on the validation split every ``train.eval_interval`` iterations and on the
    validation and test splits at the end. With ``checkpoint.save``, saves every
    ``checkpoint.save_interval`` iterations, before an early exit, and once more at the end, as the
    run's CheckpointManager decides. Exits the process only when the rerun state machine asks.
    """
    import torch

    from bridge_cli.runtime.errors import OutOfGPUMemory
    from bridge_cli.training.setup import setup
    from bridge_cli.training.train import _run_evaluation, train
    from bridge_cli.logging.training_logger import TrainingLogger
    from bridge_cli.runtime.collectives import is_last_rank
    from bridge_cli.training.objectives import check_pretrain_step

    check_pretrain_step(config.finetune.objective, forward_step_func)
    with run_session(config) as state:
        try:
            out = setup(state, checkpointing_context={})
        except torch.OutOfMemoryError as err:
            raise OutOfGPUMemory.during_setup(err, config.model, config.optimizer) from err
        if is_last_rank():
            print(_describe(state, out.model), flush=True)
            print(out.startup.summary(), flush=True)
        exit_code, manager = 0, state.checkpoint_manager
        if config.logger.log_progress and config.checkpoint.save:
            manager.start_job()
        if not config.train.skip_train:  # returns with its saves complete
            exit_code = train(forward_step_func, out.model, out.optimizer, out.scheduler, out.train_data_iterator,
                              out.valid_data_iterator, state, checkpointing_context=out.checkpointing_context)
        if exit_code:  # the rerun state machine's decision
            sys.exit(exit_code)
        if state.train_state.step < config.train.train_iters and not config.train.skip_train:
            return  # exit signal, exit_interval, exit_duration_in_mins: stop now, as Megatron-LM does
        if config.checkpoint.export_hf_dir and not config.checkpoint.export_hf_each_save \
                and manager.last_saved_step is not None:  # (with each_save, the final save has exported)
            from bridge_cli.convert.hf_training import export_checkpoint

            export_checkpoint(config.checkpoint, manager.last_saved_step)
        logger = state.training_logger = state.training_logger or TrainingLogger(state, out.model)
        for label, iterator in (("validation", out.valid_data_iterator), ("test", out.test_data_iterator)):
            if iterator is not None and config.train.eval_iters > 0:
                _run_evaluation(state, forward_step_func, iterator, out.model, logger,
                                f"{label} at the end of training (iteration {state.train_state.step})", split=label)
