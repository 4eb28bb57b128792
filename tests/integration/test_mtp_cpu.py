"""Multi-token prediction (``model.mtp_num_layers``, DeepSeek-V3's MTP) on the CPU: megatron-core's MTP
block trains next to the decoder, each depth's loss is on the log line, tensor parallelism reproduces
the one-process curves, and its weights go through a checkpoint."""

from __future__ import annotations

import re

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.test_pretrain_cpu import losses

pytestmark = pytest.mark.slow

RUN = ["recipe=tiny", "model.mtp_num_layers=2", "train.train_iters=6", "logger.log_interval=1", "train.eval_iters=0"]


def mtp_losses(output: str) -> list[tuple[float, float]]:
    return [(float(a), float(b)) for a, b in re.findall(r"\| mtp_1 loss ([0-9.]+) \| mtp_2 loss ([0-9.]+) ", output)]


def flat(pairs: list[tuple[float, float]]) -> list[float]:
    """pytest.approx compares flat sequences only (newer pytest refuses nested ones)."""
    return [x for pair in pairs for x in pair]


@pytest.fixture(scope="module")
def one_process():
    result = bridge("pretrain", *RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_mtp_layers_train_and_log_each_depth(one_process):
    curve, mtp = losses(one_process), mtp_losses(one_process)
    assert len(curve) == len(mtp) == 6
    assert curve[-1] < curve[0] and mtp[-1][0] < mtp[0][0] and mtp[-1][1] < mtp[0][1]
    plain = bridge("pretrain", *RUN[:1], *RUN[2:])
    assert plain.returncode == 0 and "mtp_1" not in plain.stdout
    assert losses(plain.stdout)[0] == curve[0]  # the main loss before any update: the same decoder
    assert losses(plain.stdout)[-1] != curve[-1]  # after some: the MTP losses' gradients reached it


def test_tensor_parallel_two_reproduces_the_mtp_curves(one_process):
    result = torchrun(2, "pretrain", *RUN, "model.tensor_model_parallel_size=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(result.stdout) == pytest.approx(losses(one_process), rel=1e-4)
    assert flat(mtp_losses(result.stdout)) == pytest.approx(flat(mtp_losses(one_process)), rel=1e-4)


def test_mtp_weights_resume_from_a_checkpoint(one_process, tmp_path):
    first = bridge("pretrain", *RUN, f"checkpoint.save={tmp_path}", "train.exit_interval=3")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = bridge("pretrain", *RUN, f"checkpoint.save={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert flat(mtp_losses(resumed.stdout)) == pytest.approx(flat(mtp_losses(one_process)[3:]), rel=1e-5)
