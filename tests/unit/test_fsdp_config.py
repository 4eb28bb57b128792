"""FSDP's fields (bridge_cli/runtime/fsdp.py): what `bridge config validate` and `--dry-run` refuse, before any
work, naming both keys of a clash; the runs themselves are tests/integration/test_fsdp_cpu.py and
tests/gpu/test_gpu_fsdp.py."""

from __future__ import annotations

import re

import pytest

from tests.recipe_layouts import LLAMA8B_DISTRIBUTED_OPTIMIZER
from tests.unit.test_cli_errors import assert_user_error

UNTIED = "model.share_embeddings_and_output_weights=false"
FSDP2 = ["dist.use_torch_fsdp2=true", UNTIED]
MEGATRON_FSDP = ["ddp.use_megatron_fsdp=true", "optimizer.use_distributed_optimizer=true", "optimizer.adam_kernel=foreach",
                 "--device", "cuda"]

REFUSED = [
    (["ddp.use_megatron_fsdp=true", "--device", "cpu"],
     ["ddp.use_megatron_fsdp=true needs a GPU", "CUDA streams", "dist.use_torch_fsdp2=true"]),
    (["ddp.use_megatron_fsdp=true", "--device", "cuda"],
     ["ddp.use_megatron_fsdp", "optimizer.use_distributed_optimizer=true"]),
    ([*MEGATRON_FSDP, "ddp.data_parallel_sharding_strategy=zero3"],
     ["ddp.data_parallel_sharding_strategy", "'zero3'", "optim_grads_params"]),
    ([*MEGATRON_FSDP, "checkpoint.save=/tmp/never_written"],
     ["ddp.use_megatron_fsdp", "checkpoint.save", "fsdp_dtensor"]),
    ([*MEGATRON_FSDP, "dist.use_torch_fsdp2=true"], ["dist.use_torch_fsdp2", "ddp.use_megatron_fsdp"]),
    (["ddp.data_parallel_sharding_strategy=optim"],
     ["ddp.data_parallel_sharding_strategy", "Megatron-FSDP, which is off", "ddp.use_megatron_fsdp=true"]),
    (["ddp.fsdp_double_buffer=true"], ["ddp.fsdp_double_buffer", "does not set up", "default (False)"]),
    (["dist.use_torch_fsdp2=true"],
     ["dist.use_torch_fsdp2", "model.share_embeddings_and_output_weights=true", UNTIED]),
    ([*FSDP2, "optimizer.use_distributed_optimizer=true", "--device", "cuda"],
     ["dist.use_torch_fsdp2", "optimizer.use_distributed_optimizer=true"]),
    ([*FSDP2, "model.pipeline_model_parallel_size=2", "--world-size", "2"],
     ["dist.use_torch_fsdp2", "model.pipeline_model_parallel_size=2"]),
    ([*FSDP2, "ddp.overlap_grad_reduce=true"], ["dist.use_torch_fsdp2", "ddp.overlap_grad_reduce=true"]),
    ([*FSDP2, "model.gradient_accumulation_fusion=true"],
     ["dist.use_torch_fsdp2", "model.gradient_accumulation_fusion=true"]),
    ([*FSDP2, "peft=lora"], ["dist.use_torch_fsdp2", "peft"]),
    ([*MEGATRON_FSDP, "optimizer.adam_kernel=triton"],
     ["ddp.use_megatron_fsdp", "optimizer.adam_kernel=triton", "optimizer.adam_kernel=foreach"]),
    ([*FSDP2, "logger.log_params_norm=true"], ["dist.use_torch_fsdp2", "logger.log_params_norm=true"]),
    (["recipe=tiny_moe", *FSDP2], ["dist.use_torch_fsdp2", "model.num_moe_experts"]),
    ([*FSDP2, "train.check_weight_hash_across_dp_replicas_interval=10"],
     ["dist.use_torch_fsdp2", "train.check_weight_hash_across_dp_replicas_interval", "shards"]),
    ([*MEGATRON_FSDP, "ddp.data_parallel_sharding_strategy=optim_grads_params",
      "train.check_weight_hash_across_dp_replicas_interval=10"],
     ["ddp.use_megatron_fsdp", "train.check_weight_hash_across_dp_replicas_interval"]),
    ([*MEGATRON_FSDP, "model.gradient_accumulation_fusion=true"],
     ["ddp.use_megatron_fsdp", "model.gradient_accumulation_fusion=true"]),
]


@pytest.mark.parametrize("args, fragments", REFUSED)
def test_config_validate_and_dry_run_refuse_alike(cli, args, fragments):
    for command in (("config", "validate"), ("pretrain", "--dry-run")):
        assert_user_error(cli(*command, "recipe=tiny", *args), *fragments)


