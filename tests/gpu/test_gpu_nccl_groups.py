"""NCCL settings per megatron-core process group on 2 GPUs (``dist.nccl_communicator_config_path``,
``dist.high_priority_stream_groups``): the groups megatron-core creates hold them, and a run with them trains.

    python -m pytest -q -n 0 tests/gpu/test_gpu_nccl_groups.py

Not run yet: written without a GPU machine."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import python, torchrun
from tests.integration.test_pretrain_cpu import losses

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]

REPO = Path(__file__).resolve().parents[2]
SETTINGS = "dp_cp: {max_ctas: 8, is_high_priority_stream: true}\n"


def test_megatron_cores_groups_get_their_settings(tmp_path):
    path = tmp_path / "nccl.yaml"
    path.write_text(SETTINGS)
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = python(str(Path(__file__).with_name("nccl_groups_worker.py")), str(path), nproc=2, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    ranks = [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]
    assert len(ranks) == 2, result.stdout[-2000:]
    for rank in ranks:
        assert rank["dp_cp"] == {"is_high_priority_stream": True, "max_ctas": 8}, rank
        assert rank["tp"]["is_high_priority_stream"] is True, rank  # from high_priority_stream_groups


def test_a_run_with_them_trains(tmp_path):
    path = tmp_path / "nccl.yaml"
    path.write_text(SETTINGS)
    result = torchrun(2, "pretrain", "recipe=gpt2_124m", "train.train_iters=4", "logger.log_interval=1",
                      "train.eval_iters=0", f"dist.nccl_communicator_config_path={path}",
                      "dist.high_priority_stream_groups=[ep,dp_cp]")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(result.stdout)) == 4
