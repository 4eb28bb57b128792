"""Fault tolerance under ft_launcher (nvidia-resiliency-ext, tested with 0.4.1 on the CPU): a 2-rank run in
which one rank hangs or dies is detected, every worker is restarted, resumes from the last checkpoint and
prints the uninterrupted run's loss at every iteration (bitwise up to the printed digits); the timeouts the
run computed before the fault are the ones its restart loads."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from bridge_cli.config.runtime_configs import resilience_missing
from tests.bounded_run import kill_every_process_of
from tests.conftest import REPO, RUN_ENV, bridge, torchrun
from tests.integration.test_checkpoint_resume import LOSS, losses

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(resilience_missing(), reason="needs nvidia-resiliency-ext")]

ITERS = 100
ARGS = ["recipe=tiny", f"train.train_iters={ITERS}", "logger.log_interval=1", "train.eval_iters=0",
        "checkpoint.save_interval=5"]
CHECK_INTERVAL = 0.5
OUT_OF_SECTION = 10
LAUNCHER = [sys.executable, "-m", "nvidia_resiliency_ext.fault_tolerance.launcher", "--standalone",
            "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=0.1",
            "--ft-rank-section-timeouts=setup:600,step:180,checkpointing:420",
            # bridge does not compute this one (runtime/fault_tolerance.py); a rank stopped in the milliseconds
            # between two sections is caught by it
            f"--ft-rank-out-of-section-timeout={OUT_OF_SECTION}",
            # a computed timeout is 10x the longest time seen (5x by default): fewer false hangs on a busy machine
            "--ft-safety-factor=10", f"--ft-workload-check-interval={CHECK_INTERVAL}"]
# A first job under ft_launcher trains 20 iterations (train.exit_interval) and computes its timeouts; each test
# continues it in a copy with a fault 5-6 s into training: past a save (every 5 iterations), before the end
# (80 iterations, 7-8 s), with the timeouts the first job computed in force wherever the fault strikes.
FAULT = ["ft.simulate_fault=true", "ft.simulated_fault_base_delay=5"]
FT = ["ft.enable_ft_package=true", "ft.calc_ft_timeouts=true"]

FAULT_LINE = re.compile(r"simulated fault \((\w+)\): rank (\d) .* at ([0-9.]+), ")
TIMEOUTS = re.compile(r"fault tolerance: timeouts (?:computed \(.*?\), kept in|from) \S+ft_state\.json: "
                      r".*?step (\S+) s \(computed\), checkpointing (\S+) s \(computed\)")
FRESH = {**RUN_ENV, "OMP_NUM_THREADS": "1"}
"""The environment of a run under ft_launcher: fresh processes, not forks of the worker's server (tests/fork_shim),
since the launcher stops a rank by signalling its process, which a forked run outlives: an orphan that held the
template's output pipe open kept a Slurm test waiting after ft_launcher had exited."""
HANG = re.compile(r"(?:\[RankMonServer(\d+)@.*?\]|\[workload:[^\]]*?\(([\d?]+)\)[^\]]*\] rank_monitor_server\.py:\d+ "
                  r"\[Cycle \d+\]) (?:Section '(\w+)' has been open|Was (out of section)) for ([0-9.]+) seconds\. "
                  r"Timeout is ([0-9.]+) seconds\.")
"""A rank monitor's report of a hang: nvidia-resiliency-ext 0.4's ``[RankMonServer<rank>@...]`` prefix or 0.7's
``[workload:<rank>(<local rank>) ...] rank_monitor_server.py:<line> [Cycle <n>]``."""
RESUMED = re.compile(r"resuming at iteration (\d+)")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, str]:
    """The loss at every iteration of the run under torchrun, without fault tolerance."""
    result = torchrun(2, "pretrain", *ARGS, f"checkpoint.save={tmp_path_factory.mktemp('reference') / 'ckpt'}")
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(result.stdout)


@pytest.fixture(scope="module")
def first_job(tmp_path_factory) -> tuple[Path, str]:
    """The checkpoint folder of the first 20 iterations under ft_launcher (with ft_state.json), and their output."""
    root = tmp_path_factory.mktemp("first_job") / "ckpt"
    out = under_ft_launcher(root, *FT, "train.exit_interval=20")
    assert max(losses(out)) == 20 and TIMEOUTS.search(out), out[-3000:]
    return root, out


def under_ft_launcher(root: Path, *overrides: str, timeout: int = 300, launcher: list[str] = LAUNCHER) -> str:
    """The merged output of `LAUNCHER -m bridge_cli pretrain ARGS checkpoint.save=ROOT OVERRIDES`, written to
    ROOT.log as it runs; asserts it succeeded."""
    log = root.parent / f"{root.name}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([*launcher, "-m", "bridge_cli", "pretrain", *ARGS, f"checkpoint.save={root}",
                                 *overrides], cwd=REPO, env=FRESH, stdout=out,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            kill_every_process_of(proc.pid)  # the launcher starts each worker in a session of its own
            proc.wait()
    text = log.read_text()
    assert proc.returncode == 0, text[-5000:]
    return text


def faulty_run(first_job: tuple[Path, str], root: Path, *fault: str) -> str:
    """The first job continued in a copy of its folder under ft_launcher with ``fault``; the output of both."""
    shutil.copytree(first_job[0], root)
    return first_job[1] + under_ft_launcher(root, *FT, *FAULT, *fault)


