"""The distributed optimizer's Adam state follows a change of layout (docs/checkpoints.md): saved
``fully_reshardable`` under one tensor/pipeline/data-parallel layout, resumed under another, the losses go on as
the uninterrupted run's under the new layout. ``dp_reshardable`` checkpoints (bridge's before, Megatron-LM's
default) still resume under their own layout and say the optimizer starts fresh under another.

Each run is ``distributed_optimizer_worker.py`` on two CPU processes (gloo): megatron-core's DistributedOptimizer
steps and saves for real there (see the worker for the two CUDA-bound spots it redirects); saving and loading go
through bridge_cli.checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import python

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("distributed_optimizer_worker.py")
STEPS, SAVE_AT = 6, 3
RTOL = 1e-5
"""fp32 on the CPU: another layout sums its matrix products in another order (5e-7 seen)."""


def run(out: Path, ckpt: Path, *args: str, nproc: int = 2) -> dict:
    """The worker's losses and checkpoint log under ``args`` (its layout, --save-at or --resume)."""
    env = {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = python(str(WORKER), "--ckpt", str(ckpt), "--out", str(out), "--steps", str(STEPS), *args,
                    nproc=nproc, env=env, timeout=300)
    assert result.returncode == 0, f"worker failed:\n{(result.stdout + result.stderr)[-4000:]}"
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[str, list[float]]:
    """Uninterrupted curves: data parallel 2, tensor parallel 2, pipeline parallel 2."""
    root = tmp_path_factory.mktemp("straight")
    return {name: run(root / f"{name}.json", root / "none", *args)["loss"]
            for name, args in {"dp2": (), "tp2": ("--tp", "2"), "pp2": ("--pp", "2")}.items()}


@pytest.mark.parametrize("saved, resumed", [("tp2", "dp2"), ("dp2", "tp2"), ("pp2", "dp2"), ("dp2", "pp2")])
def test_resume_under_another_layout_follows_the_uninterrupted_curve(tmp_path, straight, saved, resumed):
    layouts = {"dp2": (), "tp2": ("--tp", "2"), "pp2": ("--pp", "2")}
    first = run(tmp_path / "first.json", tmp_path / "ckpt", *layouts[saved], "--save-at", str(SAVE_AT))
    assert first["loss"] == pytest.approx(straight[saved][:SAVE_AT], rel=RTOL)
    second = run(tmp_path / "second.json", tmp_path / "ckpt", *layouts[resumed], "--resume")
    assert "starts fresh" not in second["log"], second["log"]
    assert second["loss"] == pytest.approx(straight[resumed][SAVE_AT:], rel=RTOL), (second["loss"], straight)


def test_checkpoint_records_the_fully_reshardable_format(tmp_path):
    from megatron.core import dist_checkpointing

    run(tmp_path / "first.json", tmp_path / "ckpt", "--save-at", "1")
    metadata = dist_checkpointing.load_content_metadata(str(tmp_path / "ckpt" / "iter_0000001"))
    assert metadata["distrib_optim_sharding_type"] == "fully_reshardable"


def test_dp_reshardable_checkpoint_resumes_under_its_layout_and_starts_fresh_under_another(tmp_path, straight):
    run(tmp_path / "first.json", tmp_path / "ckpt", "--tp", "2", "--save-at", str(SAVE_AT),
        "--sharding", "dp_reshardable")
    same = run(tmp_path / "same.json", tmp_path / "ckpt", "--tp", "2", "--resume")
    assert same["loss"] == straight["tp2"][SAVE_AT:]  # bitwise: the same layout, the same buffers
    other = run(tmp_path / "other.json", tmp_path / "ckpt", "--resume")
    assert "reshards across data-parallel sizes only" in other["log"] and "starts fresh" in other["log"], other["log"]
    assert other["loss"] != pytest.approx(straight["dp2"][SAVE_AT:], rel=RTOL)
