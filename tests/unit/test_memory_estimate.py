"""The memory estimate per GPU (docs/parallelism.md#memory-per-gpu): its arithmetic on small configs against
hand counts, what `--dry-run --device cuda` and `bridge config validate` print and exit with, and the docs'
table of estimates against measured peaks as the dry run prints them."""

from __future__ import annotations

import math
import re
import shlex

import pytest

from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer
from bridge_cli.training.memory_estimate import GIB, estimate, estimate_memory, shape_of, with_changes
from tests.conftest import REPO
from tests.doc_text import section
from tests.recipe_layouts import LLAMA8B_DISTRIBUTED_OPTIMIZER
from tests.unit.test_cli_errors import assert_user_error

# tiny: 2 layers, hidden 128, SwiGLU FFN 512, 4 heads of 32 channels, 2 key/value groups, vocabulary 1024 (tied
# embedding), RMSNorm, no biases, fp32, seq 128, micro-batch 4, global batch 8.
TINY_LAYER = (128 * (4 + 2 * 2) * 32 + 128 * 128 + 128  # QKV, output projection, input norm
              + 128 + 128 * 2 * 512 + 512 * 128)  # pre-MLP norm, gated fc1, fc2
TINY_PARAMS = 1024 * 128 + 2 * TINY_LAYER + 128  # embedding (also the output layer), layers, final norm
TOKENS = 4 * 128
TINY_LAYER_ACTIVATIONS = TOKENS * 4 * (2 * 128 + 2 * 128  # the two norms' inputs and outputs
                                       + 32 * (4 + 2 * 2)  # queries, keys, values
                                       + 2 * 128  # attention output: SDPA's own and the projection's copy
                                       + 3 * 512)  # fc1's two halves and fc2's input
TINY_HEAD = TOKENS * 4 * 2 * 128  # the final norm's input and output
TINY_LOGITS = TOKENS * 1024 * (4 + 4)  # megatron-core's loss: the fp32 softmax next to the fp32 logits
LLAMA8B_ON_8 = ("pretrain", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, "--dry-run", "--device", "cuda",
                "--world-size", "8", "--gpu-memory", "80")
LLAMA8B_ON_2 = ("pretrain", "recipe=llama8b", "--dry-run", "--device", "cuda", "--world-size", "2",
                "--gpu-memory", "80")


def validated(recipe: str, *overrides: str, world: int = 1) -> ConfigContainer:
    cfg = ConfigContainer.from_yaml_dict(compose(recipe, ["model.spec=torch", *overrides]))
    cfg.validate(world, "cuda")
    return cfg


def test_tiny_weights_gradients_and_adam_state_by_hand():
    e = estimate_memory(validated("tiny"), 1)
    assert e.parameters == TINY_PARAMS == 623_232
    assert e.weights == e.gradients == 4 * TINY_PARAMS  # fp32 weights and gradients
    assert e.optimizer_state == 8 * TINY_PARAMS and e.main_weights == 0  # Adam's two moments; fp32 needs no main copy
    assert e.allowance == 2 * GIB  # one GPU: no NCCL


def test_tiny_activations_and_logits_by_hand():
    e = estimate_memory(validated("tiny"), 1)
    assert TINY_LAYER_ACTIVATIONS == 5_242_880
    assert e.logits == TINY_LOGITS
    # both layers and the head; a layer's backward needs more than the spent logits freed
    assert e.activations == 2 * TINY_LAYER_ACTIVATIONS + TINY_HEAD + (TINY_LAYER_ACTIVATIONS - TINY_LOGITS)


def test_full_recompute_keeps_each_layer_input_and_rebuilds_one_layer():
    e = estimate_memory(validated("tiny", "model.recompute_granularity=full", "model.recompute_method=uniform",
                                  "model.recompute_num_layers=1"), 1)
    layer_input = TOKENS * 4 * 128
    rebuilt = 2 * TINY_LAYER_ACTIVATIONS  # the recomputed layer and its gradients
    assert e.activations == 2 * layer_input + TINY_HEAD + (rebuilt - TINY_LOGITS)


def test_selective_recompute_drops_what_its_modules_rebuild():
    plain = estimate_memory(validated("tiny"), 1)
    norms = estimate_memory(validated("tiny", "model.recompute_granularity=selective",
                                      "model.recompute_modules=[layernorm]"), 1)
    assert plain.activations - norms.activations == 2 * TOKENS * 4 * 2 * 128  # each layer's two norm outputs
    attention = estimate_memory(validated("tiny", "model.recompute_granularity=selective"), 1)  # core_attn
    assert plain.activations - attention.activations == 2 * TOKENS * 4 * 128  # SDPA's own output: no scores to drop


