"""evaluate_checkpoint(config, forward_step_func): the loss and perplexity of a saved model.

Loads the weights of ``checkpoint.load`` (any tensor/pipeline layout it was saved with, resharded
to this config's; with ``peft=lora``, an adapter checkpoint on top of its base), or of a Hugging
Face folder given as ``checkpoint.load`` or ``checkpoint.pretrained_checkpoint`` (converted in
memory, its model section from config.json), and runs
``train.eval_iters`` global batches of the validation and the test split through
:func:`bridge_cli.training.train.evaluate`, on the CPU or GPUs. Each split is read from its first
sample, so every checkpoint is scored on the same batches: those the first validation of a
training run reads (later validations of that run move on through the split).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from bridge_cli.config.errors import ConfigError
from bridge_cli.training.config import ConfigContainer
from bridge_cli.training.forward_step_func_types import ForwardStepCallable


@dataclass
class EvalReport:
    """What ``bridge eval`` prints and writes as JSON."""

    checkpoint: str
    iteration: int
    eval_iters: int
    global_batch_size: int
    seq_length: int
    splits: dict[str, dict[str, float]] = field(default_factory=dict)
    """Per split ("validation", "test"): each reported loss and its perplexity ("lm loss", "lm loss PPL"); with
    finetune.objective=dpo, the DPO loss, rewards, margin and reward accuracy, without perplexities; with distill,
    the distillation loss and the KL to distill.teacher_checkpoint besides the lm loss."""


def evaluate_checkpoint(config: ConfigContainer, forward_step_func: ForwardStepCallable) -> Optional[EvalReport]:
    """Evaluate ``checkpoint.load``; the report on the last rank (which holds the losses), None on the others."""
    from bridge_cli.checkpoint.load import load_checkpoint
    from bridge_cli.convert.hf_training import converted_for_loading
    from bridge_cli.training.pretrain import run_session
    from bridge_cli.training.setup import adapter_policy, build_data_iterators, build_model, initialize
    from bridge_cli.training.train import evaluate
    from bridge_cli.logging.reports import is_cross_entropy, perplexity
    from bridge_cli.runtime.collectives import is_last_rank

    checkpoint, iteration = checkpoint_to_evaluate(config)
    # DPO: its loss, rewards and reward accuracy on preference pairs; distill: the KL to the teacher and the CE
    from bridge_cli.training.objectives import objective_forward_step

    forward_step_func = objective_forward_step(config.finetune.objective, forward_step_func)
    with run_session(config) as state:
        runtime = initialize(state)
        model = build_model(config, runtime)
        with converted_for_loading(config.checkpoint, runtime.local_rank) as pretrained:
            load_checkpoint(state, model, None, None, weights_only=True, adapters=adapter_policy(config),
                            pretrained=pretrained)
        batches = config.train.eval_iters * config.derived.global_batch_size
        _, valid, test = build_data_iterators(config, state, len(model), sizes=[0, batches, batches])
        report = EvalReport(checkpoint, iteration, config.train.eval_iters, config.derived.global_batch_size,
                            config.model.seq_length)
        if valid is None and test is None:
            raise ConfigError("dataset", "has no validation or test split to evaluate on.",
                              "Give the dataset a validation/test share (dataset.split) or files "
                              "(validation.jsonl, test.jsonl), with dataset.do_validation / do_test left on.")
        for split, iterator in (("validation", valid), ("test", test)):
            if iterator is None:
                continue
            losses, _ = evaluate(state, forward_step_func, iterator, model, config.train.eval_iters)
            # a perplexity for each cross entropy; DPO's loss, rewards and accuracy have none
            report.splits[split] = {name: value for key, loss in losses.items()
                                    for name, value in ((key, loss), (f"{key} PPL", perplexity(loss)))
                                    if name == key or is_cross_entropy(key)}
        return report if is_last_rank() else None


def checkpoint_to_evaluate(config: ConfigContainer) -> tuple[str, int]:
    """(what is scored, its iteration): checkpoint.load's checkpoint, or a Hugging Face folder's weights (0)."""
    from bridge_cli.checkpoint.layout import require_checkpoint
    from bridge_cli.convert.hf_training import is_hf_folder

    ckpt = config.checkpoint
    hf_weights = ckpt.load is None and is_hf_folder(ckpt.pretrained_checkpoint)
    if ckpt.load is None and not hf_weights:
        raise ConfigError("checkpoint.load", "is not set; it names the checkpoint to evaluate.",
                          "Set checkpoint.load=DIR (a folder `bridge pretrain checkpoint.save=DIR` wrote, one iter_* in "
                          "it, or a Hugging Face model folder).")
    if config.train.eval_iters < 1:
        raise ConfigError("train.eval_iters", f"is {config.train.eval_iters}; evaluation needs at least one batch.",
                          "Set train.eval_iters=N (N >= 1).")
    if hf_weights:
        return str(ckpt.pretrained_checkpoint), 0
    found = require_checkpoint(Path(ckpt.load), ckpt.ckpt_step, label=f"checkpoint.load={ckpt.load}")
    return str(found.path), found.iteration
