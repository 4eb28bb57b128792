"""`bridge finetune finetune.objective=dpo` (recipe tiny_dpo) end to end on the CPU: the rewards separate over
the steps, `bridge eval` reports held-out reward accuracy, the two references agree, TP=2 and DP=2 give one
process's curve, bad input exits 2."""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest

from tests.conftest import bridge, python, torchrun
from tests.integration.sft_setup import pretrained_base

pytestmark = pytest.mark.slow

LINE = re.compile(r"^iteration\s+(\d+)/\d+ .*\| dpo loss ([0-9.]+) \| chosen reward (\S+) \| rejected reward (\S+) "
                  r"\| reward margin (\S+) \| reward accuracy ([0-9.]+) ", re.M)


def curve(output: str) -> dict[int, tuple[float, ...]]:
    """iteration -> (loss, chosen reward, rejected reward, margin, accuracy)."""
    return {int(m[0]): tuple(float(x) for x in m[1:]) for m in LINE.findall(output)}


def write_preference_data(root: Path, seed: int = 0, count: int = 128) -> Path:
    """The recipe's file: chosen is the word reversed and upper-cased, rejected the word upper-cased."""
    rng = random.Random(seed)
    words = ["".join(rng.choice("abcdefgh") for _ in range(4)) for _ in range(12)]
    root.mkdir(parents=True, exist_ok=True)
    for name, n in (("training", count), ("validation", 32)):
        with open(root / f"{name}.jsonl", "w") as f:
            for _ in range(n):
                word = rng.choice(words)
                f.write(json.dumps({"prompt": f"flip {word} =", "chosen": f" {word[::-1].upper()}",
                                    "rejected": f" {word.upper()}"}) + "\n")
    return root


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return pretrained_base(tmp_path_factory.getbasetemp())[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_preference_data(tmp_path_factory.mktemp("dpo_data"))


def dpo(base, data, *args):
    return ["finetune", "recipe=tiny_dpo", f"checkpoint.pretrained_checkpoint={base}", f"dataset.dataset_root={data}",
            *args]


@pytest.fixture(scope="module")
def tiny_dpo_run(base, data, tmp_path_factory):
    save = tmp_path_factory.mktemp("dpo") / "ckpt"
    result = bridge(*dpo(base, data, f"checkpoint.save={save}", "checkpoint.save_interval=15"))
    assert result.returncode == 0, result.stderr[-3000:]
    return save, result.stdout


def test_tiny_dpo_raises_reward_accuracy_and_margin(base, tiny_dpo_run):
    stdout = tiny_dpo_run[1]
    assert f"DPO reference: a frozen copy of {base}" in stdout
    steps = curve(stdout)
    assert sorted(steps) == [5, 10, 15, 20, 25, 30]
    first, last = steps[5], steps[30]
    assert last[0] < first[0] < 0.7  # from log 2 at the first step
    assert last[4] > first[4] and last[4] >= 0.9, steps
    assert last[3] > first[3] + 0.5 and last[3] == pytest.approx(last[1] - last[2], abs=2e-6)
    validation = re.search(r"^validation at the end of training \(iteration 30\) \| dpo loss .*"
                           r"\| reward accuracy ([0-9.]+)$", stdout, re.M)
    assert float(validation.group(1)) >= 0.9
    assert "PPL" not in validation.group(0)  # no perplexity of a DPO loss, reward or accuracy


def test_tokens_per_second_count_both_rows_of_each_pair(tiny_dpo_run):
    """tiny_dpo's 8 unpacked pairs a step run 16 rows of 64 tokens: 1,024 tokens an iteration."""
    for ms, tokens in re.findall(r"^iteration .*\| elapsed ms/iter ([0-9.]+) \| tokens/s/gpu ([0-9,]+) ",
                                 tiny_dpo_run[1], re.M):
        assert float(tokens.replace(",", "")) == pytest.approx(8 * 2 * 64 / (float(ms) / 1000), rel=2e-3, abs=1)


def test_eval_reports_held_out_reward_accuracy(base, data, tiny_dpo_run, tmp_path):
    """bridge eval scores a checkpoint on the batches a run's first validation reads: the checkpoint saved at
    iteration 15 gives the numbers the validation at iteration 15 logged."""
    save, stdout = tiny_dpo_run
    first = re.search(r"^validation at iteration 15 \| (.*)$", stdout, re.M).group(1)
    logged = {key: float(value) for key, value in (field.rsplit(" ", 1) for field in first.split(" | "))
              if not key.endswith("PPL")}
    output = tmp_path / "eval.json"
    result = bridge("eval", "recipe=tiny_dpo", f"checkpoint.load={save}", "checkpoint.ckpt_step=15",
                    f"checkpoint.pretrained_checkpoint={base}", f"dataset.dataset_root={data}", "dataset.do_test=false",
                    "--output", str(output))
    assert result.returncode == 0, result.stderr[-3000:]
    scores = json.loads(output.read_text())["splits"]["validation"]
    assert sorted(scores) == sorted(logged) == sorted(["dpo loss", "chosen reward", "rejected reward",
                                                       "reward margin", "reward accuracy"])
    assert scores == pytest.approx(logged, abs=2e-6)
    unreferenced = bridge("eval", "recipe=tiny_dpo", f"checkpoint.load={save}", f"dataset.dataset_root={data}")
    assert unreferenced.returncode == 2 and "checkpoint.pretrained_checkpoint: is not set" in unreferenced.stderr


def test_lora_reference_with_adapters_off_equals_a_frozen_copy(base, data):
    worker = python("tests/integration/dpo_worker.py", str(base), str(data))
    assert worker.returncode == 0, worker.stderr[-3000:]
    diff, moved = (float(x) for x in re.search(r"REFERENCE max_diff=(\S+) policy_moved=(\S+)", worker.stdout).groups())
    assert diff < 1e-6 and moved > 1e-2, (diff, moved)


@pytest.fixture(scope="module")
def one_process(base, data):
    result = bridge(*dpo(base, data, "train.train_iters=6", "logger.log_interval=1", "train.eval_iters=0"))
    assert result.returncode == 0, result.stderr[-3000:]
    return curve(result.stdout)


@pytest.mark.parametrize("layout", [["model.tensor_model_parallel_size=2", "model.make_vocab_size_divisible_by=64"],
                                    ["model.tensor_model_parallel_size=1"]], ids=["tp2", "dp2"])
def test_two_processes_reproduce_the_single_process_curve(base, data, one_process, layout):
    """TP=2 splits every layer (its embedding padded to 384 rows, as one process's); TP=1 on two processes
    is DP=2, each rank holding whole pairs."""
    result = torchrun(2, *dpo(base, data, "train.train_iters=6", "logger.log_interval=1", "train.eval_iters=0",
                              *layout))
    assert result.returncode == 0, result.stderr[-3000:]
    steps = curve(result.stdout)
    assert sorted(steps) == sorted(one_process) == list(range(1, 7))
    for step, values in one_process.items():
        assert steps[step] == pytest.approx(values, rel=1e-5, abs=1e-5), step


def test_a_resumed_run_keeps_the_starting_model_as_its_reference(base, data, one_process, tmp_path):
    """The second command loads the policy from checkpoint.load and the reference from pretrained_checkpoint."""
    args = dpo(base, data, "train.train_iters=6", "logger.log_interval=1", "train.eval_iters=0",
               f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=3")
    first = bridge(*args, "train.exit_interval=3")
    assert first.returncode == 0, first.stderr[-3000:]
    second = bridge(*args)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming at iteration 3" in second.stdout and f"DPO reference: a frozen copy of {base}" in second.stdout
    steps = {**curve(first.stdout), **curve(second.stdout)}
    assert sorted(steps) == list(range(1, 7))
    for step, values in one_process.items():
        assert steps[step] == pytest.approx(values, rel=1e-5, abs=1e-5), step


@pytest.mark.parametrize("variant", [["peft=lora"], ["dataset.packed_sequence_specs.packed_sequence_size=64",
                                                      "train.micro_batch_size=2", "train.global_batch_size=4"]],
                         ids=["lora", "packed"])
def test_dpo_starts_at_log_2_and_learns(base, data, variant):
    """LoRA's B starts at 0 and the frozen copy is the starting model: the policy is the reference at first.
    Packed, a row of 64 tokens holds two whole pairs (32 tokens each)."""
    result = bridge(*dpo(base, data, *variant, "train.train_iters=10", "logger.log_interval=1", "train.eval_iters=0"))
    assert result.returncode == 0, result.stderr[-3000:]
    if "peft=lora" in variant:
        assert "DPO reference: the base model, the LoRA adapters off" in result.stdout
    steps = curve(result.stdout)
    assert steps[1][0] == pytest.approx(0.693147, abs=1e-5) and steps[1][3] == 0
    assert steps[10][3] > 0.1 and steps[10][0] < steps[1][0]


def test_bad_input_exits_2_naming_the_record_line_or_field(cli, base, data, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    lines = (data / "training.jsonl").read_text().splitlines()
    lines[2] = json.dumps({"prompt": "flip abc =", "rejected": " ABC"})
    (bad / "training.jsonl").write_text("\n".join(lines) + "\n")
    result = bridge(*dpo(base, bad, "train.train_iters=2"))
    assert result.returncode == 2, result.stderr[-3000:]
    assert f"{bad}/training.jsonl:3: no 'chosen'; a preference record needs 'prompt', 'chosen' and 'rejected'" \
        in result.stderr

    def finetune(*args):  # in this process: each fails before any process group or model exists
        return cli(*dpo(base, data, *args))

    context = finetune("model.context_parallel_size=2", "--world-size", "2")
    assert context.exit_code == 2
    assert "model.context_parallel_size: is 2 with finetune.objective=dpo" in context.stderr
    smoothing = finetune("dpo.loss_type=ipo", "dpo.label_smoothing=0.1")
    assert smoothing.exit_code == 2 and "dpo.label_smoothing: applies to loss_type=sigmoid" in smoothing.stderr
    sft = cli("finetune", "recipe=tiny_sft", "dpo.beta=0.5", f"checkpoint.pretrained_checkpoint={base}",
              f"dataset.dataset_root={data}")
    assert sft.exit_code == 2 and "dpo.beta: is set, but finetune.objective is sft" in sft.stderr
    pretrain = cli("pretrain", "recipe=tiny_dpo", f"dataset.dataset_root={data}")
    assert pretrain.exit_code == 2 and "finetune.objective: is dpo, which bridge finetune trains" in pretrain.stderr
    no_start = cli("finetune", "recipe=tiny_dpo", f"dataset.dataset_root={data}")
    assert no_start.exit_code == 2 and "checkpoint.pretrained_checkpoint: is not set" in no_start.stderr
