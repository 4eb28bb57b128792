"""Chaos: a `bridge pretrain` run killed with SIGKILL at random points, inside and outside its saves, and
resumed each time, prints the same loss at every iteration as an uninterrupted run (bitwise on the CPU).

The kill points come from a seeded generator, so every run of the test aims at the same ones; where a
kill inside a save lands (writing shards, before the rename) still depends on the machine's timing.
"""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.conftest import REPO, bridge, run_env
from tests.integration.test_checkpoint_resume import ARGS, losses, ok, reference, tracker  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

SAVE_EVERY = 5
KILLS = 4
SEED = 22


def kill_plan(seed: int) -> list[tuple[str, int, float]]:
    """(where, iteration, delay in s): 'step' kills ``delay`` after iteration's log line, 'save' kills
    ``delay`` after the save of iteration (a multiple of SAVE_EVERY) has begun writing."""
    rng = random.Random(seed)
    modes = ["step", "save"] * (KILLS // 2)
    rng.shuffle(modes)
    plan, floor = [], 0
    for mode in modes:
        save = (floor // SAVE_EVERY + rng.randint(1, 2)) * SAVE_EVERY  # a later save than the last kill's
        # one or two iterations past a save, and a step takes about 0.1 s: a 'step' kill lands between saves
        target = save + rng.randint(1, 2) if mode == "step" else save
        # a tiny model's save takes a few tenths of a second: kill within its first 50 ms to land inside it
        plan.append((mode, target, rng.uniform(0.0, 0.1 if mode == "step" else 0.05)))
        floor = target
    assert floor < 40, plan
    return plan


def run_and_kill(args: list[str], root: Path, where: str, iteration: int, delay: float) -> str:
    """`bridge pretrain ARGS`, SIGKILLed (its whole process group, as a scheduler kills a job) at the
    point described; its stdout. (The run is handed to the fork server, tests/fork_shim, which SIGKILLs it
    as soon as the interpreter is gone: within 10 ms.)"""
    proc = subprocess.Popen([sys.executable, "-m", "bridge_cli", "pretrain", *args], cwd=REPO, env=run_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    logged = f"iteration {iteration:>2}/40 "
    saving = root / f"iter_{iteration:07d}.incomplete"
    deadline = time.time() + 300
    while not (any(line.startswith(logged) for line in list(lines)) if where == "step" else saving.exists()):
        assert proc.poll() is None and time.time() < deadline, "".join(lines)[-3000:]
        time.sleep(0.005)
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    reader.join(timeout=60)
    assert proc.returncode == -signal.SIGKILL, "".join(lines)[-3000:]
    return "".join(lines)


def test_killed_at_random_points_and_resumed_ends_as_an_uninterrupted_run(reference, tmp_path):  # noqa: F811
    root = tmp_path / "ckpt"
    args = [*ARGS, f"checkpoint.save={root}", f"checkpoint.save_interval={SAVE_EVERY}"]
    printed: list[tuple[int, str]] = []
    inside_saves = 0
    for where, iteration, delay in kill_plan(SEED):
        out = run_and_kill(args, root, where, iteration, delay)
        printed += losses(out).items()
        assert max(losses(out)) >= iteration, (where, iteration, out[-2000:])
        inside_saves += any(root.glob("*.incomplete"))
    assert inside_saves, "no kill landed inside a save"
    last = ok(bridge("pretrain", *args))
    assert "loaded checkpoint" in last, last[-2000:]
    printed += losses(last).items()
    assert losses(last)[40] == reference[40]
    assert [(i, loss) for i, loss in printed if loss != reference[i]] == []
    assert tracker(root) == "40" and not list(root.glob("*.incomplete"))
