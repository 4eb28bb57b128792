"""The rerun state machine through `bridge pretrain` on the CPU, with megatron-core's error injection:
a fault is injected, detected, the step re-run on the same data, and the run goes on, saves or exits
as megatron-core decides. Training runs, so `slow`: tests/unit/test_rerun_lines.py checks the machine bridge
builds and what bridge says of each decision in the fast tier."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.conftest import bridge
from tests.integration.test_pretrain_cpu import losses

# separate processes agree to the last printed digit, give or take one: CI once logged 6.180784 for a loss
# that the other runs of the same command logged as 6.180785
SAME_LOSSES = {"rel": 1e-6}
RUN = ["recipe=tiny", "train.train_iters=6", "logger.log_interval=1", "train.eval_iters=0"]
VALIDATE = ["rerun_state_machine.rerun_mode=validate_results"]
INJECT = VALIDATE + ["rerun_state_machine.error_injection_rate=1"]  # every validation from the second step on


@pytest.fixture(scope="module")
def uninterrupted() -> list[float]:
    result = bridge("pretrain", *RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(result.stdout)


def saved_rerun_state(checkpoint: Path):
    from megatron.core import dist_checkpointing

    return dist_checkpointing.load_common_state_dict(str(checkpoint)).get("rerun_state_machine")


@pytest.mark.slow
def test_a_transient_spiky_loss_is_rerun_and_training_goes_on_with_the_same_loss(uninterrupted):
    result = bridge("pretrain", *RUN, *INJECT, "rerun_state_machine.check_for_nan_in_loss=false",
                    "rerun_state_machine.check_for_spiky_loss=true", "logger.filter_warnings=false")
    assert result.returncode == 0, result.stderr[-3000:]
    for iteration in range(2, 7):  # injected, detected, re-run, and training went on
        assert f"at iteration #{iteration} invocation #1 (message='Spiky loss')" in result.stderr
        assert f"rerun state machine: iteration {iteration} failed a non-fatal check (spiky loss) and was re-run " \
               "on the same data; training goes on" in result.stdout
    # the re-run replays the step's data and random state: its loss is the first run's, bit for bit
    reruns = re.findall(r"First rerun: unexpected result is not reproducible within the tolerance \(([-\d.e+]+) != "
                        r"([-\d.e+]+)\)", result.stderr)
    assert len(reruns) == 5 and all(rerun == first for rerun, first in reruns), reruns
    assert "Possible transient error" in result.stderr
    assert losses(result.stdout) == pytest.approx(uninterrupted, **SAME_LOSSES)


@pytest.mark.slow
def test_a_transient_nan_check_fault_stops_with_17_and_the_run_resumes(tmp_path, uninterrupted):
    save = ["checkpoint.save=" + str(tmp_path / "ckpt"), "checkpoint.save_interval=2"]
    faulted = bridge("pretrain", *RUN, *INJECT, *save)
    assert faulted.returncode == 17, faulted.stderr[-3000:]
    assert "found NaN in local forward loss calculation" in faulted.stderr and "Traceback" not in faulted.stderr
    assert "rerun state machine: the loss of iteration 2 failed validation and did not come back on the re-run: " \
           "a transient fault" in faulted.stdout and "Exit code 17." in faulted.stdout
    resumed = bridge("pretrain", *RUN, *VALIDATE, *save)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    curve = losses(resumed.stdout)
    assert curve == pytest.approx(uninterrupted[-len(curve):], **SAME_LOSSES) and len(curve) >= 5


@pytest.mark.slow
def test_a_persistent_fault_saves_and_exits_16_for_a_rerun_elsewhere(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    save = ["checkpoint.save=" + str(ckpt)]
    faulted = bridge("pretrain", *RUN, *INJECT, "rerun_state_machine.error_injection_type=persistent_error", *save)
    assert faulted.returncode == 16, faulted.stderr[-3000:]
    assert "First rerun: unexpected result is reproducible within the tolerance" in faulted.stderr
    assert f"the loss of iteration 2 failed validation and came back on the re-run on this GPU; saved " \
           f"{ckpt / 'iter_0000001'} to re-run it from" in faulted.stdout and "Exit code 16." in faulted.stdout
    assert (ckpt / "latest_checkpointed_iteration.txt").read_text() == "1"
    from megatron.core.rerun_state_machine import RerunState

    assert saved_rerun_state(ckpt / "iter_0000001")["state"] == RerunState.WILL_RERUN_FROM_CHECKPOINT

    # resumed on the same node and device, megatron-core cannot decide: it stops again, saving nothing
    again = bridge("pretrain", *RUN, *VALIDATE, *save)
    assert again.returncode == 16, again.stderr[-3000:]
    assert "this job resumed on the node and GPU that produced it" in again.stdout
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000001"]

    # without the machine, training goes on from that checkpoint as if nothing had happened
    on = bridge("pretrain", *RUN, *save)
    assert on.returncode == 0, on.stderr[-3000:]
    assert "was saved to re-run iteration 2 on another GPU; rerun_state_machine.rerun_mode=disabled trains on" \
           in on.stdout
    assert losses(on.stdout) == pytest.approx(uninterrupted[1:], **SAME_LOSSES)
