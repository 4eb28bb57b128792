"""nvrx_straggler's reports on 2 ranks (gloo, NVRx's Detector answering each rank as it does on GPUs:
nvrx_straggler_worker.py): only rank 0 holds a report, yet every rank finishes every step, the logging rank
prints each report once, and with stop_if_detected every rank stops at the same step."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import REPO, python

pytest.importorskip("nvidia_resiliency_ext", reason="needs nvidia-resiliency-ext")
pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("nvrx_straggler_worker.py")
STOP = "exiting at iteration {}: straggler GPU on rank 1 (nvrx_straggler.stop_if_detected)"


def run_worker(out: Path, *args: str) -> tuple[str, list[dict]]:
    """(stderr, each rank's rank<N>.json) of the worker on 2 ranks; fails with the output so far after 60 s (a
    rank that waits in a collective the other never joins waits for gloo's 30 minutes)."""
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        result = python(str(WORKER), "--out", str(out), *args, nproc=2, timeout=60, env=env)
    except subprocess.TimeoutExpired as hung:
        pytest.fail(f"the ranks did not finish in 60 s; output so far:\n{hung.stdout or ''}{hung.stderr or ''}"[-3000:])
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stderr, [json.loads((out / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_every_rank_finishes_and_the_logging_rank_prints_each_report_once(tmp_path):
    stderr, ranks = run_worker(tmp_path)
    for step in (3, 6):
        lines = [f"GPU relative performance scores at iteration {step} (1.00: as fast as the fastest GPU): "
                 "worst rank 1 (node0) 0.52; best rank 0 (node0) 1.00",
                 f"GPU individual performance scores at iteration {step} (1.00: as fast as the GPU at its best): "
                 "worst rank 1 (node0) 0.90; best rank 0 (node0) 0.99",
                 f"straggler at iteration {step}: rank 1 on node0 (relative 0.52 < 0.7)"]
        assert [line for line in ranks[1]["logged"] if f"iteration {step}" in line] == lines
        assert all(stderr.count(line) == 1 for line in lines), stderr[-3000:]
    assert ranks[0]["logged"] == []  # rank 0 holds the report; the last rank logs
    assert ranks[0]["returned"] == ranks[1]["returned"] == {str(step): None for step in range(1, 8)}


def test_with_stop_if_detected_every_rank_stops_at_the_report(tmp_path):
    _, ranks = run_worker(tmp_path, "--stop-if-detected")
    expected = {str(step): STOP.format(step) if step % 3 == 0 else None for step in range(1, 8)}
    assert ranks[0]["returned"] == ranks[1]["returned"] == expected
