"""TFLOP/s/gpu and MFU count what the GPU runs (bridge_cli/models/flops.py, training/objective_flops.py): a full
training pass 6 FLOPs per multiply-add; under LoRA 4 for the frozen weights past the first adapter, the first
layer's QKV projection forward only, the adapters 6 but for the first one's input gradient; DPO's two rows a pair,
each with the reference's forward (2); the teacher's forward at its own shape. Hand counts on the tiny recipes
and the shipped GPU recipes; tests/integration/test_flops_measured.py checks the rule against autograd."""

from __future__ import annotations

import pytest

from bridge_cli.models.flops import num_floating_point_operations
from bridge_cli.training.objective_flops import flops_per_sample
from tests.unit.test_objective_memory import teacher_folder, validated

# per token, 6 x (layers x (QKV + output projection + SwiGLU MLP) + output layer) + 6 x layers x q x seq at seq 4096
LLAMA8B_4096 = 6 * (32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336) + 4096 * 128256) \
    + 6 * 32 * 4096 * 4096
LLAMA1B_4096 = 8_219_787_264  # tests/unit/test_flops.py's llama1b (its recipe's seq_length is 4096)


def tiny_counts(seq: int) -> dict[str, int]:
    """Multiply-adds per token of tiny_sft / tiny_dpo (2 layers, hidden 128, 4 heads of 32 in 2 query groups,
    SwiGLU FFN 512, vocabulary padded to 384, output layer tied) and of LoRA's default adapters (dim 32)."""
    qkv, proj, fc1, fc2 = 128 * (128 + 2 * 2 * 32), 128 * 128, 128 * 2 * 512, 512 * 128
    return {"qkv": qkv, "linears": 2 * (qkv + proj + fc1 + fc2), "attention": 2 * 128 * seq, "output": 128 * 384,
            # A (32 x in) and B (out x 32) on linear_qkv, linear_proj, linear_fc1, linear_fc2 of both layers
            "adapters": 2 * 32 * ((128 + 256) + (128 + 128) + (128 + 1024) + (512 + 128)), "first_a": 32 * 128}


def lora_pass(c: dict[str, int]) -> int:
    """A LoRA training pass per token: frozen weights forward + input gradient (4), but the first layer's QKV
    projection, whose input needs no gradient (2); attention 2 + 4; adapters 6, but the first A's input gradient."""
    return (4 * (c["linears"] + c["output"]) - 2 * c["qkv"] + 6 * c["attention"]
            + 6 * c["adapters"] - 2 * c["first_a"])


def forward_pass(c: dict[str, int]) -> int:
    return 2 * (c["linears"] + c["attention"] + c["output"])


def test_sft_counts_the_models_training_pass_alone():
    cfg = validated("tiny_sft")
    c = tiny_counts(128)
    assert flops_per_sample(cfg) == num_floating_point_operations(cfg.derived.model, 1) \
        == 128 * 6 * (c["linears"] + c["attention"] + c["output"])


def test_lora_counts_no_weight_gradient_for_the_frozen_weights():
    c = tiny_counts(128)
    assert flops_per_sample(validated("tiny_sft", "peft=lora")) == 128 * lora_pass(c)


def test_lora_on_the_mlp_alone_runs_the_first_attention_block_forward_only():
    cfg = validated("tiny_sft", "peft=lora", "peft.target_modules=[linear_fc1]")
    c = tiny_counts(128)
    qkv, proj, attention, fc1, fc2 = c["qkv"], 128 * 128, 128 * 128, 128 * 2 * 512, 512 * 128
    first = 2 * (qkv + attention + proj + fc1) + 4 * fc2  # layer 1: up to fc1 forward only, fc2 forward + dgrad
    second = 4 * (qkv + proj + fc1 + fc2) + 6 * attention
    adapters = 6 * 2 * 32 * (128 + 1024) - 2 * 32 * 128  # the first layer's A has no input gradient
    assert flops_per_sample(cfg) == 128 * (first + second + 4 * c["output"] + adapters)


def test_a_lora_dpo_pair_is_two_rows_each_a_lora_pass_and_the_references_forward():
    c = tiny_counts(64)
    assert flops_per_sample(validated("tiny_dpo", "peft=lora")) == 2 * 64 * (lora_pass(c) + forward_pass(c))
    # without peft the policy trains every weight; its frozen copy's forward is the same
    full = validated("tiny_dpo", "checkpoint.pretrained_checkpoint=unused")
    assert flops_per_sample(full) == 2 * 64 * (3 * forward_pass(c) + forward_pass(c))


def test_an_8b_lora_dpo_pair_by_hand():
    linears = 32 * (4096 * (4096 + 2 * 1024) + 4096 * 4096 + 3 * 4096 * 14336)
    attention, output = 32 * 4096 * 4096, 4096 * 128256
    adapters = 32 * 32 * ((4096 + 6144) + (4096 + 4096) + (4096 + 2 * 14336) + (14336 + 4096))
    lora = 4 * (linears + output) - 2 * 4096 * 6144 + 6 * attention + 6 * adapters - 2 * 32 * 4096
    forward = 2 * (linears + attention + output)
    cfg = validated("llama8b_dpo_lora")
    assert flops_per_sample(cfg) == 2 * 4096 * (lora + forward)
    # 77% of what the full-parameter count (the model's training pass, as before) gave it
    assert flops_per_sample(cfg) / (2 * 4096 * LLAMA8B_4096 * 8 / 6) == pytest.approx(0.7726, abs=1e-4)
    frozen_copy = validated("llama8b_dpo_lora", "~peft", "checkpoint.pretrained_checkpoint=unused")
    assert flops_per_sample(frozen_copy) == pytest.approx(2 * 4096 * LLAMA8B_4096 * 8 / 6, rel=1e-12)


def test_a_packed_dpo_row_counts_once():
    cfg = validated("tiny_dpo", "dataset.packed_sequence_specs.packed_sequence_size=64")
    assert flops_per_sample(cfg) == pytest.approx(num_floating_point_operations(cfg.derived.model, 1) * 4 / 3)


def test_distillation_adds_the_teachers_forward_at_its_own_shape(tmp_path):
    cfg = validated("llama1b_distill", f"distill.teacher_checkpoint={teacher_folder(tmp_path, 'llama8b')}")
    # the 8B teacher runs at the student's seq_length (4096)
    expected = 4096 * LLAMA1B_4096 + 4096 * LLAMA8B_4096 / 3
    assert flops_per_sample(cfg) == pytest.approx(expected, rel=1e-12)
