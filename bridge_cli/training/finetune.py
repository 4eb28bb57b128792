"""finetune(config, forward_step_func): supervised fine-tuning, full or LoRA, from a pretrained checkpoint.

As in Megatron-Bridge, fine-tuning is pretraining with a starting point: the same setup, loop,
evaluation and checkpoints (see :func:`bridge_cli.training.pretrain.pretrain`). What differs
comes from the config:

- the weights come from ``checkpoint.pretrained_checkpoint`` (weights only, iteration 0), unless
  ``checkpoint.load`` holds a checkpoint of the fine-tuning run itself, which resumes;
- the data is usually ``dataset=finetune``: JSONL records whose loss falls on the answers only
  (:mod:`bridge_cli.data.sft`), reduced with the token-weighted loss of ``gpt_step.forward_step``;
- with ``peft=lora`` the base model is frozen, only the adapters train, and checkpoints hold the
  adapters alone plus the path of the base (:mod:`bridge_cli.peft.lora`);
- with ``finetune.objective=dpo`` the records are preference pairs (:mod:`bridge_cli.data.preference`)
  and the forward step is DPO's (:class:`bridge_cli.training.dpo_step.DPOForwardStep`) in place of the
  GPT step the command passes;
- with ``finetune.objective=distill`` the forward step is distillation's
  (:class:`bridge_cli.training.distill_step.DistillForwardStep`): a frozen teacher's logits train the model,
  which may then start from its random initialization instead of a pretrained checkpoint.
"""

from __future__ import annotations

from pathlib import Path

from bridge_cli.config.data_configs import FinetuningDatasetConfig
from bridge_cli.config.errors import ConfigError
from bridge_cli.training.config import ConfigContainer
from bridge_cli.training.forward_step_func_types import ForwardStepCallable


def finetune(config: ConfigContainer, forward_step_func: ForwardStepCallable) -> None:
    """Fine-tune ``config``'s model from ``checkpoint.pretrained_checkpoint`` (or resume ``checkpoint.load``)."""
    from bridge_cli.training.objectives import objective_forward_step
    from bridge_cli.training.pretrain import pretrain

    check_finetune_inputs(config)
    pretrain(config, objective_forward_step(config.finetune.objective, forward_step_func))


def check_finetune_inputs(config: ConfigContainer, resumes: bool = False) -> None:
    """Before any device work: a pretrained checkpoint to start from, and the training data. ``resumes``: a dry run's
    --resume auto will set checkpoint.load (the run sets it before it gets here)."""
    from bridge_cli.checkpoint.layout import require_checkpoint
    from bridge_cli.convert.hf_training import is_hf_folder

    ckpt = config.checkpoint
    distill = config.finetune.objective == "distill"  # a distilled model may start from its random initialization
    if ckpt.pretrained_checkpoint is None and ckpt.load is None and not resumes and not distill:
        raise ConfigError("checkpoint.pretrained_checkpoint", "is not set; fine-tuning starts from a pretrained model.",
                          "Set checkpoint.pretrained_checkpoint=DIR, a folder `bridge pretrain checkpoint.save=DIR` wrote.")
    if ckpt.pretrained_checkpoint is not None and not is_hf_folder(ckpt.pretrained_checkpoint):
        require_checkpoint(Path(ckpt.pretrained_checkpoint),
                           label=f"checkpoint.pretrained_checkpoint={ckpt.pretrained_checkpoint}")
    if config.finetune.objective == "dpo":
        from bridge_cli.training.dpo_step import check_reference

        check_reference(config)
    if distill:
        from bridge_cli.training.distill_step import check_teacher

        check_teacher(config)
    if isinstance(config.dataset, FinetuningDatasetConfig) and not config.train.skip_train:
        from bridge_cli.data.sft import dataset_root

        dataset_root(config.dataset)