def restarted_after_fault(out: str, kind: str, rank: int) -> tuple[str, str]:
    """(what was printed before the fault, after it); checks the fault happened once, as asked, and the run
    resumed from the last checkpoint saved before it."""
    faults = FAULT_LINE.findall(out)
    assert [(k, int(r)) for k, r, _ in faults] == [(kind, rank)], out[-5000:]  # the restart runs clean
    before, after = out.split(faults[0][2], 1)
    saved = [int(i) for i in re.findall(r"checkpoint \S+/iter_(\d+) saved", before)]
    assert saved and saved[-1] < ITERS, before[-3000:]
    # the last save said so, or the one the fault struck as the logging rank was about to say so
    resumed = [int(i) for i in RESUMED.findall(after)]
    assert len(resumed) == 1 and saved[-1] <= resumed[0] <= max(losses(before)), (saved, resumed)
    return before, after


def test_a_hung_rank_is_detected_within_the_computed_timeout_and_the_run_resumes(uninterrupted, first_job, tmp_path):
    out = faulty_run(first_job, tmp_path / "ckpt", "ft.simulated_fault_type=rank_hung", "ft.simulated_fault_rank=1")
    before, after = restarted_after_fault(out, "rank_hung", 1)
    step, checkpointing = TIMEOUTS.findall(before)[-1]  # the timeouts in force when the rank hung
    in_force = {"step": step, "checkpointing": checkpointing, "out of section": f"{OUT_OF_SECTION:.2f}"}
    hangs = {}
    for seen in HANG.finditer(after):  # a monitor repeats it each check until the rank is gone
        hangs.setdefault(seen[1] or seen[2], seen.groups()[2:])
    assert hangs, after[-3000:]
    for section, out_of_section, open_for, timeout in hangs.values():  # each rank's monitor that saw it first
        section = section or out_of_section
        assert timeout == in_force[section], (section, timeout, in_force)
        assert float(open_for) <= float(timeout) + CHECK_INTERVAL + 0.5, (section, open_for, timeout)
    assert TIMEOUTS.findall(after)[0] == (step, checkpointing)  # the restart loads them
    same_losses(out, uninterrupted)


def test_a_killed_rank_is_restarted_and_the_run_ends_as_uninterrupted(uninterrupted, first_job, tmp_path):
    out = faulty_run(first_job, tmp_path / "ckpt", "ft.simulated_fault_type=rank_killed", "ft.simulated_fault_rank=0")
    _, after = restarted_after_fault(out, "rank_killed", 0)
    # the launcher sees rank 0 killed, or rank 1 failing in a collective with it, first
    assert re.search(r"failed \(exitcode: (-9|1)\) local_rank: [01]", after), after[-3000:]
    same_losses(out, uninterrupted)


def same_losses(out: str, uninterrupted: dict[int, str]) -> None:
    """Every iteration printed, before the fault and again after the restart, has the uninterrupted loss."""
    printed = LOSS.findall(out)
    assert {int(i) for i, _ in printed} == set(uninterrupted), out[-3000:]
    assert [(int(i), loss) for i, loss in printed if uninterrupted[int(i)] != loss] == []


def test_without_ft_launcher_the_run_says_how_to_start_it(tmp_path):
    result = bridge("pretrain", *ARGS, f"checkpoint.save={tmp_path / 'ckpt'}", "ft.enable_ft_package=true")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "ft.enable_ft_package=true needs the run started by ft_launcher" in result.stderr
    assert "--ft-rank-section-timeouts=setup:600,step:180,checkpointing:420" in result.stderr


def test_the_slurm_template_restarts_both_nodes_after_a_fault(tmp_path):
    from tests.integration.test_slurm_templates import sbatch

    args = ["recipe=tiny", "train.train_iters=60", "logger.log_interval=1", "train.eval_iters=0",
            "checkpoint.save_interval=5", f"checkpoint.save={tmp_path / 'ckpt'}", *FAULT,
            "ft.simulated_fault_type=rank_killed", "ft.simulated_fault_rank=1", "ft.simulated_fault_base_delay=3"]
    result = sbatch("ft_multi_node.sbatch", tmp_path, *args, hand_off=False)
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-5000:]
    assert len(FAULT_LINE.findall(out)) == 1 and "data-parallel groups: [0,1]" in out, out[-5000:]
    assert len(re.findall(r"has joined round 1 of the rendezvous", out)) == 2, out[-3000:]  # both nodes restarted
    # each node's launcher stops its workers with the template's 5 s between SIGTERM and SIGKILL, not its own 15 or 30 s
    assert re.findall(r"Stopping workers\.\.\. Timeout = (\S+) sec", out) == ["5.0", "5.0"], out[-3000:]
    printed = LOSS.findall(out)
    assert max(int(i) for i, _ in printed) == 60, out[-3000:]
    again = {}  # iterations run before the fault and again after the restart
    for i, loss in printed:
        assert again.setdefault(i, loss) == loss, (i, loss, again[i])  # and printed the same loss


def test_a_launcher_without_bridge_sections_is_told_the_flags(tmp_path):
    launcher = [arg for arg in LAUNCHER if not arg.startswith(("--ft-rank-section", "--max-restarts"))]
    result = subprocess.run([*launcher, "-m", "bridge_cli", "pretrain", *ARGS, f"checkpoint.save={tmp_path / 'ckpt'}",
                             *FT], cwd=REPO, env=FRESH, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode != 0
    assert ("error: ft.enable_ft_package=true: ft_launcher was started without bridge's sections setup, step, "
            "checkpointing. Start it with --ft-rank-section-timeouts=setup:600,step:180,checkpointing:420") \
        in result.stdout + result.stderr, result.stderr[-3000:]
