"""A save that cannot be written, and two runs on one checkpoint.save folder."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from tests.conftest import REPO, bridge, run_env


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
                              "pretrain", *args], capture_output=True, text=True, cwd=REPO, env=run_env(), timeout=600)
    assert limited.returncode == 1, limited.stderr[-3000:]
    error = limited.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: saving iteration 20 into {folder} failed: ") and "Traceback" not in limited.stderr
    assert "The previous checkpoint (iter_0000010) is still the one that loads." in error
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == "10"
    again = bridge("pretrain", *args)  # and it does: the run resumes from 10 and finishes
    assert again.returncode == 0 and "resuming at iteration 10" in again.stdout, again.stderr[-2000:]
    assert (folder / "latest_checkpointed_iteration.txt").read_text() == "20"


FULL_DISK_RUN = """
mount -t tmpfs -o size=$1 tmpfs "$2/disk" || exit 99
[ -n "$4" ] && { mount -o remount,ro "$2/disk" || exit 99; }
"$3" -m bridge_cli pretrain recipe=tiny train.train_iters=20 train.eval_iters=0 checkpoint.save_interval=10 \\
  checkpoint.save="$2/disk/ckpt" > "$2/out" 2> "$2/err"
echo $? > "$2/rc"
ls -A "$2/disk/ckpt" > "$2/listing"
cat "$2/disk/ckpt/latest_checkpointed_iteration.txt" > "$2/tracker" 2> /dev/null
[ -s "$2/tracker" ] || exit 0  # nothing was saved: nothing to resume from
"$3" -m bridge_cli pretrain recipe=tiny train.train_iters=20 train.exit_interval=12 train.eval_iters=0 \\
  checkpoint.load="$2/disk/ckpt" > "$2/resumed" 2>&1
"""


def on_a_small_disk(tmp_path, size: str, read_only: bool = False) -> dict:
    """`bridge pretrain` saving into a tmpfs of ``size`` mounted in a private mount namespace (no root
    needed where user namespaces are allowed), then, where it saved a checkpoint, a run loading it; what
    each step left."""
    (tmp_path / "disk").mkdir()
    script = tmp_path / "run.sh"
    script.write_text(FULL_DISK_RUN)
    done = subprocess.run(["unshare", "-rm", "sh", str(script), size, str(tmp_path), sys.executable,
                           "ro" if read_only else ""],
                          capture_output=True, text=True, cwd=REPO, timeout=600)
    if done.returncode == 99 or not (tmp_path / "rc").exists():
        pytest.skip(f"cannot mount a tmpfs in a private namespace here: {done.stderr.strip()[-200:]}")
    return {name: (tmp_path / name).read_text() if (tmp_path / name).exists() else ""
            for name in ("rc", "err", "listing", "tracker", "resumed")}


@pytest.mark.slow
def test_a_disk_that_fills_during_the_first_save_is_named_and_the_partial_save_removed(tmp_path):
    run = on_a_small_disk(tmp_path, "4m")  # a tiny checkpoint is 7.5 MiB
    assert run["rc"].strip() == "1" and "Traceback" not in run["err"], run["err"][-3000:]
    error = run["err"].strip().splitlines()[-1]
    assert error.startswith(f"error: saving iteration 10 into {tmp_path}/disk/ckpt failed: the device holding it is "
                            "full (") and "The partial save was removed." in error, error
    assert "No earlier checkpoint is there." in error
    assert run["listing"].split() == [] and run["tracker"] == ""  # nothing half-written, no lock left


@pytest.mark.slow
def test_a_save_that_would_not_fit_is_refused_before_writing_and_the_last_one_loads(tmp_path):
    run = on_a_small_disk(tmp_path, "12m")  # room for one tiny checkpoint, not two
    assert run["rc"].strip() == "1" and "Traceback" not in run["err"], run["err"][-3000:]
    error = run["err"].strip().splitlines()[-1]
    assert error.startswith(f"error: saving iteration 20 into {tmp_path}/disk/ckpt needs about 7.") and \
        "MiB (the size of the last checkpoint) and " in error, error
    assert "The previous checkpoint (iter_0000010) is still the one that loads." in error
    assert run["listing"].split() == ["iter_0000010", "latest_checkpointed_iteration.txt"]
    assert run["tracker"] == "10" and "resuming at iteration 10" in run["resumed"], run["resumed"][-2000:]


@pytest.mark.slow
def test_a_read_only_checkpoint_folder_is_refused_before_training(tmp_path):
    run = on_a_small_disk(tmp_path, "4m", read_only=True)
    assert run["rc"].strip() == "2" and "Traceback" not in run["err"], run["err"][-3000:]
    assert f"checkpoint.save: {tmp_path}/disk/ckpt is on a read-only file system ({tmp_path}/disk)" in run["err"]
    assert "consumed samples" not in (tmp_path / "out").read_text()  # refused before any training step