def test_bf16_adam_state_is_sharded_over_data_parallel_ranks_by_the_distributed_optimizer():
    bf16 = ["mixed_precision=bf16_mixed", "optimizer.use_distributed_optimizer=true", "train.global_batch_size=16"]
    one, four = estimate_memory(validated("tiny", *bf16), 1), estimate_memory(validated("tiny", *bf16, world=4), 4)
    assert one.weights == 2 * TINY_PARAMS and one.gradients == 4 * TINY_PARAMS  # bf16 weights, fp32 grad buffer
    assert one.optimizer_state == 12 * TINY_PARAMS and one.main_weights == 4 * TINY_PARAMS
    assert four.optimizer_state == 12 * TINY_PARAMS / 4 and four.weights == one.weights
    assert four.allowance == 3 * GIB  # NCCL
    whole = estimate_memory(validated("tiny", *bf16[:1], "train.global_batch_size=16", world=4), 4)
    assert whole.optimizer_state == 12 * TINY_PARAMS


def test_sgd_keeps_one_moment_and_none_without_momentum():
    sgd = estimate_memory(validated("tiny", "optimizer=sgd", "mixed_precision=bf16_mixed"), 1)
    assert sgd.optimizer_state == (4 + 4) * TINY_PARAMS  # fp32 main weights and momentum
    plain = estimate_memory(validated("tiny", "optimizer=sgd", "mixed_precision=bf16_mixed",
                                      "optimizer.sgd_momentum=0"), 1)
    assert plain.optimizer_state == 4 * TINY_PARAMS


def test_expert_weights_and_state_shard_over_the_expert_parallel_and_expert_data_parallel_groups():
    # tiny_moe: layer 0 dense, layers 1-3 MoE with 8 experts (SwiGLU, FFN 128), top-2, one shared expert of 128
    expert = 128 * 2 * 128 + 128 * 128
    moe_layer = (TINY_LAYER - 128 * 2 * 512 - 512 * 128) + 8 * 128 + expert + 8 * expert  # router, shared, experts
    params = 1024 * 128 + TINY_LAYER + 3 * moe_layer + 128
    one = estimate_memory(validated("tiny_moe"), 1)
    assert one.parameters == params == 1_855_616
    flags = ["mixed_precision=bf16_mixed", "optimizer.use_distributed_optimizer=true", "train.global_batch_size=16",
             "model.expert_model_parallel_size=2"]
    ep = estimate_memory(validated("tiny_moe", *flags, world=4), 4)
    experts_here = 3 * 4 * expert  # 4 of the 8 experts on each rank
    dense = params - 3 * 8 * expert
    assert ep.parameters == dense + experts_here
    # dense state over 4 data-parallel ranks, expert state over world / EP = 2 expert data-parallel ranks
    assert ep.optimizer_state == 12 * (dense / 4 + experts_here / 2)


