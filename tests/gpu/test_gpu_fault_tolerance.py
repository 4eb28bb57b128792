"""Fault tolerance on 2 GPUs over NCCL (test_fault_tolerance.py's main case, on cuda): a run under ft_launcher in
which rank 0 is killed, or rank 1 hangs, is restarted, resumes from the last checkpoint and prints the
uninterrupted run's loss at every iteration, to TOLERANCE. Each test prints what the restart cost, measured
(run with -s): seconds from the fault to the launcher or monitor seeing it, to the new workers having loaded the
checkpoint, to their first step.

    python -m pytest -q -s -n 0 tests/gpu/test_gpu_fault_tolerance.py

Not run yet: written without a GPU machine (docs/resilience.md#not-tested-yet)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest
import torch

from bridge_cli.config.runtime_configs import resilience_missing
from tests.conftest import torchrun
from tests.gpu.test_gpu_optimizer_layouts import TOLERANCE
from tests.integration.test_checkpoint_resume import LOSS, losses
from tests.integration.test_fault_tolerance import (ARGS, FAULT_LINE, FT, HANG, LAUNCHER, RESUMED,
                                                    restarted_after_fault, under_ft_launcher)

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs"),
              pytest.mark.skipif(resilience_missing(), reason="needs nvidia-resiliency-ext")]

# A GPU step of `tiny` takes milliseconds, so the CPU test's 10x computed step timeout would be a fraction of a
# second, which a garbage collection can pass; 50x keeps it at a few seconds, and the hang is seen in those.
# Until 16 steps were timed the launcher's own step timeout holds: 30 s, not 180, for a hang that comes early.
GPU_LAUNCHER = [*(arg.replace("step:180", "step:30") for arg in LAUNCHER), "--ft-safety-factor=50"]
# 8 micro-batches a step, not 1: a GPU step of `tiny` is bound by its kernel launches, so this makes it about 8
# times as long, and 100 iterations with 20 saves last several seconds: the fault lands well inside them
LONGER_STEPS = "train.global_batch_size=64"
ELAPSED = re.compile(r"^iteration\s+\d+/\d+ .*?\| elapsed ms/iter ([0-9.]+) ", re.M)
SAVED = re.compile(r"^checkpoint \S+ saved in ([0-9.]+) s", re.M)
START_UP = re.compile(r"^start-up .*$", re.M)
TIMEOUTS_LINE = re.compile(r"^fault tolerance: .*timeouts.*$", re.M)
SEEN = re.compile(r"failed \(exitcode: -?\d+\) local_rank|" + HANG.pattern)  # the launcher's line, or a monitor's


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[dict[int, str], float]:
    """The loss at every iteration of the run under torchrun, without fault tolerance, and the seconds its steps
    and saves took."""
    result = torchrun(2, "pretrain", *ARGS, LONGER_STEPS,
                      f"checkpoint.save={tmp_path_factory.mktemp('reference') / 'ckpt'}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "bridge: cuda (nccl), world 2" in result.stdout, result.stdout[-3000:]
    seconds = (sum(float(ms) for ms in ELAPSED.findall(result.stdout)) / 1000
               + sum(float(s) for s in SAVED.findall(result.stdout)))
    return losses(result.stdout), seconds


class StampedLog:
    """Each line of a log that another process writes, with the time.time() this one first read it (every 20 ms)."""

    def __init__(self, path: Path) -> None:
        self.path, self.lines = path, []
        self._done = threading.Event()
        self._reader = threading.Thread(target=self._follow, daemon=True)

    def __enter__(self) -> "StampedLog":
        self._reader.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._reader.join()

    def _follow(self) -> None:
        while not self.path.exists() and not self._done.wait(0.02):
            pass
        if not self.path.exists():
            return
        partial = ""
        with open(self.path) as log:
            while True:
                done = self._done.is_set()  # read once more after the writer has ended
                partial += log.read()
                *complete, partial = partial.split("\n")
                now = time.time()
                self.lines += [(now, line) for line in complete]
                if done:
                    return
                self._done.wait(0.02)

    def after(self, pattern: re.Pattern, start: int = 0) -> int:
        """The index of the first line at ``start`` or later that matches ``pattern``."""
        found = next((i for i in range(start, len(self.lines)) if pattern.search(self.lines[i][1])), None)
        assert found is not None, f"no line matching {pattern.pattern!r} in {self.path} after line {start}"
        return found


def faulty_run(root: Path, seconds: float, kind: str, rank: int) -> tuple[str, StampedLog]:
    """The run under ft_launcher with ``kind`` on ``rank`` about a third into the uninterrupted run's ``seconds`` of
    steps and saves: past its first saves (every 5 iterations), well before its end."""
    assert seconds > 2.5, f"the uninterrupted run's steps and saves took {seconds:.1f} s: too short to hit"
    fault = ["ft.simulate_fault=true", f"ft.simulated_fault_base_delay={max(1, int(seconds / 3))}",
             f"ft.simulated_fault_type={kind}", f"ft.simulated_fault_rank={rank}"]
    with StampedLog(root.parent / f"{root.name}.log") as log:
        out = under_ft_launcher(root, LONGER_STEPS, *FT, *fault, launcher=GPU_LAUNCHER)
    return out, log


def report_restart_cost(kind: str, out: str, log: StampedLog) -> None:
    """Print where the seconds from the fault to the restarted workers' first step went."""
    fault = log.after(FAULT_LINE)
    fault_at = float(FAULT_LINE.search(log.lines[fault][1]).group(3))  # when the rank struck, by its own clock
    seen, loaded = log.after(SEEN, fault + 1), log.after(RESUMED, fault + 1)
    first_step = log.after(LOSS, loaded + 1)
    before = out.split(log.lines[fault][1], 1)[0]
    resumed_at = int(RESUMED.search(log.lines[loaded][1]).group(1))
    print(f"\nrestart cost on 2 GPUs ({kind}): from the fault {log.lines[seen][0] - fault_at:.2f} s to the launcher "
          f"or a monitor seeing it, {log.lines[loaded][0] - fault_at:.2f} s to the new workers' checkpoint loaded "
          f"(iteration {resumed_at}), {log.lines[first_step][0] - fault_at:.2f} s to their first step; "
          f"{max(losses(before)) - resumed_at} iterations redone. {TIMEOUTS_LINE.findall(before)[-1]}. The new "
          f"workers' {START_UP.findall(out)[-1]}")


