"""The suite's hand-off (tests/fork_shim): a bridge interpreter started with `run_env()` gives its run to the
worker's fork server instead of importing torch itself, and stays what its parent waits on."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run_env
from tests.forked_cli import SOCKET_VARIABLE

pytestmark = pytest.mark.slow


def resident_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def test_a_bridge_interpreter_hands_its_run_over_and_waits_for_it():
    env = run_env()
    if SOCKET_VARIABLE not in env:
        pytest.skip("runs start fresh here (a GPU is visible, or BRIDGE_TEST_FRESH_PROCESSES=1)")
    proc = subprocess.Popen([sys.executable, "-m", "bridge_cli", "pretrain", "recipe=tiny", "train.train_iters=100000",
                             "logger.log_interval=1", "train.eval_iters=0"], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for line in proc.stdout:
        if line.startswith("iteration"):
            break
    # the run trains in the fork; this interpreter never imported torch (a fresh bridge holds several hundred MiB)
    held = resident_mib(proc.pid)
    proc.terminate()  # forwarded to the run, which dies of it (no exit_signal_handler): so does this interpreter
    _, err = proc.communicate(timeout=120)
    assert held < 64, held
    assert proc.returncode == -signal.SIGTERM, err[-3000:]
