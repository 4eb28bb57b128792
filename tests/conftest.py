"""Shared helpers: run the real `bridge` CLI in-process (fast) or as a subprocess (end to end)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

REPO = Path(__file__).resolve().parent.parent


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


def run(*args: str, timeout: int = 600, env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """Run a command (e.g. `bridge pretrain ...`) as a user would, capturing its output."""
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    return subprocess.run(list(args), capture_output=True, text=True, timeout=timeout, env=full_env, cwd=cwd or REPO)


def bridge(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "bridge_cli", *args, **kwargs)


def torchrun(nproc: int, *args: str, **kwargs) -> subprocess.CompletedProcess:
    return run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
               "--master-port", str(_free_port()), "-m", "bridge_cli", *args, **kwargs)


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
