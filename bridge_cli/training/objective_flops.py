"""Model FLOPs of one training sample under each ``finetune.objective``: what the GPU runs, which TFLOP/s/gpu and
MFU divide by the step's time.

megatron-core's formula (:func:`bridge_cli.models.flops.num_floating_point_operations`) counts a forward and a
backward pass of the model over a sequence, 2 + 4 FLOPs per weight per token, so a forward pass alone is a third
of it. On top of the model's own training pass:

- ``dpo``: an unpacked pair runs two rows (chosen, then rejected) and a packed row one, and the reference scores
  the same rows with a forward pass: a frozen copy of the model, or under ``peft`` the same model with its
  adapters off, the same FLOPs either way. So a pair costs 2 x (1 + 1/3) sequences of the model.
- ``distill``: the teacher's forward pass over the same tokens, at the teacher's own shape.

LoRA's adapters are not counted, and neither is the saving of frozen weights' gradients (the base weights'
backward still computes the activations' gradients): the model FLOPs of the full-parameter step, as is usual.
"""

from __future__ import annotations

from bridge_cli.models.flops import num_floating_point_operations

FORWARD_SHARE = 1 / 3
"""A forward pass's share of a training pass's FLOPs (2 of the 6 per weight per token)."""


def flops_per_sample(cfg, teacher_model=None) -> float:
    """FLOPs of one training sample of ``cfg`` (a validated ConfigContainer): the model's forward and backward
    over the rows the sample runs, plus the reference's or teacher's forward. ``teacher_model``: the teacher's
    GPTModelProvider under ``distill`` (default: read from ``distill.teacher_checkpoint``)."""
    from bridge_cli.data.preference import rows_per_sample

    model = num_floating_point_operations(cfg.derived.model, 1)
    objective = cfg.finetune.objective
    if objective == "dpo":
        return rows_per_sample(cfg) * model * (1 + FORWARD_SHARE)
    if objective == "distill":
        if teacher_model is None:
            from bridge_cli.training.distill_step import check_teacher, teacher_config

            teacher_model = teacher_config(cfg, check_teacher(cfg))
        return model + FORWARD_SHARE * num_floating_point_operations(teacher_model, 1)
    return model
