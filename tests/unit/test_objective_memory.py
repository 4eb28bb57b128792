"""The memory estimate under DPO and distillation (--dry-run --device cuda): DPO's two rows a pair and the reference's
frozen copy (none under LoRA), the teacher's weights at its own shape, distillation's logits, and the teacher's forward
pass as a peak of its own; the shipped GPU recipes fit one 80 GB GPU."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer
from bridge_cli.training.memory_estimate import (DISTILL_LOGIT_BYTES, FROZEN_OUTPUT_BYTES, _layer_parts, _stage,
                                                 estimate, estimate_memory, shape_of, with_changes)
from tests.unit.test_memory_estimate import TINY_PARAMS


def validated(recipe: str, *overrides: str) -> ConfigContainer:
    cfg = ConfigContainer.from_yaml_dict(compose(recipe, list(overrides)))
    cfg.validate(1, "cuda")
    return cfg


def teacher_folder(root: Path, recipe: str, **fields) -> Path:
    """A checkpoint folder as far as the teacher's shape is read: iter_0000000 with the recipe's model section (and
    ``fields``) in its run_config.yaml (no tensors: nothing here loads weights)."""
    folder = root / f"teacher_{recipe}" / "iter_0000000"
    folder.mkdir(parents=True)
    (folder / "metadata.json").write_text("{}")
    model = {**OmegaConf.to_container(compose(recipe, []).model, resolve=True), **fields}
    (folder / "run_config.yaml").write_text(OmegaConf.to_yaml({"model": model}))
    return folder.parent


def test_dpo_memory_counts_two_rows_a_pair_and_the_reference_copy_without_peft():
    lora = validated("tiny_dpo", "peft=lora")
    full = validated("tiny_dpo", "checkpoint.pretrained_checkpoint=unused")
    for cfg in (lora, full):
        shape = shape_of(cfg, 1)
        rows = estimate(with_changes(shape, objective="sft", rows=1, reference_copy=False,
                                     micro_batch=2 * shape.micro_batch, global_batch=2 * shape.global_batch))
        e = estimate(shape)
        assert (e.activations, e.logits) == (rows.activations, rows.logits)  # micro-batch 4 pairs: 8 rows
    lora_e, full_e = estimate_memory(lora, 1), estimate_memory(full, 1)
    assert lora_e.frozen_parameters == 0 and full_e.frozen_parameters == full_e.parameters
    assert full_e.weights == 2 * 4 * full_e.parameters  # fp32: the model and its frozen copy
    sft = estimate_memory(validated("tiny_sft", "model.seq_length=64", "peft=lora", "train.micro_batch_size=4"), 1)
    assert lora_e.weights == sft.weights  # the adapters off: no second copy


def test_distillation_memory_counts_the_teachers_weights_and_the_kls_logits(tmp_path):
    cfg = validated("tiny_distill", f"distill.teacher_checkpoint={teacher_folder(tmp_path, 'tiny', vocab_size=259)}")
    e = estimate_memory(cfg, 1)
    assert e.frozen_parameters == TINY_PARAMS - 1024 * 128 + 384 * 128  # tiny's, with the byte-level vocabulary
    assert e.weights == 4 * (e.parameters + e.frozen_parameters)  # fp32, the teacher unsharded and frozen
    assert e.logits == DISTILL_LOGIT_BYTES * 4 * 128 * 384  # micro-batch 4 of seq 128, vocabulary padded to 384
    unset = estimate_memory(validated("tiny_distill"), 1)
    assert unset.frozen_parameters == 0 and unset.weights == 4 * unset.parameters


def test_a_wide_teachers_forward_pass_can_set_the_peak(tmp_path):
    """The teacher's forward runs before the student's, one layer at a time: with a teacher far wider than the
    student, its layer and output are the peak, not the student's pass."""
    wide = teacher_folder(tmp_path, "tiny", vocab_size=259, hidden_size=4096, ffn_hidden_size=16384,
                          num_attention_heads=32, num_query_groups=8, kv_channels=128)
    cfg = validated("tiny_distill", f"distill.teacher_checkpoint={wide}")
    shape = shape_of(cfg, 1)
    teacher = with_changes(shape, **dict(shape.teacher), objective="sft", teacher=None)
    tokens = 4 * 128
    forward = sum(_layer_parts(teacher, False).values()) + FROZEN_OUTPUT_BYTES * tokens * shape.padded_vocab
    e = estimate(shape)
    assert e.activations + e.logits == forward
    student_only = estimate(with_changes(shape, teacher=None))
    assert student_only.activations + student_only.logits < forward


