"""A launch by the tests (torchrun, ft_launcher; the GPU tests and the CPU fault-tolerance tests) with a time limit that leaves nothing behind.

subprocess.run's timeout kills the launcher alone, and killing its process group is not enough either: torchrun and
ft_launcher start each worker in a session of its own, so the workers would go on holding the GPUs (and, hung in
a collective, for NCCL's 10 minutes). Past the limit every process of the launch is killed and the test fails with
the tail of what it printed, instead of a silent stop at the caller's own limit.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.conftest import REPO, RUN_ENV


def torchrun_command(*args: str) -> list[str]:
    """`torchrun --standalone --nproc-per-node 2 -m bridge_cli ARGS`."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "bridge_cli",
            *args]


def run_within(seconds: float, command: list[str], stdout: Path, stderr: Path | None = None,
               env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``command`` run from the repository with its output written to ``stdout`` (and ``stderr``, else merged into
    ``stdout``) as it runs; fails the test with both tails, having killed every process of it, once ``seconds``
    have passed."""
    started = time.monotonic()
    with open(stdout, "w") as out, open(stderr or os.devnull, "w") as err:
        proc = subprocess.Popen(command, cwd=REPO, env=env or {**RUN_ENV, "OMP_NUM_THREADS": "1"}, stdout=out,
                                stderr=err if stderr else subprocess.STDOUT, text=True, start_new_session=True)
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            kill_every_process_of(proc.pid)
            proc.wait()
            tails = "\n".join(f"{path.name}:\n{path.read_text(errors='replace')[-4000:]}"
                              for path in (stdout, stderr) if path)
            pytest.fail(f"not done in {seconds:.0f} s, killed: {' '.join(command[2:])}\n{tails}")
    print(f"{time.monotonic() - started:.1f} s, exit code {proc.returncode}: {' '.join(command[2:])[:200]}")
    return subprocess.CompletedProcess(command, proc.returncode, stdout.read_text(errors="replace"),
                                       stderr.read_text(errors="replace") if stderr else "")


def kill_every_process_of(pid: int) -> None:
    """SIGKILL the process ``pid`` and every process it started (stopped first, so that it starts no more)."""
    try:
        launcher = psutil.Process(pid)
        launcher.suspend()
        processes = [*launcher.children(recursive=True), launcher]
    except psutil.NoSuchProcess:
        return
    for process in processes:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(processes, timeout=10)
