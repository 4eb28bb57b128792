"""The training loop's knobs, through the real CLI: divergence, batch ramp-up, GC, DP hash checks, early exit."""

from __future__ import annotations

import re

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.test_pretrain_cpu import losses

pytestmark = pytest.mark.slow


def test_nan_gradients_stop_the_run_naming_the_iteration():
    result = bridge("pretrain", "recipe=tiny", "optimizer.lr=1e6", "optimizer.clip_grad=0", "train.train_iters=30",
                    "logger.log_interval=1")
    assert result.returncode == 1, result.stderr[-3000:]
    assert re.search(r"^error: iteration \d+: the gradient norm is (nan|inf)", result.stderr, re.M)
    assert "Traceback" not in result.stderr


def test_rampup_manual_gc_weight_hash_and_exit_interval_under_data_parallelism():
    result = torchrun(2, "pretrain", "recipe=tiny", "train.train_iters=20", "logger.log_interval=1",
                      "train.global_batch_size=32", "train.rampup_batch_size=[8,8,96]", "train.manual_gc=true", "train.manual_gc_interval=3",
                      "train.check_weight_hash_across_dp_replicas_interval=2", "train.exit_interval=12",
                      "train.train_sync_interval=2", "train.empty_unused_memory_level=1")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    samples = [int(s) for s in re.findall(r"consumed samples (\d+)", out)]
    steps = [b - a for a, b in zip([0] + samples, samples)]
    assert steps[0] == 8 and steps[-1] == 32 and steps == sorted(steps)  # ramps 8 -> 32 by 8
    assert len(losses(out)) == 12 and "exiting at iteration 12 (train.exit_interval=12)" in out
    assert "at the end of training" not in out  # an early exit skips the final evaluation


def test_skip_train_only_evaluates():
    result = bridge("pretrain", "recipe=tiny", "train.skip_train=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert not losses(result.stdout) and "validation at the end of training (iteration 0)" in result.stdout
