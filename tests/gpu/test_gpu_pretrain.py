"""The GPU path end to end: bf16, distributed optimizer, NCCL, megatron-core's schedules."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import bridge, torchrun
from tests.integration.test_pretrain_cpu import losses

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

SHORT = ["train.train_iters=20", "logger.log_interval=1", "train.eval_iters=1", "train.eval_interval=10"]


def gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.parametrize("recipe, extra", [("llama1b", []), ("gpt2_124m", ["train.micro_batch_size=64", "train.global_batch_size=64"])])
def test_recipe_trains_in_bf16_and_loss_falls(recipe, extra):
    result = bridge("pretrain", f"recipe={recipe}", *SHORT, *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert len(curve) == 20 and curve[-1] < curve[0]
    assert "cuda (nccl)" in result.stdout and "peak allocated" in result.stdout


@pytest.mark.skipif(gpus() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("layout", ["model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2"])
def test_two_gpu_layouts_match_one_gpu(layout):
    one = losses(bridge("pretrain", "recipe=llama1b", *SHORT, "model.num_layers=4").stdout)
    result = torchrun(2, "pretrain", "recipe=llama1b", *SHORT, "model.num_layers=4", layout)
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(result.stdout) == pytest.approx(one, rel=2e-2)
