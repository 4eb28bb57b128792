"""train_utils' model-parallel reductions and model hooks, on real gloo process groups and GPTModels."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import python

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("train_utils_worker.py")


def run_worker(check: str, out: Path, nproc: int = 1) -> dict:
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = python(str(WORKER), check, "--out", str(out), nproc=nproc if nproc > 1 else 0, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_model_parallel_reductions(tmp_path):
    seen = run_worker("reductions", tmp_path / "out.json", nproc=2)
    assert seen["max_one_none"] == 3.5  # a rank without the stat (None) does not count
    assert seen["max_all_none"] is None
    assert seen["max_negative"] == -1.0
    assert seen["and_mixed"] is False and seen["and_all"] is True
    assert seen["memory"] == {"memory/peak_allocated_mem": 5.5, "memory/alloc_retries": 3}
    assert seen["memory_types"] == {"memory/peak_allocated_mem": "float", "memory/alloc_retries": "int"}
    assert seen["memory_empty"] == {}


def test_value_head_and_moe_router_freezing(tmp_path):
    seen = run_worker("hooks", tmp_path / "out.json")
    assert seen["head_is_linear_for_last_layer"]
    assert seen["value_shape"] == [2, 16, 1]  # [batch, sequence, one value] instead of vocabulary logits
    assert seen["value_max_diff"] == pytest.approx(0.0, abs=1e-6)  # the head projects the final hidden states
    assert seen["head_has_grad"]
    assert seen["routers"] == 2
    assert seen["frozen"] == [f"decoder.layers.{i}.mlp.{name}" for i in range(2)
                              for name in ("router.weight", "shared_experts.gate_weight")]
    assert seen["trainable"] > 0  # experts, attention and embeddings still train