def test_dry_runs_of_the_gpu_recipes_fit_one_80_gb_gpu(cli, tmp_path):
    dpo = cli("finetune", "recipe=llama8b_dpo_lora", "--dry-run", "--device", "cuda", "--gpu-memory", "80")
    assert dpo.exit_code == 0, dpo.output
    for line in ("  weights: 15.0  # 8.03B parameters in bf16", "1 micro-batch of 1 pair (2 rows) in flight",
                 "  logits: 2.0  # 8192 tokens x 128256 entries", "  verdict: fits"):
        assert line in dpo.stdout, dpo.stdout[-1500:]
    teacher = teacher_folder(tmp_path, "llama8b")
    distill = cli("finetune", "recipe=llama1b_distill", f"distill.teacher_checkpoint={teacher}", "--dry-run",
                  "--device", "cuda", "--gpu-memory", "80")
    assert distill.exit_code == 0, distill.output
    for line in ("1.24B parameters in bf16, and the teacher's 8.03B (32 layers, hidden 4096)",
                 "  logits: 15.7  # 4096 tokens x 128256 entries: the teacher's and the model's fp32 logits",
                 "  verdict: fits"):
        assert line in distill.stdout, distill.stdout[-1500:]
    no_teacher = cli("finetune", "recipe=llama1b_distill", "--dry-run", "--device", "cuda")
    assert "the teacher not counted: distill.teacher_checkpoint is unset" in no_teacher.stdout


def test_pipeline_stages_hold_the_frozen_models_rows_they_receive_and_send(tmp_path):
    """Under PP each stage receives the reference's or teacher's hidden states behind the model's and sends its own
    on (frozen_pipeline.py), one tensor per micro-batch kept until that micro-batch's backward. By hand, fp32:
    tiny_dpo's 4 pairs are 8 rows of 64 tokens x hidden 128, and its global batch of 8 pairs 2 micro-batches; stage 0
    holds 2 in flight and only sends, stage 1 holds 1 and only receives."""
    def stages(recipe, world, *overrides):
        cfg = ConfigContainer.from_yaml_dict(compose(recipe, list(overrides)))
        cfg.validate(world, "cuda")
        shape = shape_of(cfg, world)
        return shape, [_stage(shape, rank) for rank in range(shape.pp)]

    row = 64 * 128 * 4  # one row of the model's width
    shape, (first, last) = stages("tiny_dpo", 2, "peft=lora", "model.pipeline_model_parallel_size=2")
    assert (first.frozen_rows_held, last.frozen_rows_held) == (2 * 8 * row, 1 * 8 * row)
    sft = with_changes(shape, objective="sft", rows=1, micro_batch=8, global_batch=16)  # the same 8 rows, no reference
    for rank, e in enumerate((first, last)):
        assert e.activations == _stage(sft, rank).activations + e.frozen_rows_held
    # two virtual stages of 2 layers on each rank: rank 0's chunks are stages 0 (sends) and 2 (receives, sends),
    # with 4 chunk-micro-batches of 2 in flight (2 in units of its layers); rank 1's are 1 (both) and 3 (receives),
    # with 3 (1.5)
    _, (first, last) = stages("tiny_dpo", 2, "peft=lora", "model.pipeline_model_parallel_size=2",
                              "model.virtual_pipeline_model_parallel_size=2", "model.num_layers=4")
    assert (first.frozen_rows_held, last.frozen_rows_held) == (3 * 2 * 8 * row, 3 * 1.5 * 8 * row)
    _, (single,) = stages("tiny_dpo", 1, "peft=lora")
    assert single.frozen_rows_held == 0

    # distillation: the teacher's hidden 96 over the student's 64: each micro-batch of 4 rows of 128 tokens carries
    # 4 x 96 / 64 = 6 more rows of 64
    teacher = teacher_folder(tmp_path, "tiny", vocab_size=259, hidden_size=96, ffn_hidden_size=384)
    row = 128 * 64 * 4
    _, (first, last) = stages("tiny_distill", 2, f"distill.teacher_checkpoint={teacher}", "model.num_layers=2",
                              "model.pipeline_model_parallel_size=2")
    assert (first.frozen_rows_held, last.frozen_rows_held) == (2 * 6 * row, 1 * 6 * row)
    assert all(e.activations >= e.frozen_rows_held > 0 for e in (first, last))


def test_the_dry_run_says_the_frozen_rows_between_stages_are_counted(cli):
    """llama8b_dpo_lora at PP=2, 2 pairs a micro-batch: stage 0 holds 2 micro-batches' 4 reference rows of 4,096
    tokens x 4,096 in bf16, 0.25 GiB."""
    result = cli("finetune", "recipe=llama8b_dpo_lora", "model.pipeline_model_parallel_size=2",
                 "train.micro_batch_size=2", "--world-size", "2", "--dry-run", "--device", "cuda", "--gpu-memory", "80")
    assert result.exit_code == 0, result.output
    assert ("2 micro-batches of 2 pairs (4 rows) in flight, no recompute, and the reference's rows between pipeline "
            f"stages ({2 * 4 * 4096 * 4096 * 2 / 2 ** 30:.1f})") in result.stdout, result.stdout[-1500:]
