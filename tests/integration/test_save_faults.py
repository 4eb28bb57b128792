"""A save that cannot be written, and two runs on one checkpoint.save folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO, bridge


def test_a_second_run_on_a_folder_in_use_stops_naming_the_holder(tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".bridge.lock").write_text(f"{socket.gethostname()} {os.getpid()}\n")  # this test: alive
    result = bridge("pretrain", "recipe=tiny", "train.train_iters=2", f"checkpoint.save={folder}")
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"another run (pid {os.getpid()} on {socket.gethostname()}) is saving there" in result.stderr
    assert "Traceback" not in result.stderr and not list(folder.glob("iter_*"))


def test_a_stale_lock_is_taken_over_and_released(cli, tmp_path):
    gone = subprocess.Popen(["true"])
    gone.wait()
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / ".bridge.lock").write_text(f"{socket.gethostname()} {gone.pid}\n")
    result = cli("pretrain", "recipe=tiny", "train.train_iters=2", "train.eval_iters=0", f"checkpoint.save={folder}")
    assert result.exit_code == 0, result.output
    assert f"taking over {folder / '.bridge.lock'} from a run that is gone" in result.output
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == "2"
    assert not (folder / ".bridge.lock").exists()


@pytest.mark.slow
def test_a_failed_save_names_the_folder_and_keeps_the_last_checkpoint(tmp_path):
    folder = tmp_path / "ckpt"
    args = ["recipe=tiny", "train.train_iters=20", "train.eval_iters=0", f"checkpoint.save={folder}"]
    first = bridge("pretrain", *args, "train.exit_interval=10")
    assert first.returncode == 0, first.stderr[-2000:]
    # a real write failure: a file-size limit makes the shard writes fail (Python ignores SIGXFSZ)
    limited = subprocess.run(["bash", "-c", 'ulimit -f 500; exec "$@"', "bash", sys.executable, "-m", "bridge_cli",
                              "pretrain", *args], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert limited.returncode == 1, limited.stderr[-3000:]
    error = limited.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: saving iteration 20 into {folder} failed: ") and "Traceback" not in limited.stderr
    assert "The previous checkpoint (iter_0000010) is still the one that loads." in error
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == "10"
    again = bridge("pretrain", *args)  # and it does: the run resumes from 10 and finishes
    assert again.returncode == 0 and "resuming at iteration 10" in again.stdout, again.stderr[-2000:]
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == "20"
