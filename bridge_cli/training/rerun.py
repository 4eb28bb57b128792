"""megatron-core's rerun state machine in a bridge run: built from ``rerun_state_machine.*``, fed the
training data through replayable iterators, paused during evaluation, and its exit decisions said in one line.

The machine (``megatron.core.rerun_state_machine``) re-runs a step whose loss failed validation
(:func:`bridge_cli.training.losses.validate_loss`) on the same data and random state. A result that
does not come back was a transient fault: a non-fatal check (spiky loss) carries on, a fatal one
(NaN/Inf) stops the run with exit code 17. A result that comes back needs a re-run on another GPU:
the machine asks for a checkpoint and exit code 16, and the job resumed from it elsewhere tells a
persistent fault (17) from a correct result. ``train_step`` drives it (``should_run_forward_backward``,
``should_checkpoint_and_exit``); checkpoints carry its state under ``rerun_state_machine``.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional

from bridge_cli.runtime.mcore_import import megatron_core_version


def initialize(cfg) -> None:
    """Set up megatron-core's machine from ``cfg`` (the RerunStateMachineConfig), as Megatron-LM does."""
    from megatron.core import tensor_parallel
    from megatron.core.rerun_state_machine import (RerunDiagnostic, RerunErrorInjector, RerunMode,
                                                   initialize_rerun_state_machine)

    # The machine saves Python's, NumPy's, torch's and the CUDA generators itself; dropout under
    # tensor parallelism and recomputation draw from megatron-core's RNG tracker.
    def save_tracker() -> dict:
        return {"rng_tracker_states": tensor_parallel.get_cuda_rng_tracker().get_states()}

    def restore_tracker(saved: dict) -> None:
        tensor_parallel.get_cuda_rng_tracker().set_states(saved["rng_tracker_states"])

    initialize_rerun_state_machine(
        state_save_func=save_tracker, state_restore_func=restore_tracker, mode=RerunMode(cfg.rerun_mode),
        error_injector=RerunErrorInjector(cfg.error_injection_rate, RerunDiagnostic(cfg.error_injection_type)))
    if cfg.rerun_mode == RerunMode.REPORT_DETERMINISM_STATS:
        from bridge_cli.logging.python_logging import show_info_records

        show_info_records("megatron.core.rerun_state_machine")  # where megatron-core logs the statistics


def replayable(data_iterator):
    """``data_iterator`` (or each of a list, one per virtual pipeline stage) able to replay a step's micro-batches."""
    from megatron.core.rerun_state_machine import RerunDataIterator

    if isinstance(data_iterator, list):
        return [replayable(it) for it in data_iterator]
    return None if data_iterator is None else RerunDataIterator(data_iterator)


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """Evaluation validates nothing and re-runs nothing (Megatron-LM's evaluate does the same)."""
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    machine = get_rerun_state_machine()
    mode = machine.get_mode()
    if mode == RerunMode.DISABLED:
        yield
        return
    machine.set_mode(RerunMode.DISABLED)
    try:
        yield
    finally:
        machine.set_mode(mode)


def went_on_line(iteration: int, runs: int) -> Optional[str]:
    """What to say when ``iteration`` ran ``runs`` times and training goes on, or None.

    In validate_results only a non-fatal check (spiky loss) carries on after a re-run: a fatal one
    (NaN/Inf) stops the run either way. report_determinism_stats re-runs every step and says nothing.
    """
    from megatron.core.rerun_state_machine import RerunMode, get_rerun_state_machine

    if runs < 2 or get_rerun_state_machine().get_mode() != RerunMode.VALIDATE_RESULTS:
        return None
    return (f"rerun state machine: iteration {iteration} failed a non-fatal check (spiky loss) and was re-run on the "
            "same data; training goes on with the re-run's result.")


def start_at(step: int) -> None:
    """Make the machine's next iteration ``step + 1``, the one this run trains next (a resumed run's
    machine counts from its checkpoint), so its messages and bridge's name the same iteration.
    megatron-core 0.17 counts from 0 inside the machine and prints one more; 0.16 printed its count."""
    from megatron.core.rerun_state_machine import get_rerun_state_machine

    get_rerun_state_machine().current_iteration = step - 1 if megatron_core_version() >= (0, 17) else step


def exit_line(exit_code: int, iteration: int, saved: Optional[Path], save_dir: Optional[str]) -> str:
    """What the machine's decision to stop at ``iteration`` means and what to do, naming ``saved`` (the
    checkpoint it asked for, if any) and the exit code."""
    from megatron.core.rerun_state_machine import RerunState, get_rerun_state_machine

    state = get_rerun_state_machine().state
    head = f"rerun state machine: the loss of iteration {iteration} failed validation"
    if state == RerunState.WILL_RERUN_FROM_CHECKPOINT:
        where = (f"saved {saved} to re-run it from" if saved else
                 "checkpoint.save is not set, so there is no checkpoint to re-run it from")
        what = (f"and came back on the re-run on this GPU; {where}. Resume on another node or GPU to tell a "
                "faulty GPU from a correct result (resumed here, it stops again)")
    elif state == RerunState.RERUNNING_AGAIN_FROM_CHECKPOINT:
        what = ("and this job resumed on the node and GPU that produced it, so the re-run cannot tell a faulty "
                "GPU from a correct result. Resume on another node or GPU, or with "
                "rerun_state_machine.rerun_mode=disabled to go on without the check")
    elif state == RerunState.RERUNNING_IN_PLACE:
        kept = f"; saved {saved}" if saved else ""
        what = (f"and did not come back on the re-run: a transient fault{kept}. Resume from the last checkpoint"
                + (f" in {save_dir}" if save_dir else "") + " to go on")
    else:  # RERUNNING_FROM_CHECKPOINT: the resumed job's re-run on another GPU has decided
        what = ("and was re-run on another GPU: megatron-core's diagnosis above says whether the GPU that first "
                "produced it is faulty (a persistent fault) or the result was correct (the run itself diverged)")
    return f"{head} {what}. Exit code {exit_code}."
