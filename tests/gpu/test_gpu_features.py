"""Features whose GPU path differs from the CPU one: NVML energy, CUDA timers, the profiler's GPU time
breakdown, LoRA in bf16 with the distributed optimizer, a Hugging Face import trained in bf16, and what a
step that does not fit the GPU prints."""

from __future__ import annotations

import math
import re

import pytest

from tests.conftest import bridge
from tests.integration.sft_setup import pretrained_base, write_sft_data
from tests.integration.test_pretrain_cpu import losses
from tests.recipe_layouts import LLAMA8B_DISTRIBUTED_OPTIMIZER

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_energy_and_timers_are_reported():
    result = bridge("pretrain", "recipe=gpt2_124m", "train.micro_batch_size=64", "train.global_batch_size=64", "train.train_iters=10",
                    "logger.log_interval=5", "train.eval_iters=0", "logger.log_energy=true", "logger.timing_log_level=1")
    assert result.returncode == 0, result.stderr[-3000:]
    readings = re.findall(r"\| energy/gpu ([0-9.]+) J/iter \| power/gpu ([0-9]+) W", result.stdout)
    assert len(readings) == 2 and all(float(j) > 0 and int(w) > 0 for j, w in readings), result.stdout[-2000:]
    assert "(min, max) time across ranks (ms):" in result.stdout and "forward-backward" in result.stdout


def test_a_step_that_does_not_fit_the_gpu_ends_with_the_settings_that_free_memory():
    result = bridge("pretrain", "recipe=gpt2_124m", "train.micro_batch_size=4096", "train.global_batch_size=4096",
                    "train.train_iters=2", "train.eval_iters=0", "model.compile_layers=false")
    assert result.returncode == 1, result.stderr[-3000:]
    assert "iteration 1: the GPU ran out of memory (CUDA out of memory. Tried to allocate" in result.stderr
    assert "train.micro_batch_size (now 4096" in result.stderr and "model.recompute_granularity" in result.stderr
    assert "Traceback" not in result.stderr, result.stderr[-3000:]


def _memory_advice(*overrides: str) -> tuple[dict[str, str], str]:
    """The `memory_per_gpu` block and the warning of llama8b's dry run on this machine's GPU (a process of its own,
    so CUDA stays out of pytest's)."""
    result = bridge("pretrain", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, *overrides, "--dry-run")
    assert result.returncode == 0, result.stderr[-3000:]
    block = result.stdout.split("memory_per_gpu:", 1)[1]
    return dict(re.findall(r"^  (\w+): ([^#\n]+?)\s*(?:#.*)?$", block, re.M)), result.stderr


@pytest.mark.parametrize("where", ["iteration 1: the GPU ran out of memory (CUDA out of memory.",
                                   "the model and its optimizer state do not fit the GPU (CUDA out"])
def test_a_model_that_does_not_fit_the_gpu_ends_with_the_settings_that_split_it(where):
    """llama8b in its TP=1 distributed-optimizer layout on one GPU, with the layer count taken from the dry run's
    estimate (docs/parallelism.md#memory-per-gpu) for this GPU: the most layers whose set-up (bf16 weights, fp32
    gradient buffer and main weights, the allowance) stays the estimate's margin under the GPU's memory, so the
    first step is what runs out; or the fewest whose set-up is the margin over it. The dry run says neither fits
    and names the split; micro-batches of 1 are not offered lower."""
    from bridge_cli.training.layout_advice import ACCURACY

    one, many = _memory_advice("model.num_layers=1")[0], _memory_advice("model.num_layers=33")[0]
    gpu, base = float(one["gpu"]), float(one["before_first_step"])
    per_layer = (float(many["before_first_step"]) - base) / 32
    at_step = where.startswith("iteration 1")
    layers = (math.floor((gpu * (1 - ACCURACY) - base) / per_layer) + 1 if at_step else
              math.ceil((gpu * (1 + ACCURACY) - base) / per_layer) + 1)
    advice, warning = _memory_advice(f"model.num_layers={layers}")
    assert advice["verdict"] == "will not fit" and "model.tensor_model_parallel_size=" in warning, (layers, advice)
    setup = float(advice["before_first_step"])
    assert setup <= gpu * (1 - ACCURACY) if at_step else setup >= gpu * (1 + ACCURACY), (layers, advice)
    result = bridge("pretrain", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, f"model.num_layers={layers}",
                    "train.train_iters=1",
                    "train.eval_iters=0")
    assert result.returncode == 1, result.stderr[-3000:]
    assert where in result.stderr and "model.tensor_model_parallel_size (now 1)" in result.stderr, (layers, advice)
    assert "train.micro_batch_size" not in result.stderr and "Traceback" not in result.stderr


def test_profiler_breaks_the_gpu_time_down_by_kernel_kind(tmp_path):
    result = bridge("pretrain", "recipe=gpt2_124m", "train.micro_batch_size=64", "train.global_batch_size=64", "train.train_iters=4",
                    "train.eval_iters=0", "profiling.use_pytorch_profiler=true", "profiling.profile_step_start=2",
                    "profiling.profile_step_end=3", f"logger.tensorboard_dir={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = dict(re.findall(r"^  (\S.*?)\s+([0-9.]+)\s+[0-9.]+%$", result.stdout.split("by kernel kind:")[1], re.M))
    assert {"GEMM", "attention", "GPU idle between kernels"} <= set(rows), result.stdout[-2000:]
    assert float(rows["GEMM"]) > 0.2 * sum(float(ms) for ms in rows.values()), rows  # gpt2_124m is GEMM-heavy
    assert list(tmp_path.glob("*.pt.trace.json*"))


def test_lora_finetunes_in_bf16_with_the_distributed_optimizer(tmp_path):
    base, _ = pretrained_base(tmp_path)
    data = write_sft_data(tmp_path / "sft")
    result = bridge("finetune", "recipe=tiny_sft", "peft=lora", "mixed_precision=bf16_mixed",
                    "optimizer.use_distributed_optimizer=true", f"checkpoint.pretrained_checkpoint={base}",
                    f"dataset.dataset_root={data}", "train.train_iters=24", "logger.log_interval=4")
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert "cuda (nccl)" in result.stdout and len(curve) == 6 and curve[-1] < 0.7 * curve[0], curve


def test_hugging_face_import_trains_in_bf16(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = tmp_path / "hf"
    LlamaForCausalLM(LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                                 num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
                     ).save_pretrained(hf)
    out = tmp_path / "mcore"
    assert bridge("convert-ckpt", "import-hf", str(hf), str(out), "--recipe", "llama1b").returncode == 0
    result = bridge("pretrain", f"recipe={out}/recipe.yaml", "train.train_iters=10", "logger.log_interval=5",
                    "train.eval_iters=0", "scheduler.lr_warmup_iters=1", "scheduler.lr_decay_iters=10")
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"loaded checkpoint {out}/iter_0000000" in result.stdout and len(losses(result.stdout)) == 2