def same_losses(out: str, uninterrupted: dict[int, str]) -> None:
    """Every iteration printed, before the fault and again after the restart, has the uninterrupted loss to
    TOLERANCE: the same kernels on the same GPUs, whose only run-to-run differences are sums ordered by atomics
    (fp32: far below it), where a restart that lost the Adam moments, the data position or the learning-rate
    schedule moves the loss by far more (TOLERANCE's own justification)."""
    printed = LOSS.findall(out)
    assert {int(i) for i, _ in printed} == set(uninterrupted), out[-3000:]
    far = [(int(i), loss, uninterrupted[int(i)]) for i, loss in printed
           if float(loss) != pytest.approx(float(uninterrupted[int(i)]), rel=TOLERANCE)]
    assert far == []
    same = sum(loss == uninterrupted[int(i)] for i, loss in printed)
    print(f"losses equal to the uninterrupted run's as printed (6 decimals): {same} of {len(printed)}")


def test_a_killed_rank_is_restarted_and_the_run_ends_as_uninterrupted(uninterrupted, tmp_path):
    reference, seconds = uninterrupted
    out, log = faulty_run(tmp_path / "ckpt", seconds, "rank_killed", 0)
    restarted_after_fault(out, "rank_killed", 0)
    report_restart_cost("rank_killed", out, log)  # before the losses' check: what it measured counts either way
    same_losses(out, reference)


def test_a_hung_rank_is_detected_restarted_and_the_run_ends_as_uninterrupted(uninterrupted, tmp_path):
    reference, seconds = uninterrupted
    out, log = faulty_run(tmp_path / "ckpt", seconds, "rank_hung", 1)
    _, after = restarted_after_fault(out, "rank_hung", 1)
    assert HANG.search(after), after[-3000:]  # a monitor saw the hang (not only a collective failing after it)
    report_restart_cost("rank_hung", out, log)  # before the losses' check: what it measured counts either way
    same_losses(out, reference)
