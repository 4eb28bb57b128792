"""Model FLOPs of one training sample under each ``finetune.objective``: what the GPU runs, which TFLOP/s/gpu and
MFU divide by the step's time.

Each pass is counted as :mod:`bridge_cli.models.flops` describes: the model's training pass at 6 FLOPs per
multiply-add with every weight training, under ``peft`` (LoRA) 4 for the frozen base weights past the first
adapter plus the adapters' own matmuls; a forward pass without gradients at 2. On top of the model's own
training pass:

- ``dpo``: an unpacked pair runs two rows (chosen, then rejected) and a packed row one, and the reference scores
  the same rows with a forward pass: a frozen copy of the model, or under ``peft`` the same model with its
  adapters off, the same FLOPs either way. So a pair costs 2 x (training pass + forward pass) of a row.
- ``distill``: the teacher's forward pass over the same tokens, at the teacher's own shape.
"""

from __future__ import annotations

from bridge_cli.models.flops import forward_flops, training_flops


def flops_per_sample(cfg, teacher_model=None) -> float:
    """FLOPs of one training sample of ``cfg`` (a validated ConfigContainer): the model's forward and backward
    over the rows the sample runs, plus the reference's or teacher's forward. ``teacher_model``: the teacher's
    GPTModelProvider under ``distill`` (default: read from ``distill.teacher_checkpoint``)."""
    from bridge_cli.data.preference import rows_per_sample

    model = training_flops(cfg.derived.model, cfg.peft)
    objective = cfg.finetune.objective
    if objective == "dpo":
        return rows_per_sample(cfg) * (model + forward_flops(cfg.derived.model))
    if objective == "distill":
        if teacher_model is None:
            from bridge_cli.training.distill_step import check_teacher, teacher_config

            teacher_model = teacher_config(cfg, check_teacher(cfg))
        return model + forward_flops(teacher_model)
    return model