def test_moe_activations_by_hand_with_rows_for_the_most_pairs_a_rank_can_get():
    """bridge's dispatch gathers the EP group's tokens: each may send min(top-k, local experts) rows to a rank."""
    attention = TOKENS * 4 * (4 * 128 + 32 * 8 + 2 * 128)  # norms, queries/keys/values, attention output twice
    router = TOKENS * 12 * 8  # fp32 logits, probabilities and scores of 8 experts
    shared = TOKENS * 4 * 3 * 128  # the shared expert's fc1 halves and fc2 input
    per_row = 4 * (128 + 2 * 128 + 128)  # a routed row, its fc1 halves and its fc2 input

    def activations(ep: int, rows: int = 0) -> int:
        moe_layer = attention + router + shared + (rows or TOKENS * ep * min(2, 8 // ep)) * per_row
        return TINY_LAYER_ACTIVATIONS + 3 * moe_layer + TINY_HEAD + max(TINY_LAYER_ACTIVATIONS, moe_layer) - TINY_LOGITS

    shape = shape_of(validated("tiny_moe"), 1)
    assert estimate(shape).activations == activations(1)
    assert estimate(with_changes(shape, ep=2, world=2)).activations == activations(2)
    # a capacity factor of 0.5: each rank sends each expert at most ceil(TOKENS x 2 / 8 x 0.5) pairs, so EP=2's rank
    # (4 experts) gets at most 2 x 4 x that rows, the expected count, not the most there can be
    capped = with_changes(shape, ep=2, world=2, capacity_factor=0.5)
    rows = 2 * 4 * math.ceil(TOKENS * 2 / 8 * 0.5)
    assert rows < TOKENS * 2 * 2
    assert estimate(capped).activations == activations(2, rows)


FP8 = ("mixed_precision=bf16_with_fp8_current_scaling_mixed",)


@pytest.mark.parametrize("overrides, kept_bf16", [
    ((), {0, 31}),  # the preset's first and last layers (megatron-core's is_first_last_bf16_layer)
    (("model.first_last_layers_bf16=false",), set()),
    (("model.num_layers_at_start_in_bf16=3", "model.num_layers_at_end_in_bf16=2"), {0, 1, 2, 30, 31}),
])
def test_fp8_layers_keep_the_measured_share_of_their_activations(overrides, kept_bf16):
    """Tensor-wise FP8, compiled (the preset): each FP8 layer's saved activations are FP8_LAYER_ACTIVATIONS of its
    bf16 ones, the layers megatron-core keeps in bf16 are counted in full; the backward's working set and the rest of
    the estimate do not change."""
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    from bridge_cli.training.memory_estimate import FP8_LAYER_ACTIVATIONS

    from bridge_cli.training.memory_estimate import _saved

    cfg = validated("llama8b", "train.global_batch_size=16", *FP8, *overrides, world=4)
    shape = shape_of(cfg, 4)
    assert {i for i, fp8 in enumerate(shape.fp8_layers) if not fp8} == kept_bf16
    assert all(is_first_last_bf16_layer(cfg.model, i) == (i in kept_bf16) for i in range(32))
    bf16, fp8 = estimate(with_changes(shape, fp8_layers=())), estimate(shape)
    assert fp8.weights == bf16.weights and fp8.logits == bf16.logits
    drop = bf16.activations - fp8.activations
    assert drop == pytest.approx((32 - len(kept_bf16)) * (1 - FP8_LAYER_ACTIVATIONS) * _saved(shape, False), rel=1e-9)


@pytest.mark.parametrize("overrides", [("mixed_precision=bf16_with_fp8_rowwise_mixed",),
                                       (*FP8, "model.compile_layers=false")], ids=["rowwise", "eager"])
def test_fp8_is_counted_as_bf16_where_it_was_not_measured(overrides):
    cfg = validated("llama8b", "train.global_batch_size=16", *overrides, world=4)
    assert not any(shape_of(cfg, 4).fp8_layers)


def test_micro_batches_in_flight_on_the_first_pipeline_stage():
    pipeline = ["model.num_layers=8", "train.global_batch_size=32"]  # 8 micro-batches of 4
    plain = estimate_memory(validated("tiny", *pipeline, "model.pipeline_model_parallel_size=4", world=4), 4)
    assert plain.stage == 0 and plain.micro_batches_in_flight == 4 and plain.layers == 2
    interleaved = estimate_memory(validated("tiny", *pipeline, "model.pipeline_model_parallel_size=4",
                                            "model.virtual_pipeline_model_parallel_size=2", world=4), 4)
    # megatron-core's interleaved warm-up on stage 0: (PP - 1) x 2 + (VPP - 1) x PP model chunks, then one more
    assert interleaved.micro_batches_in_flight == ((4 - 1) * 2 + (2 - 1) * 4 + 1) / 2
    few = estimate_memory(validated("tiny", "model.num_layers=8", "model.pipeline_model_parallel_size=4",
                                    world=4), 4)  # 2 micro-batches a step: no more in flight
    assert few.micro_batches_in_flight == 2


def test_sequence_parallelism_divides_by_tp_what_tp_alone_keeps_whole():
    shape = shape_of(validated("tiny"), 1)
    one, tp, sp = (estimate(with_changes(shape, **sizes)) for sizes in
                   ({}, {"tp": 2, "world": 2}, {"tp": 2, "world": 2, "sp": True}))
    assert sp.activations == one.activations / 2 and sp.logits == one.logits / 2
    whole = TOKENS * 4 * 4 * 128  # the two norms' inputs and outputs stay whole under TP alone
    layer = whole + (TINY_LAYER_ACTIVATIONS - whole) / 2
    assert tp.activations == 2 * layer + TINY_HEAD + (layer - TINY_LOGITS / 2)


def test_context_parallelism_divides_the_sequence_but_gathers_keys_and_values():
    shape = shape_of(validated("tiny"), 1)
    cp = estimate(with_changes(shape, cp=2, world=2))
    one = estimate(shape)
    assert cp.logits == one.logits / 2
    assert cp.activations > one.activations / 2  # each rank holds the whole row's keys and values


def test_dry_run_prints_the_memory_per_gpu_and_fits(cli):
    result = cli("pretrain", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, "model.tensor_model_parallel_size=2",
                 "train.global_batch_size=16", "model.spec=torch", "--dry-run", "--device", "cuda", "--world-size", "4",
                 "--gpu-memory", "80")
    assert result.exit_code == 0, result.output
    block = result.stdout.split("memory_per_gpu:", 1)[1]
    for line in ("  weights: 7.5  # 4.02B parameters in bf16", "  gradients: 15.0  # fp32 buffer",
                 "  optimizer_state: 22.4  # Adam: main weights and 2 moments, the distributed optimizer's share of 2 "
                 "data-parallel ranks", "  activations: 21.1  # 32 layers x 1 micro-batch of 1 in flight, no recompute",
                 "  logits: 1.0", "  cuda_context_and_nccl: 3.0", "  total: 70.0", "  gpu: 80.0  # --gpu-memory",
                 "  verdict: fits"):
        assert line in block, block
    assert "warning" not in result.stderr


@pytest.mark.parametrize("world, total", [(4, "70.2"), (8, "55.3")])
def test_llama8b_as_shipped_fits_4_and_8_80_gb_gpus(cli, world, total):
    """Its torch FSDP2 layout: a first `bridge pretrain recipe=llama8b` on a 4- or 8-GPU H100 node fits."""
    result = cli("pretrain", "recipe=llama8b", "--dry-run", "--device", "cuda", "--world-size", str(world),
                 "--gpu-memory", "80")
    assert result.exit_code == 0, result.output
    assert f"  total: {total}\n" in result.stdout and "  verdict: fits" in result.stdout
    assert "torch FSDP2's share of" in result.stdout and result.stderr == ""


def test_a_layout_that_will_not_fit_names_the_settings_that_would(cli):
    result = cli(*LLAMA8B_ON_8)
    assert result.exit_code == 0, result.output  # a dry run is a question
    assert "  verdict: will not fit" in result.stdout
    warning = result.stderr.strip()
    assert warning.startswith("warning: memory per GPU: the estimate is 95.2 GiB, more than the GPU's 80.0 GiB: this "
                              "layout will not fit. Any one of these would: "), warning
    for fix in ("model.recompute_granularity=full model.recompute_method=uniform model.recompute_num_layers=1 "
                "(63.3 GiB)",
                "model.tensor_model_parallel_size=2 (58.8 GiB)", "model.pipeline_model_parallel_size=2 (71.7 GiB)"):
        assert fix in warning
    assert "micro_batch_size" not in warning  # already 1


def test_the_distributed_optimizer_and_a_smaller_micro_batch_are_offered_when_they_fit(cli):
    result = cli("pretrain", "recipe=llama1b", "train.micro_batch_size=8", "train.global_batch_size=64",
                 "optimizer.use_distributed_optimizer=false", "--dry-run", "--device", "cuda", "--world-size", "8",
                 "--gpu-memory", "70")
    assert result.exit_code == 0, result.output
    assert "optimizer.use_distributed_optimizer=true (" in result.stderr
    assert "train.micro_batch_size=4 (" in result.stderr


def test_a_model_too_large_for_any_single_setting_gets_them_together(cli):
    result = cli("pretrain", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER,
                 "optimizer.use_distributed_optimizer=false", "train.micro_batch_size=2", "--dry-run", "--device", "cuda",
                 "--world-size", "8", "--gpu-memory", "40")
    assert result.exit_code == 0, result.output
    assert "No single setting is enough; together these would: optimizer.use_distributed_optimizer=true " \
           "train.micro_batch_size=1 model.recompute_granularity=full" in result.stderr, result.stderr


FSDP2_KEYS = ("dist.use_torch_fsdp2=true optimizer.use_distributed_optimizer=false ddp.overlap_grad_reduce=false "
              "model.gradient_accumulation_fusion=false")


@pytest.mark.parametrize("world, estimate_gib", [(4, 70.2), (8, 55.3)])
def test_torch_fsdp2_is_offered_first_for_llama8b_and_its_line_passes_as_typed(cli, world, estimate_gib):
    command = ("pretrain", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, "--dry-run", "--device", "cuda",
               "--world-size", str(world), "--gpu-memory", "80")
    warning = cli(*command).stderr.strip()
    assert f"will not fit. Any one of these would: {FSDP2_KEYS} ({estimate_gib} GiB); " in warning, warning
    typed = cli(*command, *FSDP2_KEYS.split())
    assert typed.exit_code == 0, typed.output
    assert f"  total: {estimate_gib}\n" in typed.stdout and "  verdict: fits" in typed.stdout
    assert typed.stderr == ""
    assert cli("config", "validate", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, *FSDP2_KEYS.split(), "--device",
               "cuda", "--world-size", str(world), "--gpu-memory", "80").exit_code == 0


@pytest.mark.parametrize("overrides, world, gpu", [
    (("model.share_embeddings_and_output_weights=true",), 8, 80),  # FSDP2 refuses tied embeddings
    (("logger.log_params_norm=true",), 8, 80),  # and the norm of whole weights
    (("model.pipeline_model_parallel_size=2",), 8, 64),  # and pipeline stages
    # one data-parallel rank: FSDP2 would shard nothing, though its bf16 gradients alone would fit (37.0 GiB)
    (("model.num_layers=4",), 1, 43),
])
def test_torch_fsdp2_is_not_offered_where_it_is_refused_or_has_no_ranks_to_shard_over(cli, overrides, world, gpu):
    result = cli("pretrain", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, *overrides, "--dry-run", "--device",
                 "cuda", "--world-size", str(world), "--gpu-memory", str(gpu))
    assert result.exit_code == 0, result.output
    assert "Any one of these would: " in result.stderr, result.stderr
    assert "dist.use_torch_fsdp2=true" not in result.stderr


GATHER_ONCE_KEYS = ("dist.use_torch_fsdp2=false optimizer.use_distributed_optimizer=true ddp.overlap_grad_reduce=true "
                    "ddp.overlap_param_gather=true model.gradient_accumulation_fusion=true")


def test_a_fsdp2_run_that_fits_hears_of_the_distributed_optimizer_where_that_fits_too_and_the_line_passes(cli):
    """llama8b as shipped (FSDP2) on 4 H200-sized GPUs: the distributed optimizer's whole weights fit too (fp32
    gradients as the recipe reduces them), and it gathers them once a step instead of on each of 4 micro-batches.
    The note's settings, typed, are a run that fits, with no note of its own; docs/parallelism.md shows the note as
    printed."""
    command = ("pretrain", "recipe=llama8b", "train.global_batch_size=16", "--dry-run", "--device", "cuda",
               "--world-size", "4", "--gpu-memory", "141")
    result = cli(*command)
    assert result.exit_code == 0, result.output
    assert "  verdict: fits" in result.stdout
    assert result.stderr.strip() == (
        f"note: memory per GPU: the distributed optimizer would fit too: {GATHER_ONCE_KEYS} (106.4 GiB). It gathers "
        "the weights and reduces their gradients once a step, where torch FSDP2 does both on each of the step's 4 "
        "micro-batches (llama8b on 4 H200s: 1.11x the tokens/s, docs/parallelism.md#fsdp).")
    assert f"    {result.stderr.strip()}\n" in section("docs/parallelism.md", "Memory per GPU")  # the page's example
    typed = cli(*command, *GATHER_ONCE_KEYS.split())
    assert typed.exit_code == 0, typed.output
    assert "  total: 106.4\n" in typed.stdout and "  verdict: fits" in typed.stdout and typed.stderr == ""


@pytest.mark.parametrize("overrides, gpu", [
    ((), 80),  # the whole weights do not fit 80 GB
    (("train.global_batch_size=4",), 141),  # one micro-batch a step: FSDP2 gathers once a step too
])
def test_no_note_where_the_distributed_optimizer_would_not_fit_or_gain(cli, overrides, gpu):
    result = cli("pretrain", "recipe=llama8b", "train.global_batch_size=16", *overrides, "--dry-run", "--device",
                 "cuda", "--world-size", "4", "--gpu-memory", str(gpu))
    assert result.exit_code == 0, result.output
    assert "  verdict: fits" in result.stdout and result.stderr == ""


def test_config_validate_refuses_what_will_not_fit_and_warns_on_what_may_not(cli):
    assert_user_error(cli("config", "validate", "recipe=llama8b", "--device", "cuda", "--gpu-memory", "80"),
                      "memory per GPU: the estimate is", "will not fit", "model.tensor_model_parallel_size=4 on 4 GPUs")
    tight = cli("config", "validate", "recipe=llama1b", "--device", "cuda", "--gpu-memory", "48")  # 46.3 GiB
    assert tight.exit_code == 0 and "this layout may not fit" in tight.stderr, tight.output
    assert cli("config", "validate", "recipe=llama1b", "--device", "cuda", "--gpu-memory", "80").stderr == ""


def test_the_gpu_size_is_this_machines_gpu_else_80_gib(cli):
    import torch

    result = cli("pretrain", "recipe=tiny", "--dry-run", "--device", "cuda")
    assert result.exit_code == 0, result.output
    gpu = re.search(r"^  gpu: .*$", result.stdout, re.M).group(0)
    if torch.cuda.is_available():
        assert gpu.endswith("GPU 0 of this machine"), gpu
    else:
        assert gpu == "  gpu: 80.0  # no GPU visible: 80 GiB unless --gpu-memory says otherwise"


def test_the_cpu_gets_no_estimate_and_gpu_memory_needs_a_dry_run(cli):
    cpu = cli("pretrain", "recipe=tiny", "--dry-run", "--device", "cpu")
    assert cpu.exit_code == 0 and "memory_per_gpu" not in cpu.stdout
    assert_user_error(cli("pretrain", "recipe=tiny", "--gpu-memory", "80"), "--gpu-memory",
                      "only applies with --dry-run")
    assert_user_error(cli("pretrain", "recipe=tiny", "--dry-run", "--gpu-memory", "0"), "--gpu-memory", "above 0")


def test_finetune_dry_run_counts_only_the_adapters_gradients_and_state(cli):
    full = estimate_memory(validated("tiny", "mixed_precision=bf16_mixed"), 1)
    lora = estimate_memory(validated("tiny", "mixed_precision=bf16_mixed", "peft=lora"), 1)
    rank, h, q, kv, ffn = 32, 128, 128, 2 * 2 * 32, 512
    adapters = 2 * rank * ((h + q + kv) + (q + h) + (h + 2 * ffn) + (ffn + h))  # qkv, proj, fc1, fc2 of 2 layers
    assert lora.weights == full.weights and lora.gradients == 4 * adapters
    assert lora.optimizer_state == 12 * adapters


def test_finetune_dry_run_with_lora_fits_llama8b_on_one_gpu(cli):
    result = cli("finetune", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, "peft=lora", "--dry-run", "--device",
                 "cuda", "--gpu-memory", "80")
    assert result.exit_code == 0, result.output
    # rank-32 adapters on QKV, projection, fc1 and fc2 of 32 layers: 32 x 32 x 65,536 = 67.1M trainable weights
    for line in ("  weights: 15.0  # 8.03B parameters in bf16", "  gradients: 0.3  # fp32 buffer, adapters only",
                 "  optimizer_state: 0.8", "  total: 54.1", "  verdict: fits"):
        assert line in result.stdout, result.stdout[-1500:]


TABLE_ROW = re.compile(r"^\| .*? \| `(bridge pretrain [^`]+)` \| [^|]+ \| [^|]+ \| ([0-9.]+) \| ([0-9.]+) "
                       r"\| ([+-][0-9.]+)% \|$", re.M)


def test_the_table_of_estimates_is_what_the_dry_run_prints(cli):
    rows = TABLE_ROW.findall(section("docs/parallelism.md", "Memory per GPU"))
    assert len(rows) == 17
    for command, measured, documented, deviation in rows:
        result = cli(*shlex.split(command)[1:])
        assert result.exit_code == 0, (command, result.output)
        printed = dict(re.findall(r"^  (\w+): ([0-9.]+)", result.stdout.split("memory_per_gpu:", 1)[1], re.M))
        estimate_gib = float(printed["total"]) - float(printed["cuda_context_and_nccl"])
        assert abs(estimate_gib - float(documented)) <= 0.11, (command, estimate_gib)
        assert abs(float(deviation) - 100 * (float(documented) / float(measured) - 1)) <= 0.11, command


def test_the_running_page_example_is_what_the_dry_run_prints(cli):
    text = (REPO / "docs" / "running.md").read_text()
    example = text.split(f"    bridge {' '.join(LLAMA8B_ON_2)}\n")[1]
    warning = re.search(r"^    (warning: .*)$", example, re.M).group(1)
    result = cli(*LLAMA8B_ON_2)
    assert result.stderr.strip() == warning
    assert "  total: 100.1\n" in result.stdout and "  verdict: will not fit" in result.stdout
