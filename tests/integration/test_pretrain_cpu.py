"""`bridge pretrain` end to end on the CPU: parallel layouts agree, every API pattern works (the `tiny` recipe as
shipped, whose loss falls, is the README's main job: tests/integration/test_readme.py)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import bridge, python, torchrun

LOSS = re.compile(r"^iteration\s+(\d+)/\d+ .*\| lm loss ([0-9.]+) ", re.M)
SHORT = ["recipe=tiny", "train.train_iters=12", "logger.log_interval=1", "train.eval_iters=0"]


def losses(output: str) -> list[float]:
    return [float(loss) for _, loss in LOSS.findall(output)]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["model.tensor_model_parallel_size=2"], []], ids=["tp2", "dp2"])
def test_two_processes_match_one(single_process_curve, layout):
    result = torchrun(2, "pretrain", *SHORT, *layout)
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert curve == pytest.approx(single_process_curve, rel=1e-4), (curve, single_process_curve)
    assert ("TP 2" if layout else "DP 2") in result.stdout


@pytest.mark.slow
def test_pipeline_parallel_on_cpu_trains():
    """PP=2 runs megatron-core's 1F1B schedule over gloo. Its stages seed their layers per stage,
    as Megatron-LM does, so the curve starts from other weights: it must fall, not match."""
    result = torchrun(2, "pretrain", *SHORT, "model.pipeline_model_parallel_size=2")
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert "PP 2" in result.stdout and len(curve) == 12 and curve[-1] < 0.8 * curve[0]


@pytest.mark.slow
def test_interleaved_pipeline_on_cpu_trains():
    """Two virtual stages per pipeline rank: megatron-core's interleaved 1F1B schedule over gloo."""
    result = torchrun(2, "pretrain", *SHORT, "model.num_layers=4", "model.pipeline_model_parallel_size=2",
                      "model.virtual_pipeline_model_parallel_size=2")
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert "2 virtual stages per pipeline rank" in result.stdout
    assert len(curve) == 12 and curve[-1] < 0.85 * curve[0], curve  # 4 layers learn a little slower in 12 steps


@pytest.mark.slow
def test_every_forward_step_signature_and_loss_pattern(single_process_curve):
    result = python("tests/integration/pretrain_variants.py")
    assert result.returncode == 0, result.stderr[-3000:]
    runs = dict(re.findall(r"^VARIANT (\w+)\n(.*?)(?=^VARIANT |\Z)", result.stdout, re.M | re.S))
    assert len(runs) == 7
    reference = losses(runs["default"])
    assert len(reference) == 6
    for name, output in runs.items():
        assert losses(output) == pytest.approx(reference, rel=1e-5), name


@pytest.mark.slow
def test_inference_pattern_collects_non_loss_data():
    result = python("tests/integration/pretrain_variants.py", "inference")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "COLLECTED 2 (4, 128)" in result.stdout  # 2 micro-batches of 4 sequences x 128 tokens


@pytest.mark.parametrize("args, fragment", [
    (["dist.distributed_backend=nccl"], "dist.distributed_backend=nccl needs CUDA"),
    (["mixed_precision=bf16_mixed"], "model.bf16=true needs CUDA"),
    (["dataset.seq_length=256"], "is longer than model.seq_length"),
])
def test_bad_inputs_fail_clearly(cli, args, fragment):
    result = cli("pretrain", "recipe=tiny", *args)  # in this process: each fails before any process group exists
    assert result.exit_code == 2, result.stderr[-3000:]
    assert fragment in result.stderr and "Traceback" not in result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("args, fragment", [
    (["dataset=gpt", "dataset.blend=[/nonexistent/corpus,1.0]"], "dataset.blend: no indexed dataset at /nonexistent/corpus"),
    (["dataset=gpt", "dataset.blend=[a,b,0.3]"], "dataset.blend: cannot pair prefixes with weights"),
])
def test_bad_data_blends_fail_clearly(args, fragment):
    result = bridge("pretrain", "recipe=tiny", *args)  # a process of its own: the data is built after the model
    assert result.returncode == 2, result.stderr[-3000:]
    assert fragment in result.stderr and "Traceback" not in result.stderr
