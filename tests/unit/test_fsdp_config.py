"""FSDP's fields (bridge_cli/runtime/fsdp.py): what `bridge config validate` and `--dry-run` refuse, before any
work, naming both keys of a clash; the runs themselves are tests/integration/test_fsdp_cpu.py and
tests/gpu/test_gpu_fsdp.py."""

from __future__ import annotations

import pytest

from tests.unit.test_cli_errors import assert_user_error

UNTIED = "model.share_embeddings_and_output_weights=false"
FSDP2 = ["dist.use_torch_fsdp2=true", UNTIED]
MEGATRON_FSDP = ["ddp.use_megatron_fsdp=true", "optimizer.use_distributed_optimizer=true", "--device", "cuda"]

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
]


@pytest.mark.parametrize("args, fragments", REFUSED)
def test_config_validate_and_dry_run_refuse_alike(cli, args, fragments):
    for command in (("config", "validate"), ("pretrain", "--dry-run")):
        assert_user_error(cli(*command, "recipe=tiny", *args), *fragments)


@pytest.mark.parametrize("args", [
    [*FSDP2, "--world-size", "2"],
    [*FSDP2, "model.tensor_model_parallel_size=2", "--world-size", "4"],
    [*FSDP2, "mixed_precision=bf16_mixed", "--device", "cuda", "--world-size", "2"],
    [*MEGATRON_FSDP, "--world-size", "2"],
    [*MEGATRON_FSDP, "ddp.data_parallel_sharding_strategy=optim_grads_params", "model.tensor_model_parallel_size=2",
     "--world-size", "4"],
], ids=["fsdp2", "fsdp2-tp2", "fsdp2-bf16-gpu", "megatron-fsdp", "megatron-fsdp-zero3-tp2"])
def test_supported_layouts_pass(cli, args):
    result = cli("pretrain", "recipe=tiny", "--dry-run", *args)
    assert result.exit_code == 0, result.output
