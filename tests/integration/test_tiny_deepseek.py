"""recipes/tiny_deepseek.yaml through the real CLI on the CPU: multi-latent attention, group-limited sigmoid routing
with the expert bias, a shared expert, a dense first layer and a multi-token-prediction layer train (the loss falls),
and a run stopped by train.exit_interval resumes printing the uninterrupted run's losses, its MTP loss included
(bitwise up to the printed digits: the weights, Adam's moments and the expert bias come back)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import bridge
from tests.integration.test_checkpoint_resume import losses, ok

pytestmark = pytest.mark.slow

MTP = re.compile(r"^iteration\s+(\d+)/\d+ .*\| mtp_1 loss ([0-9.]+) ", re.M)
SHORT = ["recipe=tiny_deepseek", "train.train_iters=8", "logger.log_interval=1", "train.eval_iters=0"]


def mtp_losses(output: str) -> dict[int, str]:
    return {int(i): loss for i, loss in MTP.findall(output)}


def test_tiny_deepseek_trains_and_the_loss_falls():
    out = ok(bridge("pretrain", "recipe=tiny_deepseek"))
    assert "GPTModel 4 layers" in out and "(torch spec)" in out
    curve = [float(loss) for _, loss in sorted(losses(out).items())]
    mtp = [float(loss) for _, loss in sorted(mtp_losses(out).items())]
    assert len(curve) == len(mtp) == 10, out[-2000:]
    assert curve[-1] < 0.5 * curve[0] and mtp[-1] < 0.5 * mtp[0], (curve, mtp)


def test_a_stopped_tiny_deepseek_run_resumes_with_the_same_losses(tmp_path):
    reference = ok(bridge("pretrain", *SHORT))
    first = ok(bridge("pretrain", *SHORT, f"checkpoint.save={tmp_path}", "train.exit_interval=4"))
    assert max(losses(first)) == 4
    resumed = ok(bridge("pretrain", *SHORT, f"checkpoint.save={tmp_path}"))
    assert f"loaded checkpoint {tmp_path}/iter_0000004" in resumed
    assert sorted(losses(resumed)) == list(range(5, 9))
    assert losses(resumed) == {i: loss for i, loss in losses(reference).items() if i > 4}
    assert mtp_losses(resumed) == {i: loss for i, loss in mtp_losses(reference).items() if i > 4}
