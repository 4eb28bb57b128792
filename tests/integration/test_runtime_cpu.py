"""The CPU runtime trains megatron-core's GPTModel, and parallelism does not change the numbers.

Each case runs ``runtime_worker.py`` (torchrun-style for two ranks, gloo, no GPU; see tests/conftest.py python())
and compares its loss curve with a single process trained on the same tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from tests.conftest import python

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("runtime_worker.py")
RTOL = 1e-4


def train(out: Path, *args: str, nproc: int = 1) -> dict:
    """Run the worker (under torchrun when ``nproc > 1``) and return its loss/grad-norm curve."""
    out.mkdir(parents=True)
    # One thread per process, as torchrun sets: oversubscribed cores slow a run several-fold.
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = python(str(WORKER), "--out", str(out), *args, nproc=nproc if nproc > 1 else 0, env=env, timeout=300)
    assert result.returncode == 0, f"worker failed:\n{(result.stdout + result.stderr)[-4000:]}"
    return json.loads((out / "curve.json").read_text())


def assert_same_curve(got: list[float], want: list[float]) -> None:
    assert len(got) == len(want)
    for step, (g, w) in enumerate(zip(got, want)):
        assert abs(g - w) <= RTOL * abs(w), f"step {step}: loss {g} vs single-process {w}"


@pytest.fixture(scope="module")
def single(tmp_path_factory) -> dict:
    return train(tmp_path_factory.mktemp("single") / "run")


def test_single_process_loss_falls_with_clipping_active(single):
    loss = single["loss"]
    assert len(loss) == 20
    assert loss[-1] < 0.5 * loss[0]
    assert max(single["grad_norm"]) > 1.0, "clip_grad=1.0 never engaged; the TP test would not cover it"


def test_tensor_parallel_matches_single_process(single, tmp_path):
    curve = train(tmp_path / "tp2", "--tp", "2", nproc=2)
    assert_same_curve(curve["loss"], single["loss"])
    assert_same_curve(curve["grad_norm"], single["grad_norm"])
    rank0, rank1 = (torch.load(tmp_path / "tp2" / f"norms.rank{r}.pt") for r in (0, 1))
    assert rank0.keys() == rank1.keys() and rank0
    for name, weight in rank0.items():
        assert not torch.equal(weight, torch.ones_like(weight)), f"{name} never trained"
        assert torch.equal(weight, rank1[name]), f"replicated {name} drifted between TP ranks"


def test_data_parallel_matches_single_process(single, tmp_path):
    curve = train(tmp_path / "dp2", nproc=2)
    assert_same_curve(curve["loss"], single["loss"])


def test_pipeline_parallel_matches_single_process(single, tmp_path):
    curve = train(tmp_path / "pp2", "--pp", "2", nproc=2)
    assert_same_curve(curve["loss"], single["loss"])
