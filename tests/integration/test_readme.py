"""The README's set-up and test commands, as written, and CI running the same ones."""

from __future__ import annotations

import re

import os
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run

# The `bridge` script pip installed, ahead of iproute2's /sbin/bridge.
SCRIPTS_FIRST = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

README = (REPO / "README.md").read_text()


def section_commands(title: str) -> list[str]:
    body = README.split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]
    return [line.strip() for line in body.splitlines() if line.startswith("    ") and line.strip()]


def test_readme_has_two_setup_commands_and_one_test_command():
    assert len(section_commands("Set up")) == 2
    assert section_commands("Test") == ["python -m pytest -q"]


def test_ci_runs_the_readme_install_and_test_commands():
    ci = (REPO / ".ci" / "run").read_text()
    install = section_commands("Set up")[0].replace("pip install ", "pip install -q ")
    assert install in ci
    assert section_commands("Test")[0] in ci


@pytest.mark.slow
def test_readme_main_job_runs_as_written():
    command = section_commands("Set up")[1]
    assert command == "bridge pretrain recipe=tiny"
    result = run("bash", "-c", command, env=SCRIPTS_FIRST)
    assert result.returncode == 0, result.stderr[-3000:]
    assert re.search(r"^iteration 100/100 ", result.stdout, re.M)


def test_readme_error_example_is_what_bridge_prints():
    example = re.search(r"\$ (bridge .*)\n\s*(error: .*)\n", README)
    command, expected = example.groups()
    result = run("bash", "-c", command, env=SCRIPTS_FIRST)
    assert result.returncode == 2 and result.stderr.strip() == expected
