"""FP8 training without Transformer Engine on one GPU: both presets train like bf16, and checkpoints
do not depend on the precision (an FP8 run resumes in bf16 and back)."""

from __future__ import annotations

import math
import os

import pytest
import torch

from tests.conftest import bridge
from tests.integration.test_pretrain_cpu import losses

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PRESETS = ("bf16_with_fp8_current_scaling_mixed", "bf16_with_fp8_rowwise_mixed")
SMALL = ["recipe=llama1b", "model.num_layers=4", "logger.log_interval=1", "train.eval_iters=0",
         "model.seq_length=1024", "train.global_batch_size=8"]


def fp8_gpu() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


@pytest.fixture(scope="module")
def bf16_curve() -> list[float]:
    return losses(bridge("pretrain", *SMALL, "train.train_iters=30").stdout)


@pytest.mark.skipif(not fp8_gpu(), reason="needs an sm89+ GPU")
@pytest.mark.parametrize("preset, output_layer", [(p, False) for p in PRESETS] + [(p, True) for p in PRESETS])
def test_fp8_preset_trains_as_bf16_does(preset, output_layer, bf16_curve):
    result = bridge("pretrain", *SMALL, "train.train_iters=30", f"mixed_precision={preset}",
                    f"model.fp8_output_layer={str(output_layer).lower()}",
                    env={**os.environ, "TORCH_LOGS": "graph_breaks"})
    assert result.returncode == 0, result.stderr[-3000:]
    # llama1b compiles its layers: fp8 and bf16 layers (the first and last) each stay one graph
    assert "Graph break" not in result.stderr, result.stderr[-3000:]
    assert "FP8 GEMMs" in result.stdout and "linear layers in fp8" in result.stdout
    # 4 linears in each fp8 layer (the tensor-wise preset keeps the first and last in bf16), and the output layer
    fp8_layers = 2 if preset == PRESETS[0] else 4
    assert f": {4 * fp8_layers + output_layer} linear layers in fp8" in result.stdout, result.stdout[:3000]
    curve = losses(result.stdout)
    assert len(curve) == 30 and all(math.isfinite(x) for x in curve) and curve[-1] < curve[0]
    assert curve[-1] == pytest.approx(bf16_curve[-1], rel=0.03)


@pytest.mark.skipif(not fp8_gpu(), reason="needs an sm89+ GPU")
def test_an_fp8_checkpoint_resumes_in_bf16_and_back(tmp_path):
    save = [f"checkpoint.save={tmp_path}", "checkpoint.save_interval=10"]
    fp8 = "mixed_precision=bf16_with_fp8_rowwise_mixed"
    for iters, precision in ((10, fp8), (20, "mixed_precision=bf16_mixed"), (30, fp8)):
        result = bridge("pretrain", *SMALL, *save, f"train.train_iters={iters}", precision)
        assert result.returncode == 0, result.stderr[-3000:]
        curve = losses(result.stdout)
        assert len(curve) == 10 and all(math.isfinite(x) for x in curve)
    assert (tmp_path / "latest_checkpointed_iteration.txt").read_text().strip() == "30"
