"""bridge's FLOPs count (bridge_cli/models/flops.py) against the FLOPs autograd runs (torch's FlopCounterMode in
tests/integration/flops_worker.py) on the tiny models: every weight training, LoRA on every target or on one layer
kind deep in the first layer (what runs before the first adapter has no backward), the DPO reference's forward
with the adapters off, and the MoE model, whose router GEMM the count leaves out as Megatron-LM does. Then a
LoRA run and a full fine-tuning run of `bridge finetune`: the FLOPs their checkpoints record, which the log line's
TFLOP/s/gpu divides by the step's time, are that count."""

from __future__ import annotations

import json
import re

import pytest

from tests.conftest import bridge, python

pytestmark = pytest.mark.slow

SEQ = ["model.seq_length=64"]
LORA = [*SEQ, "peft=lora"]
CASES = {
    "every weight trains": ["tiny", SEQ, "train"],
    "lora": ["tiny", LORA, "train"],
    "lora on linear_fc2": ["tiny", [*LORA, "peft.target_modules=[linear_fc2]"], "train"],
    "lora on linear_proj, untied output layer": ["tiny", [*LORA, "peft.target_modules=[linear_proj]",
                                                          "model.share_embeddings_and_output_weights=false"], "train"],
    "dpo reference (lora, adapters off)": ["tiny", LORA, "reference"],
    "moe, every weight trains": ["tiny_moe", SEQ, "train"],
    "moe, lora": ["tiny_moe", LORA, "train"],
    "moe, forward": ["tiny_moe", LORA, "reference"],
}
# tiny_moe's router, hidden 128 to 8 experts in its 3 MoE layers, multiply-adds per token; its wgrad runs under
# LoRA too (megatron-core's router GEMM computes it whether the weight trains or not)
ROUTER = 3 * 128 * 8


@pytest.fixture(scope="module")
def flops():
    result = python("tests/integration/flops_worker.py", json.dumps(list(CASES.values())), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    line = next(line for line in result.stdout.splitlines() if line.startswith("FLOPS "))
    found = json.loads(line[len("FLOPS "):])
    return {name: (measured, counted) for name, measured, counted in zip(CASES, found["measured"], found["counted"])}


@pytest.mark.parametrize("case", [name for name in CASES if not name.startswith("moe")])
def test_the_count_is_what_autograd_runs(flops, case):
    measured, counted = flops[case]
    assert counted == measured


def test_lora_counts_less_than_full_training_and_more_than_a_forward(flops):
    full, lora, forward = (flops[name][1] for name in ("every weight trains", "lora",
                                                       "dpo reference (lora, adapters off)"))
    assert forward < lora < full


@pytest.mark.parametrize("case, router_flops_per_mac", [("moe, every weight trains", 6), ("moe, lora", 6),
                                                        ("moe, forward", 2)])
def test_the_moe_count_is_what_autograd_runs_but_the_router(flops, case, router_flops_per_mac):
    measured, counted = flops[case]
    assert counted + router_flops_per_mac * ROUTER == measured


LINE = re.compile(r"^iteration\s+2/2 .*\| elapsed ms/iter ([0-9.]+) \| .*\| TFLOP/s/gpu ([0-9.]+) \|", re.M)
TINY = ["recipe=tiny", "tokenizer=byte_level", "train.eval_iters=0"]


@pytest.mark.parametrize("peft", [["peft=lora"], []], ids=["lora", "full"])
def test_a_runs_flops_are_the_count(tmp_path, peft):
    from megatron.core.dist_checkpointing import load_common_state_dict

    from bridge_cli.config.compose import compose
    from bridge_cli.training.config import ConfigContainer
    from bridge_cli.training.objective_flops import flops_per_sample

    base, save = tmp_path / "base", tmp_path / "run"
    result = bridge("pretrain", *TINY, "train.train_iters=1", f"checkpoint.save={base}")
    assert result.returncode == 0, result.stderr[-3000:]
    args = [*TINY, *peft, "train.train_iters=2", "logger.log_interval=1", f"checkpoint.pretrained_checkpoint={base}"]
    result = bridge("finetune", *args, f"checkpoint.save={save}")
    assert result.returncode == 0, result.stderr[-3000:]
    cfg = ConfigContainer.from_yaml_dict(compose("tiny", args[1:]))
    cfg.validate(1, "cpu")
    per_iteration = cfg.train.global_batch_size * flops_per_sample(cfg)
    recorded = load_common_state_dict(str(save / "iter_0000002"))["num_floating_point_operations_so_far"]
    assert recorded == 2 * per_iteration
    ms, tflops = map(float, LINE.search(result.stdout).groups())
    assert tflops == pytest.approx(per_iteration / ms / 1e9, abs=0.006)  # both printed rounded
