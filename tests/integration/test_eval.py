"""`bridge eval`: a checkpoint's validation and test loss, equal to what its training run reported."""

from __future__ import annotations

import json

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.sft_setup import TINY, VALIDATION_AT_20, pretrained_base


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return pretrained_base(tmp_path_factory.getbasetemp())


@pytest.mark.slow
def test_eval_reports_the_training_runs_validation_loss(base, tmp_path):
    checkpoint, training_log = base
    trained = float(VALIDATION_AT_20.search(training_log).group(1))
    output = tmp_path / "eval.json"
    result = bridge("eval", *TINY, f"checkpoint.load={checkpoint}", "--output", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    report = json.loads(output.read_text())
    assert report["checkpoint"] == f"{checkpoint}/iter_0000020" and report["iteration"] == 20
    assert report["splits"]["validation"]["lm loss"] == pytest.approx(trained, abs=1e-5)
    assert report["splits"]["test"]["lm loss PPL"] > 1.0
    assert f"{report['splits']['validation']['lm loss']:.6f}" in result.stdout  # the table


@pytest.mark.slow
def test_eval_reshards_a_checkpoint_to_another_tensor_parallel_layout(base, tmp_path):
    checkpoint, training_log = base
    trained = float(VALIDATION_AT_20.search(training_log).group(1))
    output = tmp_path / "eval_tp2.json"
    # the embedding is padded to 384 rows under either layout (128 x TP 1, 64 x TP 2)
    result = torchrun(2, "eval", *TINY, f"checkpoint.load={checkpoint}", "model.tensor_model_parallel_size=2",
                      "model.make_vocab_size_divisible_by=64", "--output", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(output.read_text())["splits"]["validation"]["lm loss"] == pytest.approx(trained, abs=1e-5)


def test_eval_without_a_checkpoint_exits_2(cli, tmp_path):
    unset = cli("eval", *TINY)
    assert unset.exit_code == 2 and "checkpoint.load: is not set" in unset.stderr
    empty = cli("eval", *TINY, f"checkpoint.load={tmp_path}")
    assert empty.exit_code == 2 and f"checkpoint.load={tmp_path}: no checkpoint there" in empty.stderr
