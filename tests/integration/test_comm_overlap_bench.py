"""scripts/bench/comm_overlap.py on the CPU: 2 processes over gloo, the settings that run without the distributed
optimizer, a table row each; overlap changes when the communication happens, not the numbers."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import REPO, python

SCRIPT = str(REPO / "scripts" / "bench" / "comm_overlap.py")
SETTINGS = ["none", "grad_reduce", "pp2_none", "pp2_overlap_p2p"]


@pytest.mark.slow
def test_each_setting_is_a_row_of_the_table_and_overlap_keeps_the_loss():
    result = python(SCRIPT, "--gpus", "2", "--recipe", "tiny", "--iters", "4", "--warmup", "1", "--settings",
                    *SETTINGS, "--", "optimizer.use_distributed_optimizer=false", "model.num_layers=4",
                    env={"OMP_NUM_THREADS": "1"}, timeout=400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    table = result.stdout.rsplit("\nsetting ", 1)[1].splitlines()[1:]  # the table printed last
    rows = {m.group(1): m.groups()[1:] for m in map(re.compile(
        r"^(\S+) +(dp|pp2) +([0-9.]+) +([0-9,]+) +([0-9.]+)$").match, table) if m}
    assert list(rows) == SETTINGS, result.stdout[-3000:]
    assert rows["none"][0] == rows["grad_reduce"][0] == "dp" and rows["pp2_overlap_p2p"][0] == "pp2"
    assert rows["none"][3] == rows["pp2_none"][3] == "1.000"  # each layout's run without overlap is its baseline
    # every run's command is echoed: the pipeline settings ran the interleaved schedule with p2p overlap
    assert re.search(r"pipeline_model_parallel_size=2 model.virtual_pipeline_model_parallel_size=2 .*"
                     r"model.overlap_p2p_comm=true model.batch_p2p_comm=false$", result.stderr, re.M)
    results = json.loads(result.stdout.split("RESULTS ", 1)[1].splitlines()[0])
    assert results["none"]["layout"].endswith("DP 2") and results["pp2_none"]["layout"].endswith("PP 2 x CP 1 x DP 1")
    assert results["none"]["loss"] == results["grad_reduce"]["loss"]  # fp32 on the CPU: the same sums
    assert results["pp2_none"]["loss"] == results["pp2_overlap_p2p"]["loss"]


def test_an_override_of_a_key_the_settings_vary_is_refused():
    result = python(SCRIPT, "--gpus", "2", "--settings", "none", "grad_reduce", "--", "ddp.overlap_grad_reduce=true",
                    timeout=60)
    assert result.returncode == 2 and result.stdout == "", result.stderr[-2000:]
    assert "ddp.overlap_grad_reduce=true: the settings set this key; drop the override" in result.stderr


def test_the_pipeline_settings_need_an_even_number_of_gpus():
    result = python(SCRIPT, "--gpus", "3", "--settings", "pp2_none", timeout=60)
    assert result.returncode == 2 and "--gpus 3: the pp2 settings need an even number" in result.stderr
