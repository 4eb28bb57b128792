"""nvrx_straggler on 2 GPUs with rank 1's GPU slowed on purpose: the report names rank 1, its scores reach
TensorBoard, and stop_if_detected saves before it stops, at the first report that names rank 1. Each run is given
RUN_SECONDS; past them its processes are killed and the test fails with the tail of what they printed.

    python -m pytest -q -n 0 tests/gpu/test_gpu_nvrx_stragglers.py

NVRx (attribution/straggler in nvidia-resiliency-ext 0.7.0, the same in 0.4.1) times with CUPTI every CUDA kernel the
process launches while a step's section is open, keyed by name, block and grid; NCCL's kernels are left out. A GPU's
relative score is the mean over the kernels every rank ran of (the fastest rank's median time / this rank's median
time), weighted by the time spent in each: 1.0 is as fast as the fastest, 0.5 twice as slow. So a GPU is seen slow
only when its kernels take longer from start to end, call after call.

The slowing used first, a second process running a matmul loop on GPU 1, was not seen (2 H100s, torch 2.11, every
score 0.99-1.00): two processes on one GPU without MPS are time-sliced, never concurrent, so each training kernel
ran whole in its slice at full speed, and the wait fell between kernels, where NVRx does not look. Now torchrun
starts tests/gpu/slowed_rank.py in place of `-m bridge_cli`: on rank 1 it runs, in the same process as training, a
kernel that holds about 2/3 of the SMs and most of the memory bandwidth from a stream of its own, so each training
kernel runs at the same time on what is left and takes longer (its docstring says why this shape, and why its own
kernel does not enter the relative score). No GPU setting changes, and bridge's detector is the real one.

Measured on 2 H100s without slowing: start-up about 18 s, a step of gpt2_124m at micro-batch 8 about 65 ms (62-80).
NVRx times the first 16 steps and then reports every REPORT_SECONDS worth of steps at that pace, whatever it is.
Both tests passed on 2 H100s with nvidia-resiliency-ext 0.7.0 (2026-11-28, 87 s; docs/resilience.md)."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bridge_cli.config.runtime_configs import NVRxStragglerDetectionConfig, resilience_missing
from tests.bounded_run import run_within
from tests.conftest import REPO

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
              pytest.mark.skipif(resilience_missing(), reason="needs nvidia-resiliency-ext"),
              pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                 reason="needs triton (rank 1's neighbour kernel, tests/gpu/slowed_rank.py)")]

LAUNCHER = Path(__file__).with_name("slowed_rank.py")
REPORT_SECONDS = 5
TRAIN_ITERS = 200
"""Both runs' length: 13 s of steps unslowed (2 reports), about 40 s at 3 times slower (7 reports); the stopping run
is expected to stop at its first report, near iteration 25, and a run that fails to stop ends here."""
RUN_SECONDS = 150
"""Each run's limit: start-up (18 s), TRAIN_ITERS steps even 5 times slower than unslowed (65 s), the checkpoint
of the stopping run, and as much again to spare: a run killed at this limit hangs rather than runs long. (The
first version's 2000 steps, 2 min 15 s at 65 ms after 18 s of start-up, were done when it was killed at 180 s, in
the checkpoint save after the last step: torch's warning at its first barrier was the last line.)"""
THRESHOLD = NVRxStragglerDetectionConfig().gpu_relative_perf_threshold
RUN = ["recipe=gpt2_124m", "train.micro_batch_size=8", "train.global_batch_size=16", "train.eval_iters=0",
       f"train.train_iters={TRAIN_ITERS}", "logger.log_interval=20", "nvrx_straggler.enabled=true",
       f"nvrx_straggler.report_time_interval={REPORT_SECONDS}", "nvrx_straggler.num_gpu_perf_scores_to_print=2"]
WORST = re.compile(r"GPU relative performance scores at iteration (\d+) .*?: worst rank (\d) \(\S+\) ([0-9.]+)")
STRAGGLER = re.compile(rf"straggler at iteration (\d+): rank (\d) on \S+ \(relative (0\.\d\d) < "
                       rf"{re.escape(str(THRESHOLD))}")
NEIGHBOUR = "slowed_rank.py: rank 1: noisy_neighbour on"


def run_with_rank_1_slowed(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node 2 tests/gpu/slowed_rank.py pretrain RUN ARGS`, within RUN_SECONDS."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               str(LAUNCHER.relative_to(REPO)), "pretrain", *RUN, *args]
    result = run_within(RUN_SECONDS, command, tmp_path / "stdout", tmp_path / "stderr")
    assert NEIGHBOUR in result.stderr, result.stderr[-3000:]
    return result


def report_lines(stderr: str) -> str:
    return "\n".join(line for line in stderr.splitlines() if "performance scores" in line or "straggler at" in line)


def test_the_slowed_gpu_is_named_and_its_scores_reach_tensorboard(tmp_path: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = run_with_rank_1_slowed(tmp_path, f"logger.tensorboard_dir={tmp_path / 'tb'}")
    assert result.returncode == 0, result.stderr[-3000:]
    reports, stragglers = WORST.findall(result.stderr), STRAGGLER.findall(result.stderr)
    assert len(reports) >= 2 and reports[-1][1] == "1", report_lines(result.stderr)
    assert stragglers and {rank for _, rank, _ in stragglers} == {"1"}, report_lines(result.stderr)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    slow = [e.value for e in events.Scalars("nvrx_straggler/gpu_relative_perf_score/rank_1")]
    fast = [e.value for e in events.Scalars("nvrx_straggler/gpu_relative_perf_score/rank_0")]
    assert len(slow) == len(reports) and all(s < f for s, f in zip(slow, fast)) and slow[-1] < THRESHOLD, (slow, fast)


def test_stop_if_detected_saves_then_stops(tmp_path: Path):
    result = run_with_rank_1_slowed(tmp_path, f"checkpoint.save={tmp_path / 'ckpt'}",
                                    "nvrx_straggler.stop_if_detected=true")
    assert result.returncode == 0, result.stderr[-3000:]
    stop = re.search(r"exiting at iteration (\d+): straggler GPU on rank 1 \(nvrx_straggler.stop_if_detected\)",
                     result.stdout)
    assert stop, report_lines(result.stderr) or result.stdout[-3000:]
    step = int(stop.group(1))
    first = STRAGGLER.search(result.stderr)
    assert first and int(first.group(1)) == step and first.group(2) == "1", report_lines(result.stderr)
    assert int(WORST.findall(result.stderr)[-1][0]) == step, report_lines(result.stderr)  # no report after the stop
    assert (tmp_path / "ckpt" / f"iter_{step:07d}").is_dir()
    assert int((tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text()) == step < TRAIN_ITERS
