"""scripts/bench/objective_speed.py end to end on the CPU, at tiny_dpo's and tiny_distill's shapes: it writes its
data, makes its checkpoints (the teacher at tiny_dpo's shape, so the DPO base's checkpoint serves as the teacher too)
and prints the four runs' rows, each with its objective's losses, and DPO's and distillation's tokens/s over their
SFT's; --work need not exist."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.conftest import REPO, python

pytestmark = pytest.mark.slow

SCRIPT = REPO / "scripts" / "bench" / "objective_speed.py"
ROWS = ["sft (dpo shape)", "dpo", "sft (student)", "distill"]


def test_objective_speed_prints_each_runs_row_and_the_ratios_to_sft(tmp_path):
    work = tmp_path / "not" / "yet"
    result = python(str(SCRIPT), "--iters", "5", "--warmup", "2", "--dpo-recipe", "tiny_dpo", "--distill-recipe",
                    "tiny_distill", "--teacher-recipe", "tiny_dpo", "--work", str(work), "--", "model.vocab_size=256",
                    env={"OMP_NUM_THREADS": "1"}, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    out = result.stdout
    # two checkpoints: the DPO base's shape is the teacher's
    assert re.findall(r"^making the (.*)'s checkpoint", out, re.M) == ["DPO base", "student"], out
    table = out.split("\n\n")[-1]
    for name in ROWS:
        row = re.search(rf"^{re.escape(name)} +([0-9.]+) +([0-9,]+) +([0-9.]+) +([0-9.]+)% +(\S+)$", table, re.M)
        assert row, table
        assert float(row.group(1)) > 0 and float(row.group(2).replace(",", "")) > 0
    results = json.loads(out.split("RESULTS ", 1)[1])
    assert sorted(results) == sorted(ROWS)
    for name in ROWS:  # the objective's loss of every iteration: DPO's log line names it dpo loss
        assert sorted(map(int, results[name]["losses"])) == [1, 2, 3, 4, 5], (name, results[name]["losses"])
    assert work.is_dir() and not any(work.iterdir())  # made, and its temporary folder removed
    ratios = dict(re.findall(r"^(dpo|distill) / sft \((?:dpo shape|student)\) tokens/s/gpu: (\S+)$", table, re.M))
    assert sorted(ratios) == ["distill", "dpo"], table
    for objective, base in (("dpo", "sft (dpo shape)"), ("distill", "sft (student)")):
        ratio = float(ratios[objective])
        assert math.isfinite(ratio) and ratio > 0
        assert ratio == pytest.approx(results[objective]["tokens"] / results[base]["tokens"], abs=1e-3)
    # DPO's tokens count both rows of each pair: 4 pairs of 64-token rows an iteration (3 timed: the medians agree)
    assert results["dpo"]["tokens"] == pytest.approx(4 * 2 * 64 / results["dpo"]["step_ms"] * 1000, rel=0.02)


def test_a_recipe_without_a_vocabulary_size_is_refused_with_the_override_to_add():
    result = python(str(SCRIPT), "--dpo-recipe", "tiny_dpo", "--distill-recipe", "tiny_distill", timeout=120)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "recipe=tiny_dpo sets no model.vocab_size" in result.stderr
    assert "-- model.vocab_size=256" in result.stderr


def test_too_few_iterations_are_refused():
    result = python(str(SCRIPT), "--iters", "3", "--warmup", "3", timeout=60)
    assert result.returncode == 2 and "--iters (3) must be more than --warmup (3)" in result.stderr
