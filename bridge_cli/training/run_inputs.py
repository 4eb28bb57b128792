"""What a command reads besides its config, checked before any work: finetune's starting checkpoint, teacher and
data, eval's checkpoint. A run checks them as it starts (finetune(), evaluate_checkpoint()); ``--dry-run`` asks here
after the validation pass, so that it refuses what the run would. Existence and format only: nothing is written."""

from __future__ import annotations

from bridge_cli.training.config import ConfigContainer


def check_run_inputs(config: ConfigContainer, command: str, resume: str = "never") -> None:
    """Raise the ConfigError (or CheckpointError) the ``command`` (pretrain, finetune or eval) would raise for its
    inputs; ``resume`` is the run's --resume, which may set checkpoint.load from checkpoint.save."""
    if command == "finetune":
        from bridge_cli.checkpoint.load import resolve_resume
        from bridge_cli.training.finetune import check_finetune_inputs

        check_finetune_inputs(config, resumes=resolve_resume(config.checkpoint, resume)[0] is not None)
    elif command == "eval":
        from bridge_cli.training.eval import checkpoint_to_evaluate

        checkpoint_to_evaluate(config)
