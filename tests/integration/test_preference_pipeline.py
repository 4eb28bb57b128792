"""DPO under pipeline parallelism on the CPU (gloo, torchrun): PP=2 gives one process's losses, rewards,
accuracy and validation with the frozen reference and with LoRA's, PP=2 x TP=2 too, and a run resumed at PP=2
goes on as the uninterrupted one. The reference's activations ride in the policy's schedule, so the last stage
has both sequences of every pair under both models (bridge_cli/training/dpo_step.py)."""

from __future__ import annotations

import re

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.sft_setup import pretrained_base
from tests.integration.test_dpo import curve, dpo, write_preference_data

pytestmark = pytest.mark.slow

PP2 = ["model.pipeline_model_parallel_size=2"]
SHORT = ["train.train_iters=6", "logger.log_interval=1", "train.eval_interval=3", "train.eval_iters=1"]
VALIDATION = re.compile(r"^validation at iteration (\d+) \| (.*)$", re.M)


def validations(output: str) -> dict[int, dict[str, float]]:
    """iteration -> {report key: value} of each validation line."""
    return {int(step): {key: float(value) for key, value in (field.rsplit(" ", 1) for field in fields.split(" | "))}
            for step, fields in VALIDATION.findall(output)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return pretrained_base(tmp_path_factory.getbasetemp())[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_preference_data(tmp_path_factory.mktemp("dpo_pipeline_data"))


@pytest.fixture(scope="module")
def one_process(base, data):
    """variant -> one process's output."""
    runs = {}
    for name, args in (("frozen", []), ("lora", ["peft=lora"])):
        result = bridge(*dpo(base, data, *SHORT, *args))
        assert result.returncode == 0, result.stderr[-3000:]
        runs[name] = result.stdout
    return runs


def assert_same_run(output: str, expected: str) -> None:
    steps, want = curve(output), curve(expected)
    assert sorted(steps) == sorted(want) == list(range(1, 7))
    assert want[6][4] > 0  # the policy has moved off the reference: the comparison is not of log 2 alone
    for step, values in want.items():
        assert steps[step] == pytest.approx(values, rel=1e-5, abs=1e-5), step
    assert sorted(validations(output)) == sorted(validations(expected)) == [3, 6]
    for step, values in validations(expected).items():
        assert validations(output)[step] == pytest.approx(values, rel=1e-5, abs=1e-5), step


@pytest.mark.parametrize("variant", ["frozen", "lora"])
def test_two_stages_reproduce_the_single_process_run(base, data, one_process, variant):
    """Stage 0 sends the policy's and the reference's hidden states of 8 rows (4 pairs) as one [64, 16, 128]
    tensor; stage 1 scores both and computes the loss. With LoRA both passes are the same chunk, adapters off
    for the reference."""
    result = torchrun(2, *dpo(base, data, *SHORT, *PP2, *(["peft=lora"] if variant == "lora" else [])))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world 2 = TP 1 x PP 2" in result.stdout
    assert_same_run(result.stdout, one_process[variant])


def test_two_stages_of_two_tensor_parallel_ranks_reproduce_the_single_process_run(base, data, one_process):
    result = torchrun(4, *dpo(base, data, *SHORT, *PP2, "model.tensor_model_parallel_size=2",
                              "model.make_vocab_size_divisible_by=64"))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "world 4 = TP 2 x PP 2" in result.stdout
    assert_same_run(result.stdout, one_process["frozen"])


def test_a_run_resumed_at_two_stages_goes_on_as_the_uninterrupted_one(base, data, one_process, tmp_path):
    """The reference is rebuilt from pretrained_checkpoint on both stages; the policy comes from checkpoint.load."""
    args = dpo(base, data, *SHORT, *PP2, f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=3")
    first = torchrun(2, *args, "train.exit_interval=3")
    assert first.returncode == 0, first.stderr[-3000:]
    second = torchrun(2, *args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming at iteration 3" in second.stdout and f"DPO reference: a frozen copy of {base}" in second.stdout
    assert_same_run(first.stdout + second.stdout, one_process["frozen"])
