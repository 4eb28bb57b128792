"""TFLOP/s/gpu and MFU under DPO and distillation count what the GPU runs: DPO's two rows a pair and the
reference's forward pass, the teacher's forward at its own shape (a forward is a third of a training pass), against
hand counts on the shipped recipes."""

from __future__ import annotations

import pytest

from bridge_cli.models.flops import num_floating_point_operations
from bridge_cli.training.objective_flops import flops_per_sample
from tests.unit.test_objective_memory import teacher_folder, validated

# per token, 6 x (layers x (QKV + output projection + SwiGLU MLP) + output layer) + 6 x layers x q x seq at seq 4096
LLAMA8B_4096 = 6 * (32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336) + 4096 * 128256) \
    + 6 * 32 * 4096 * 4096
LLAMA1B_4096 = 8_219_787_264  # tests/unit/test_flops.py's llama1b (its recipe's seq_length is 4096)


def test_sft_counts_the_models_training_pass_alone():
    cfg = validated("tiny_sft")
    assert flops_per_sample(cfg) == num_floating_point_operations(cfg.derived.model, 1)


def test_an_8b_dpo_pair_counts_two_rows_each_trained_and_scored_by_the_reference():
    # chosen and rejected rows of 4096 tokens, each a training pass (6 per weight per token) and a forward (2)
    cfg = validated("llama8b_dpo_lora")
    assert flops_per_sample(cfg) == pytest.approx(2 * 4096 * LLAMA8B_4096 * 8 / 6, rel=1e-12)
    frozen_copy = validated("llama8b_dpo_lora", "~peft", "checkpoint.pretrained_checkpoint=unused")
    assert flops_per_sample(frozen_copy) == flops_per_sample(cfg)  # a forward of the same model either way


def test_a_packed_dpo_row_counts_once():
    cfg = validated("tiny_dpo", "dataset.packed_sequence_specs.packed_sequence_size=64")
    assert flops_per_sample(cfg) == pytest.approx(num_floating_point_operations(cfg.derived.model, 1) * 4 / 3)


def test_distillation_adds_the_teachers_forward_at_its_own_shape(tmp_path):
    cfg = validated("llama1b_distill", f"distill.teacher_checkpoint={teacher_folder(tmp_path, 'llama8b')}")
    # the 8B teacher runs at the student's seq_length (4096)
    expected = 4096 * LLAMA1B_4096 + 4096 * LLAMA8B_4096 / 3
    assert flops_per_sample(cfg) == pytest.approx(expected, rel=1e-12)
