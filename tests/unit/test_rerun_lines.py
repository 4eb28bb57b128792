"""The rerun state machine as `bridge` builds it from ``rerun_state_machine.*`` and what bridge says of each of
its decisions, without a training run (tests/integration/test_rerun_state_machine.py runs the faults, `slow`)."""

from __future__ import annotations

from pathlib import Path

import pytest
from megatron.core.rerun_state_machine import (RerunDiagnostic, RerunMode, RerunState,
                                               destroy_rerun_state_machine, get_rerun_state_machine)

from bridge_cli.config.runtime_configs import RerunStateMachineConfig
from bridge_cli.training import rerun


@pytest.fixture
def machine():
    rerun.initialize(RerunStateMachineConfig(rerun_mode="validate_results", error_injection_rate=1,
                                             error_injection_type="persistent_error"))
    yield get_rerun_state_machine()
    destroy_rerun_state_machine()


def test_the_machine_is_built_from_the_config(machine):
    assert machine.get_mode() == RerunMode.VALIDATE_RESULTS
    assert machine.error_injector.error_injection_rate == 1
    assert machine.error_injector.error_injection_type == RerunDiagnostic.PERSISTENT_ERROR


def test_a_step_run_twice_in_validate_results_goes_on_and_says_so(machine):
    assert rerun.went_on_line(4, 2) == ("rerun state machine: iteration 4 failed a non-fatal check (spiky loss) and "
                                        "was re-run on the same data; training goes on with the re-run's result.")
    assert rerun.went_on_line(4, 1) is None  # run once: nothing failed
    with rerun.paused():  # evaluation: the machine validates nothing, and a re-run is not reported
        assert machine.get_mode() == RerunMode.DISABLED
        assert rerun.went_on_line(4, 2) is None
    assert machine.get_mode() == RerunMode.VALIDATE_RESULTS


@pytest.mark.parametrize("state, exit_code, says", [
    (RerunState.RERUNNING_IN_PLACE, 17,
     "did not come back on the re-run: a transient fault; saved /ck/iter_0000002. Resume from the last checkpoint "
     "in /ck to go on. Exit code 17."),
    (RerunState.WILL_RERUN_FROM_CHECKPOINT, 16,
     "came back on the re-run on this GPU; saved /ck/iter_0000002 to re-run it from. Resume on another node or GPU"),
    (RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT, 16,
     "this job resumed on the node and GPU that produced it, so the re-run cannot tell a faulty GPU from a correct "
     "result. Resume on another node or GPU, or with rerun_state_machine.rerun_mode=disabled"),
    (RerunState.RERUNNING_FROM_CHECKPOINT, 17, "was re-run on another GPU: megatron-core's diagnosis above says"),
])
def test_each_decision_to_stop_names_the_iteration_the_checkpoint_and_the_exit_code(machine, state, exit_code, says):
    machine.state = state
    line = rerun.exit_line(exit_code, 3, Path("/ck/iter_0000002"), "/ck")
    assert line.startswith("rerun state machine: the loss of iteration 3 failed validation and ")
    assert says in line and line.endswith(f"Exit code {exit_code}.")


def test_a_fault_that_came_back_without_checkpoint_save_says_there_is_nothing_to_rerun_from(machine):
    machine.state = RerunState.WILL_RERUN_FROM_CHECKPOINT
    assert "checkpoint.save is not set, so there is no checkpoint to re-run it from" in rerun.exit_line(16, 3, None, None)