@pytest.mark.parametrize("args", [
    [*FSDP2, "--world-size", "2"],
    [*FSDP2, "model.tensor_model_parallel_size=2", "--world-size", "4"],
    [*FSDP2, "mixed_precision=bf16_mixed", "optimizer.adam_kernel=foreach", "--device", "cuda", "--world-size", "2"],
    [*FSDP2, "mixed_precision=bf16_mixed", "optimizer.adam_kernel=triton", "model.compile_layers=true", "--device",
     "cuda", "--world-size", "2"],
    [*FSDP2, "optimizer.adam_kernel=fused", "--device", "cuda", "--world-size", "2"],
    [*FSDP2, "model.compile_layers=true", "--world-size", "2"],
    [*MEGATRON_FSDP, "--world-size", "2"],
    [*MEGATRON_FSDP, "model.compile_layers=true", "--world-size", "2"],
    [*MEGATRON_FSDP, "ddp.data_parallel_sharding_strategy=optim_grads_params", "model.tensor_model_parallel_size=2",
     "--world-size", "4"],
], ids=["fsdp2", "fsdp2-tp2", "fsdp2-bf16-gpu", "fsdp2-compiled-triton-adam-gpu", "fsdp2-fused-adam-gpu",
        "fsdp2-compiled", "megatron-fsdp", "megatron-fsdp-compiled", "megatron-fsdp-zero3-tp2"])
def test_supported_layouts_pass(cli, args):
    result = cli("pretrain", "recipe=tiny", "--dry-run", *args)
    assert result.exit_code == 0, result.output


LLAMA8B_ON_8 = ["pretrain", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, "--dry-run", "--device", "cuda",
                "--world-size", "8", "--gpu-memory", "80", "optimizer.adam_kernel=foreach",
                "model.gradient_accumulation_fusion=false", "model.compile_layers=false"]


def memory_lines(result) -> dict[str, float]:
    assert result.exit_code == 0, result.output
    return {name: float(value) for name, value in re.findall(r"^  (\w+): ([0-9.]+)", result.stdout, re.M)}


@pytest.mark.parametrize("strategy, sharded", [("no_shard", ()), ("optim", ("optimizer_state",)),
                                               ("optim_grads", ("optimizer_state", "gradients")),
                                               ("optim_grads_params", ("optimizer_state", "gradients", "weights"))])
def test_the_memory_estimate_divides_what_megatron_fsdp_shards(cli, strategy, sharded):
    """llama8b on 8 GPUs: each strategy divides its parts by the 8 data-parallel ranks, and a sharded part adds the
    whole layers FSDP gathers (one layer: 218.1M parameters; 2 of them in bf16 for the weights, 1 in fp32 for the
    gradients)."""
    whole = memory_lines(cli(*LLAMA8B_ON_8, "optimizer.use_distributed_optimizer=false"))
    fsdp = memory_lines(cli(*LLAMA8B_ON_8, "ddp.use_megatron_fsdp=true", "optimizer.use_distributed_optimizer=true",
                            f"ddp.data_parallel_sharding_strategy={strategy}"))
    layer = 218_112_000 / 2**30
    gathered = {"weights": 2 * 2 * layer, "gradients": 4 * layer, "optimizer_state": 0.0}
    for part in ("weights", "gradients", "optimizer_state"):
        expected = whole[part] / 8 + gathered[part] if part in sharded else whole[part]
        assert fsdp[part] == pytest.approx(expected, abs=0.1), (part, fsdp, whole)
    assert fsdp["activations"] == whole["activations"]


def test_the_memory_estimate_of_torch_fsdp2_shards_everything_and_keeps_bf16_gradients(cli):
    args = [*LLAMA8B_ON_8, "optimizer.use_distributed_optimizer=false", "ddp.overlap_grad_reduce=false",
            "ddp.overlap_param_gather=false", "model.share_embeddings_and_output_weights=false"]
    whole = memory_lines(cli(*args))
    result = cli(*args, "dist.use_torch_fsdp2=true")
    fsdp = memory_lines(result)
    layer = 218_112_000 / 2**30
    assert fsdp["weights"] == pytest.approx(whole["weights"] / 8 + 4 * layer, abs=0.1)
    assert fsdp["gradients"] == pytest.approx(whole["gradients"] / 2 / 8 + 2 * layer, abs=0.1)  # bf16, not fp32
    assert fsdp["optimizer_state"] == pytest.approx(whole["optimizer_state"] / 8, abs=0.1)
    assert "torch FSDP2's share of 8 ranks" in result.stdout
