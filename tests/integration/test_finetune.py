"""`bridge finetune` end to end on the CPU: SFT learns the answers; LoRA trains, resumes and merges adapters only."""

from __future__ import annotations

import re

import pytest

from tests.conftest import bridge, python, torchrun
from tests.integration.sft_setup import pretrained_base, write_sft_data

pytestmark = pytest.mark.slow

LOSS = re.compile(r"^iteration\s+(\d+)/\d+ .*\| lm loss ([0-9.]+) ", re.M)
# Prompt and answer are under 20 tokens: rows of 64, one micro-batch of 8.
SFT = ["recipe=tiny_sft", "model.seq_length=64", "train.micro_batch_size=8"]


def losses(output: str) -> dict[int, float]:
    return {int(step): float(loss) for step, loss in LOSS.findall(output)}


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return pretrained_base(tmp_path_factory.getbasetemp())[0]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return write_sft_data(tmp_path_factory.mktemp("sft_data"))


def test_sft_answer_loss_falls_well_below_its_start(base, data):
    result = bridge("finetune", *SFT, f"checkpoint.pretrained_checkpoint={base}", f"dataset.dataset_root={data}",
                    "train.train_iters=24", "logger.log_interval=4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"loaded checkpoint {base}/iter_0000020 (checkpoint.pretrained_checkpoint; iteration 20): weights only" \
        in result.stdout
    curve = losses(result.stdout)
    assert sorted(curve) == [4, 8, 12, 16, 20, 24]
    assert curve[24] < 0.5 * curve[4], curve
    validation = float(re.search(r"^validation at the end of training \(iteration 24\) \| lm loss ([0-9.]+)",
                                 result.stdout, re.M).group(1))
    assert validation < 0.5 * curve[4]
    assert re.search(r"^test at the end of training \(iteration 24\) \| lm loss", result.stdout, re.M)


@pytest.fixture(scope="module")
def lora_run(base, data, tmp_path_factory):
    """Iterations 1-4 (saved, exit), then a second command resumes from the adapter checkpoint to 8."""
    save = tmp_path_factory.mktemp("lora") / "ckpt"
    args = ["finetune", *SFT, "peft=lora", f"dataset.dataset_root={data}", "train.train_iters=8",
            "logger.log_interval=1", f"checkpoint.save={save}", "checkpoint.save_interval=4", "train.eval_iters=0"]
    first = bridge(*args, f"checkpoint.pretrained_checkpoint={base}", "train.exit_interval=4")
    assert first.returncode == 0, first.stderr[-3000:]
    second = bridge(*args)  # the adapters name their base: no pretrained_checkpoint needed to resume
    assert second.returncode == 0, second.stderr[-3000:]
    return save, first.stdout, second.stdout


def test_lora_trains_adapters_only_and_resumes_from_its_adapter_checkpoint(base, lora_run):
    from torch.distributed.checkpoint import FileSystemReader

    save, first, second = lora_run
    counts = re.search(r"LoRA \(dim 32, alpha 32\) on linear_qkv, linear_proj, linear_fc1, linear_fc2: "
                       r"([0-9,]+) trainable parameters of ([0-9,]+)", first)
    trainable, total = (int(n.replace(",", "")) for n in counts.groups())
    assert 0 < trainable < total / 3
    assert sorted(losses(first)) == [1, 2, 3, 4] and sorted(losses(second)) == [5, 6, 7, 8]
    assert f"loaded base model {base}/iter_0000020 (the base named by {save}/iter_0000004" in second
    assert "loaded LoRA adapters" in second and "resuming at iteration 4, consumed samples 32" in second
    for iteration in (4, 8):
        keys = FileSystemReader(str(save / f"iter_{iteration:07d}")).read_metadata().state_dict_metadata
        model_keys = [k for k in keys if k.startswith(("decoder.", "embedding.", "output_layer."))]
        assert len(model_keys) == 8 and all(".adapter." in k for k in model_keys), model_keys
        assert all(".adapter." in k for k in keys if k.startswith("optimizer."))


def test_lora_with_compiled_layers_trains_like_eager(base, data, lora_run):
    # torch.compile traces the adapters inside each layer; packed SFT rows keep one shape
    result = bridge("finetune", *SFT, "peft=lora", f"dataset.dataset_root={data}", "train.train_iters=8",
                    "train.exit_interval=4", "logger.log_interval=1", "train.eval_iters=0",
                    f"checkpoint.pretrained_checkpoint={base}", "model.compile_layers=true")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(result.stdout) == pytest.approx(losses(lora_run[1]), rel=1e-3)


def test_lora_under_tensor_parallelism_reproduces_the_single_process_curve(base, data, lora_run):
    """Adapters split like their layers; the embedding is padded to 384 rows under both layouts."""
    result = torchrun(2, "finetune", *SFT, "peft=lora", f"dataset.dataset_root={data}", "train.train_iters=8",
                      "logger.log_interval=1", "train.eval_iters=0", f"checkpoint.pretrained_checkpoint={base}",
                      "train.exit_interval=4", "model.tensor_model_parallel_size=2", "model.make_vocab_size_divisible_by=64")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "TP 2" in result.stdout
    assert losses(result.stdout) == pytest.approx(losses(lora_run[1]), rel=1e-5)


def test_lora_base_stays_bitwise_frozen_and_merged_logits_match(base, data, lora_run, tmp_path):
    save = lora_run[0]
    merged = tmp_path / "merged"
    result = bridge("peft", "merge", str(save), str(merged), "recipe=tiny_sft")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"wrote the merged model to {merged}/iter_0000008" in result.stdout
    again = bridge("peft", "merge", str(save), str(merged), "recipe=tiny_sft")
    assert again.returncode == 2 and "already holds a checkpoint" in again.stderr
    worker = python("tests/integration/lora_worker.py", str(base), str(data), str(save), str(merged))
    assert worker.returncode == 0, worker.stderr[-3000:]
    assert "FROZEN base_unchanged=True adapters_moved=16/16 other_trainable=[]" in worker.stdout, worker.stdout
    diff, effect = (float(x) for x in re.search(r"LOGITS max_diff=(\S+) adapter_effect=(\S+)", worker.stdout).groups())
    assert diff < 1e-5 and effect > 1e-3, (diff, effect)


def test_finetune_errors_name_the_key_and_exit_2(cli, base, data, tmp_path):
    def finetune(*args):  # in this process: each fails before any process group or model exists
        return cli("finetune", *SFT, *args)

    missing = finetune(f"dataset.dataset_root={data}")
    assert missing.exit_code == 2 and "checkpoint.pretrained_checkpoint: is not set" in missing.stderr
    empty = finetune(f"checkpoint.pretrained_checkpoint={tmp_path}", f"dataset.dataset_root={data}")
    assert empty.exit_code == 2 and f"checkpoint.pretrained_checkpoint={tmp_path}: no checkpoint there" in empty.stderr
    no_data = finetune(f"checkpoint.pretrained_checkpoint={base}", f"dataset.dataset_root={tmp_path}")
    assert no_data.exit_code == 2 and f"dataset.dataset_root: {tmp_path} has no training.jsonl" in no_data.stderr
