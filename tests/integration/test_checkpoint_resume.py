"""Checkpoints through the real CLI: a stopped, killed or resharded run resumes where it stopped.

The reference is one uninterrupted 40-iteration `tiny` run; every resumed run must print the
same loss at every iteration (bitwise on one process, to 1e-5 across tensor-parallel layouts).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.conftest import REPO, bridge, run, run_env, torchrun
from tests.doc_text import commands as doc_commands, section

ARGS = ["recipe=tiny", "train.train_iters=40", "logger.log_interval=1", "train.eval_iters=0"]
LOSS = re.compile(r"^iteration\s+(\d+)/\d+ .*\| lm loss ([0-9.]+) ", re.M)

pytestmark = pytest.mark.slow


def losses(output: str) -> dict[int, str]:
    """Iteration -> the loss as printed (compared as text: bitwise up to the printed digits)."""
    return {int(i): loss for i, loss in LOSS.findall(output)}


def ok(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    return result.stdout


def tracker(root: Path) -> str:
    return (root / "latest_checkpointed_iteration.txt").read_text()


def iterations(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith("iter_"))


def kill_when_paused(args: list[str], paused_dir: Path) -> str:
    """Run `bridge pretrain` with the save at ``paused_dir`` held open (pause_before_publish.py), kill -9
    it there; its stdout.

    The whole process group is killed, as a scheduler kills a job: megatron-core's checkpoint writer
    leaves helper processes (a multiprocessing manager) that would otherwise outlive the run. The
    interpreter hands its run to the fork server (run_env), which kills the fork's group with it.
    """
    proc = subprocess.Popen([sys.executable, "-m", "tests.integration.pause_before_publish",
                             str(int(paused_dir.name[5:12])), "pretrain", *args], cwd=REPO, env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    deadline = time.time() + 120
    while not (paused_dir / "run_config.yaml").exists():  # written last, just before the rename
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    return out


@pytest.fixture(scope="module")
def reference() -> dict[int, str]:
    curve = losses(ok(bridge("pretrain", *ARGS)))
    assert sorted(curve) == list(range(1, 41))
    return curve


@pytest.fixture(scope="module")
def stopped_at_20(tmp_path_factory) -> Path:
    """A TP=1 run stopped by train.exit_interval=20: its checkpoint folder (copy it before use)."""
    root = tmp_path_factory.mktemp("stopped") / "ckpt"
    out = ok(bridge("pretrain", *ARGS, f"checkpoint.save={root}", "train.exit_interval=20"))
    assert f"checkpoint {root}/iter_0000020 saved" in out and "exiting at iteration 20" in out
    assert max(losses(out)) == 20
    return root


def test_stopped_run_resumes_with_the_same_losses(reference, stopped_at_20, tmp_path):
    root = tmp_path / "ckpt"
    shutil.copytree(stopped_at_20, root)
    assert tracker(root) == "20" and iterations(root) == ["iter_0000020"]
    files = {p.name for p in (root / "iter_0000020").iterdir()}
    assert {"metadata.json", ".metadata", "run_config.yaml"} <= files  # and common.pt before megatron-core 0.19
    assert any(name.endswith(".distcp") for name in files)
    saved = yaml.safe_load((root / "iter_0000020" / "run_config.yaml").read_text())
    assert saved["model"]["num_layers"] == 2 and saved["checkpoint"]["save"] == str(stopped_at_20)

    out = ok(bridge("pretrain", *ARGS, f"checkpoint.save={root}"))
    assert f"loaded checkpoint {root}/iter_0000020" in out and "consumed samples 160" in out
    resumed = losses(out)
    assert sorted(resumed) == list(range(21, 41))
    assert resumed == {i: reference[i] for i in range(21, 41)}
    assert tracker(root) == "40" and iterations(root) == ["iter_0000020", "iter_0000040"]


def test_sigterm_saves_and_exits_0_then_resume_continues(reference, tmp_path):
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-m", "bridge_cli", "pretrain", *ARGS, f"checkpoint.save={root}",
                             "train.exit_signal_handler=true"], cwd=REPO, env=run_env(), text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if line.startswith("iteration  5/40"):
            proc.send_signal(signal.SIGTERM)
            break
    out = "".join(lines) + proc.stdout.read()
    proc.wait(timeout=120)
    assert proc.returncode == 0, out + proc.stderr.read()
    stopped = int(re.search(r"exiting at iteration (\d+): received SIGTERM", out).group(1))
    assert 5 <= stopped < 40 and max(losses(out)) == stopped
    assert tracker(root) == str(stopped) and iterations(root) == [f"iter_{stopped:07d}"]

    resumed = losses(ok(bridge("pretrain", *ARGS, f"checkpoint.save={root}")))
    assert resumed == {i: reference[i] for i in range(stopped + 1, 41)}


def test_kill_9_during_a_save_resumes_from_the_previous_checkpoint(reference, tmp_path):
    root = tmp_path / "ckpt"
    out = kill_when_paused([*ARGS, f"checkpoint.save={root}", "checkpoint.save_interval=10"],
                           root / "iter_0000020.incomplete")
    assert max(losses(out)) == 20
    assert tracker(root) == "10" and iterations(root) == ["iter_0000010", "iter_0000020.incomplete"]

    out = ok(bridge("pretrain", *ARGS, f"checkpoint.save={root}", "checkpoint.save_interval=10"))
    assert out.count("iter_0000020.incomplete: a save was interrupted") == 1
    assert f"loaded checkpoint {root}/iter_0000010" in out
    assert losses(out) == {i: reference[i] for i in range(11, 41)}
    assert iterations(root) == ["iter_0000010", "iter_0000020", "iter_0000030", "iter_0000040"]


@pytest.mark.parametrize("layout, started, saved_as", [
    ("model.tensor_model_parallel_size=2", "TP 2", "pipeline x tensor parallel 1 x 2"),
    ("model.pipeline_model_parallel_size=2", "PP 2", "pipeline x tensor parallel 2 x 1"),
], ids=["tensor", "pipeline"])
def test_checkpoints_reshard_between_parallel_sizes(reference, stopped_at_20, tmp_path, layout, started, saved_as):
    """One process (saved at 20) -> TP=2 or PP=2 (resumes, saves at 30) -> one process (resumes to 40), optimizer
    state included."""
    root = tmp_path / "ckpt"
    shutil.copytree(stopped_at_20, root)
    out = ok(torchrun(2, "pretrain", *ARGS, f"checkpoint.save={root}", layout, "train.exit_interval=30"))
    assert started in out and f"loaded checkpoint {root}/iter_0000020" in out
    assert "saved with pipeline x tensor parallel 1 x 1; the RNG states are not restored" in out
    parallel = losses(out)
    out = ok(bridge("pretrain", *ARGS, f"checkpoint.save={root}"))
    assert f"loaded checkpoint {root}/iter_0000030" in out and saved_as in out
    assert "optimizer starts fresh" not in out
    resumed = {**parallel, **losses(out)}
    assert sorted(resumed) == list(range(21, 41))
    for i in range(21, 41):
        assert float(resumed[i]) == pytest.approx(float(reference[i]), rel=1e-5), i


def test_keep_last_k_and_non_persistent_checkpoints(tmp_path):
    """Persistent saves every 4 (keep 2), non-persistent every step (keep 1); a kill at 12 resumes from 11."""
    root = tmp_path / "ckpt"
    args = ["recipe=tiny", "train.train_iters=14", "logger.log_interval=1", "train.eval_iters=0",
            f"checkpoint.save={root}", "checkpoint.save_interval=4", "checkpoint.most_recent_k=2",
            "checkpoint.non_persistent_save_interval=1", "checkpoint.non_persistent_ckpt_type=global"]
    kill_when_paused(args, root / "iter_0000012.incomplete")
    assert iterations(root) == ["iter_0000004", "iter_0000008", "iter_0000012.incomplete"]
    assert iterations(root / "non_persistent") == ["iter_0000011"] and tracker(root / "non_persistent") == "11"

    out = ok(bridge("pretrain", *args))
    assert f"loaded checkpoint {root}/non_persistent/iter_0000011" in out
    assert sorted(losses(out)) == [12, 13, 14]
    assert iterations(root) == ["iter_0000012", "iter_0000014"] and tracker(root) == "14"
    assert iterations(root / "non_persistent") == ["iter_0000014"]


def test_documented_checkpoint_commands_run_as_written(tmp_path):
    text = section("docs/checkpoints.md", "Save and resume")
    commands = [command for command in doc_commands(text) if command.startswith("bridge pretrain")]
    assert len(commands) == 2
    scripts_first = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    first = ok(run("bash", "-c", commands[0], env=scripts_first, cwd=tmp_path))
    assert "checkpoint ckpt/iter_0000050 saved" in first and "exiting at iteration 50" in first
    second = ok(run("bash", "-c", commands[1], env=scripts_first, cwd=tmp_path))
    assert "loaded checkpoint ckpt/iter_0000050" in second
    assert re.search(r"^iteration  60/100 ", second, re.M) and not re.search(r"^iteration  50/100 ", second, re.M)
    assert tracker(tmp_path / "ckpt") == "100"


def test_a_longer_run_resumes_without_an_override(stopped_at_20, tmp_path):
    """Extending train.train_iters keeps a schedule whose decay length is set and whose weight
    decay is constant; only the length of an unused weight-decay ramp changed."""
    root = tmp_path / "ckpt"
    shutil.copytree(stopped_at_20, root)
    longer = [a for a in ARGS if not a.startswith("train.train_iters")] + ["train.train_iters=60",
                                                                          "scheduler.lr_decay_iters=40"]
    resumed = losses(ok(bridge("pretrain", *longer, f"checkpoint.load={root}", "train.exit_interval=22")))
    assert sorted(resumed) == [21, 22]
