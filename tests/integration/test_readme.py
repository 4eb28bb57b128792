"""The README's set-up and test commands as written, CI running the same ones, the error examples of the
docs as bridge prints them, and every relative link of the README and docs/ pointing at something that exists."""

from __future__ import annotations

import os
import re
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

from tests.conftest import REPO, run
from tests.doc_text import anchors, commands, section
from tests.integration.test_pretrain_cpu import losses

# The `bridge` script pip installed, ahead of iproute2's /sbin/bridge.
SCRIPTS_FIRST = {"PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

PAGES = ["README.md"] + sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").glob("*.md"))


def section_commands(title: str) -> list[str]:
    return commands(section("README.md", title))


def test_readme_has_two_setup_commands_and_two_test_commands():
    assert len(section_commands("Set up")) == 2
    assert section_commands("Test") == ["python -m pytest -q", 'python -m pytest -q -m "not slow"']


def test_each_test_command_is_followed_by_one_sentence():
    text = section("README.md", "Test")
    for command in section_commands("Test"):
        sentence = text.split(f"    {command}\n", 1)[1].lstrip("\n").split("\n\n", 1)[0]
        assert not sentence.startswith("    ") and sentence.endswith(".") and ". " not in sentence, sentence


def test_the_fast_tier_deselects_a_registered_marker():
    """`-m "not slow"` with a marker pyproject does not declare would select every test, the slow ones too."""
    argv = shlex.split(section_commands("Test")[1])
    expression = argv[argv.index("-m", argv.index("pytest")) + 1]
    assert expression.startswith("not ")
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert expression.removeprefix("not ") in [marker.split(":")[0] for marker in options["markers"]]


def test_the_testing_page_gives_the_readme_test_commands():
    assert commands(section("docs/testing.md", "The two tiers")) == section_commands("Test")


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


@pytest.mark.parametrize("page", PAGES)
def test_error_examples_are_what_bridge_prints(page):
    """Each `$ bridge ...` line followed by an `error: ...` line is run as written and must print that line."""
    examples = re.findall(r"\$ (bridge .*)\n\s*(error: .*)\n", (REPO / page).read_text())
    for command, expected in examples:
        result = run("bash", "-c", command, env=SCRIPTS_FIRST)
        assert result.returncode == 2 and result.stderr.strip() == expected, command


def test_the_docs_show_error_examples():
    assert len(re.findall(r"\$ bridge .*\n\s*error: ", (REPO / "docs" / "running.md").read_text())) == 3


def test_readme_next_steps_that_need_no_gpu_run_as_written():
    """The recipe list and the --dry-run of the README's next steps; the others need a GPU or a download."""
    runnable = [c.split("  #")[0].strip() for c in section_commands("Next steps")
                if c.startswith("bridge recipes") or "--dry-run" in c]
    assert len(runnable) == 2
    for command in runnable:
        result = run("bash", "-c", command, env=SCRIPTS_FIRST)
        assert result.returncode == 0, (command, result.stderr[-2000:])


def links(text: str) -> list[str]:
    """Targets of the markdown links outside code blocks and code spans."""
    text = re.sub(r"^```.*?^```", "", text, flags=re.M | re.S)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.findall(r"\[[^\]]*\]\(([^)\s]+)\)", text)


@pytest.mark.parametrize("page", PAGES)
def test_relative_links_point_at_files_and_headings_that_exist(page):
    source = REPO / page
    broken = []
    for target in links(source.read_text()):
        if re.match(r"[a-z]+:", target):
            continue  # a web address
        path, _, anchor = target.partition("#")
        file = (source.parent / path).resolve() if path else source
        if not file.is_file() or REPO not in file.parents:
            broken.append(f"{target}: no such file in the repository")
        elif anchor and file.suffix == ".md" and anchor not in anchors(file.read_text()):
            broken.append(f"{target}: {file.name} has no heading with that anchor")
    assert not broken, broken


def test_the_link_check_sees_a_broken_link_and_anchor():
    assert links("[a](docs/nope.md) `[b](x.md)` [c](running.md#config)") == ["docs/nope.md", "running.md#config"]
    assert "config" in anchors((REPO / "docs" / "running.md").read_text())
    assert "no-such-heading" not in anchors((REPO / "docs" / "running.md").read_text())
