"""The README's set-up and test commands, as written, and CI running the same ones."""

from __future__ import annotations

import re

import os
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, run
from tests.integration.test_pretrain_cpu import losses

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
def test_readme_main_job_runs_as_written_and_the_loss_falls():
    command = section_commands("Set up")[1]
    assert command == "bridge pretrain recipe=tiny"
    result = run("bash", "-c", command, env=SCRIPTS_FIRST, hand_off=False)  # a user's first launch, from scratch
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert re.search(r"^iteration 100/100 ", out, re.M)
    curve = losses(out)
    assert len(curve) == 10  # one line per logger.log_interval (10) over 100 iterations
    assert curve[-1] < 0.5 * curve[0], curve
    line = out.splitlines()[[i for i, l in enumerate(out.splitlines()) if l.startswith("iteration")][0]]
    for field in ("lr ", "grad norm ", "tokens/s/gpu ", "elapsed ms/iter ", "lm loss "):
        assert field in line, line
    assert re.search(r"validation at iteration 50 \| lm loss [0-9.]+ \| lm loss PPL", out)
    assert "GPTModel 2 layers" in out


def test_readme_error_example_is_what_bridge_prints():
    example = re.search(r"\$ (bridge .*)\n\s*(error: .*)\n", README)
    command, expected = example.groups()
    result = run("bash", "-c", command, env=SCRIPTS_FIRST)
    assert result.returncode == 2 and result.stderr.strip() == expected
