"""Ctrl-C with checkpoint.save set: the first finishes the step, saves and exits; a second exits at once."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, run_env

pytestmark = pytest.mark.slow


def start(save: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "bridge_cli", "pretrain", "recipe=tiny", "train.train_iters=100000",
                             f"checkpoint.save={save}", "logger.log_interval=1", "train.eval_iters=0"],
                            cwd=REPO, env=run_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def wait_for_iteration(proc: subprocess.Popen, n: int) -> list[str]:
    lines = []
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stdout.readline()
        lines.append(line)
        if line.startswith("iteration") and int(line.split()[1].split("/")[0]) >= n:
            return lines
    raise AssertionError("".join(lines[-20:]))


def test_first_ctrl_c_saves_and_exits(tmp_path):
    proc = start(tmp_path / "ckpt")
    wait_for_iteration(proc, 3)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    step = int(out.split("exiting at iteration ")[1].split(":")[0])
    assert "received SIGINT" in out and "Ctrl-C: finishing this iteration, saving a checkpoint" in err
    assert (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").read_text() == str(step)
    assert "Traceback" not in err


def test_second_ctrl_c_exits_at_once(tmp_path):
    proc = start(tmp_path / "ckpt")
    wait_for_iteration(proc, 3)
    proc.send_signal(signal.SIGINT)
    # signals do not queue (two at once arrive as one): the second goes once the first was seen,
    # while the step finishes or the checkpoint is written, both far longer than this round trip
    while "Ctrl-C: finishing this iteration" not in proc.stderr.readline():
        pass
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 130
    assert not (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").exists()
