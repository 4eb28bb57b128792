"""Shared helpers: run the real `bridge` CLI in-process (fast) or as a subprocess (end to end)."""

from __future__ import annotations

import functools
import gc
import os
import subprocess
import sys
from pathlib import Path

import pytest
import typer.testing
from typer.testing import CliRunner

from tests.forked_cli import ForkedCli

REPO = Path(__file__).resolve().parent.parent

if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    # Each xdist worker, and every run it starts, gets its share of the cores: two workers of two
    # threads each on a 2-core machine spend their time switching. Set before torch is imported,
    # since OpenMP reads it once.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, os.cpu_count() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))))

# Launches compose their config afresh: a kept config costs a launch that composes a new one the time of
# writing it (most tests compose a command once), and test_compose_cache and test_import_path turn it on.
os.environ.setdefault("BRIDGE_CONFIG_CACHE", "off")

# The environment of every run the tests start, taken before any test runs; a run's own variables come
# through ``env``. Libraries set variables in the process that uses them (megatron-core NVTE_*_ATTN when it
# builds a model, inductor _TORCHINDUCTOR_* when it compiles): a run that inherited them from an earlier
# in-process test would start as no user's shell starts it, and as a fresh process instead of a fork.
RUN_ENV = {**os.environ, "PYTHONUNBUFFERED": "1"}

# CliRunner.invoke turns the Typer app into its click command on every call, reading every command's signature
# again (about 15 ms); a `bridge` process does it once, and the fast tier invokes the app some 450 times.
typer.testing._get_command = functools.cache(typer.testing._get_command)


def pytest_collectreport(report):
    """Take what collecting a module built, its imports above all (torch, megatron-core and transformers hold some
    500,000 objects), out of the garbage collector's reach: they live until the process ends, and every full
    collection walked them all again (0.25 s each: 18 in a worker of the fast tier, and 5 more as pytest ends)."""
    gc.freeze()


@pytest.fixture
def cli():
    """Invoke the `bridge` Typer app in this process; returns click's Result (exit_code, stdout, stderr).

    Config validation, --dry-run and errors raised before any process group exists behave here as
    in a `bridge` process, without each test paying megatron-core's import again. ``env`` sets
    environment variables for the one call.
    """
    from bridge_cli.cli.app import app

    runner = CliRunner()

    def invoke(*args: str, env: dict | None = None):
        return runner.invoke(app, list(args), env=env)

    return invoke


@pytest.fixture(scope="module")
def one_process():
    """This process as a world of one (gloo, every parallel size 1), for building models in-process."""
    from bridge_cli.runtime.distributed import destroy_distributed, init_distributed

    init_distributed("gloo", 1, 1, 1)
    yield
    destroy_distributed()


@pytest.fixture(scope="module")
def leaves_no_rerun_state_machine():
    """For tests of loss functions, which report to megatron-core's rerun state machine and so create its global
    instance on first use: destroyed after the module, so a later in-process `bridge` run can create its own."""
    yield
    from megatron.core.rerun_state_machine import destroy_rerun_state_machine

    destroy_rerun_state_machine()


def run(*args: str, timeout: int = 600, env: dict | None = None, cwd: Path | None = None,
        hand_off: bool = True) -> subprocess.CompletedProcess:
    """Run a command (e.g. `bridge pretrain ...`) as a user would, capturing its output. The bridge
    interpreters it starts (itself, torchrun's workers, a script's `bridge`) hand their runs to this
    worker's fork server (tests/fork_shim) unless ``hand_off`` is false."""
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, cwd=cwd or REPO,
                          env=run_env(env) if hand_off else {**RUN_ENV, **(env or {})})


def python(*argv: str, nproc: int = 0, timeout: int = 600, env: dict | None = None,
           cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python ARGV` (a script and its arguments, or -m MODULE and its), or with ``nproc``
    `torchrun --nproc-per-node NPROC ARGV`, as forks of a per-worker process that has imported torch,
    megatron-core and bridge (tests/forked_cli.py): one fork, or one per rank with the variables
    torchrun gives it. Where a fork cannot stand for the process (see ForkedCli.can_fork), the fresh
    process runs instead.

    Real torchrun launches are covered by tests/integration/test_multinode_cpu.py, the README's
    commands and the Slurm templates.
    """
    if nproc:
        port = str(_free_port())
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--master-port",
                   port, *argv]
        base = {"OMP_NUM_THREADS": "1", **run_env(env)}  # torchrun's default for more than one process a node
        envs = [{**base, **_torchrun_rank(rank, nproc, port)} for rank in range(nproc)]
    else:
        command, envs = [sys.executable, *argv], [run_env(env)]
    if not _FORKED.can_fork(envs):
        return run(*command, timeout=timeout, env=env, cwd=cwd)
    return _FORKED.runs(command, list(argv), envs, timeout, cwd or REPO)


def bridge(*args: str, timeout: int = 600, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`python -m bridge_cli ARGS` (see python())."""
    return python("-m", "bridge_cli", *args, timeout=timeout, env=env, cwd=cwd)


def torchrun(nproc: int, *args: str, timeout: int = 600, env: dict | None = None,
             cwd: Path | None = None) -> subprocess.CompletedProcess:
    """`torchrun --nproc-per-node NPROC -m bridge_cli ARGS` (see python())."""
    return python("-m", "bridge_cli", *args, nproc=nproc, timeout=timeout, env=env, cwd=cwd)


def _torchrun_rank(rank: int, nproc: int, port: str) -> dict[str, str]:
    """The variables torchrun's agent sets for each worker of a one-node job."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            "GROUP_WORLD_SIZE": "1", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": port, "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_RUN_ID": "none"}


def run_env(env: dict | None = None) -> dict[str, str]:
    """The environment of a run the tests start: RUN_ENV, what hands its bridge interpreters' runs to the
    fork server, then ``env``."""
    return {**RUN_ENV, **_FORKED.hand_off_env(), **(env or {})}


_FORKED = ForkedCli(RUN_ENV)


@pytest.fixture(scope="session", autouse=True)
def _forked_cli_server():
    yield
    _FORKED.close()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
