"""Which forward step each ``finetune.objective`` trains with: sft any next-token step (the GPT step),
dpo :class:`~bridge_cli.training.dpo_step.DPOForwardStep`, distill
:class:`~bridge_cli.training.distill_step.DistillForwardStep`. ``finetune()`` and ``bridge eval`` swap the GPT
step the command passes for the objective's; ``pretrain()`` refuses a step that would misread the data."""

from __future__ import annotations

from typing import Optional

from bridge_cli.config.errors import ConfigError
from bridge_cli.training.forward_step_func_types import ForwardStepCallable


def objective_step_type(objective: str) -> Optional[type]:
    """The forward step class an objective trains with (None: sft, any next-token step)."""
    if objective == "dpo":
        from bridge_cli.training.dpo_step import DPOForwardStep

        return DPOForwardStep
    if objective == "distill":
        from bridge_cli.training.distill_step import DistillForwardStep

        return DistillForwardStep
    return None


def build_frozen_models(forward_step_func: ForwardStepCallable, state) -> None:
    """Build the frozen model an objective's step holds beside the trained one (DPO's reference copy,
    distillation's teacher) on every rank at once, before a schedule runs: under pipeline parallelism a stage's
    first micro-batch waits on the stage before it, so a build there, whose checkpoint loading takes collectives
    over all ranks, would wait on ranks that wait on it."""
    step_type = objective_step_type(state.cfg.finetune.objective)
    if step_type is not None and isinstance(forward_step_func, step_type):
        forward_step_func.build_frozen(state)


def pipeline_micro_batch(cfg) -> int:
    """The batch dimension of the activations pipeline stages pass per micro-batch, which megatron-core's schedules
    size their receive buffers by: ``train.micro_batch_size`` rows, and for DPO and distillation the frozen model's
    rows beside them (:mod:`bridge_cli.training.frozen_pipeline`)."""
    if cfg.finetune.objective == "dpo":
        from bridge_cli.training.dpo_step import pipeline_rows

        return pipeline_rows(cfg)
    if cfg.finetune.objective == "distill":
        from bridge_cli.training.distill_step import pipeline_rows

        return pipeline_rows(cfg)
    return cfg.train.micro_batch_size


def objective_forward_step(objective: str, forward_step_func: ForwardStepCallable) -> ForwardStepCallable:
    """The objective's forward step, for the GPT step or one of that objective's given; another step is an
    error, not dropped."""
    from bridge_cli.training.gpt_step import forward_step

    step_type = objective_step_type(objective)
    if step_type is None or isinstance(forward_step_func, step_type):
        return forward_step_func
    if forward_step_func is not forward_step:
        given = getattr(forward_step_func, "__name__", forward_step_func)
        raise ConfigError("finetune.objective", f"is {objective}, which trains with {step_type.__name__}; finetune() "
                          f"was given another forward step ({given!r}).",
                          f"Pass {step_type.__module__}.{step_type.__name__}() (or gpt_step.forward_step), "
                          "or set finetune.objective=sft.")
    return step_type()


def check_pretrain_step(objective: str, forward_step_func: ForwardStepCallable) -> None:
    """dpo reads preference pairs and distill a teacher: only their own steps (finetune()'s) do that."""
    step_type = objective_step_type(objective)
    if step_type is not None and not isinstance(forward_step_func, step_type):
        raise ConfigError("finetune.objective", f"is {objective}, which bridge finetune trains; this forward step is "
                          f"not its {step_type.__name__}.", "Run bridge finetune, or set finetune.objective=sft.")
