"""The MoE recipes validate at 8, 64 and 256 GPUs with their layouts (--dry-run builds no model),
and their FLOPs count only the activated experts (megatron-core's formula, checked by hand)."""

from __future__ import annotations

import re

import pytest

from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer
from bridge_cli.training.utils.train_utils import num_floating_point_operations

# DeepSeek-V3's usual layout needs 256 GPUs (PP 8 x EP 32); smaller worlds take a smaller layout.
DEEPSEEK_SMALLER = {
    8: ["model.pipeline_model_parallel_size=2", "model.num_layers_in_first_pipeline_stage=30",
        "model.num_layers_in_last_pipeline_stage=31", "model.expert_model_parallel_size=4"],
    64: ["model.pipeline_model_parallel_size=4", "model.num_layers_in_first_pipeline_stage=15",
         "model.num_layers_in_last_pipeline_stage=16", "model.expert_model_parallel_size=16"],
    256: [],
}
CASES = [(recipe, world, []) for recipe in ("qwen3_30b_a3b", "mixtral_8x7b", "olmoe_1b_7b") for world in (8, 64, 256)]
CASES += [("deepseek_v3", world, overrides) for world, overrides in DEEPSEEK_SMALLER.items()]
CASES += [("moe_proxy", world, [f"train.global_batch_size={2 * world}"]) for world in (1, 8, 64, 256)]
CASES += [("moonlight_16b_a3b", world, []) for world in (8, 64, 256)]
CASES += [("deepseek_proxy", world, [f"train.global_batch_size={max(32, world)}"]) for world in (1, 8, 64, 256)]


@pytest.mark.parametrize("recipe, world, overrides", CASES, ids=[f"{r}-{w}" for r, w, _ in CASES])
def test_moe_recipe_dry_runs(cli, recipe, world, overrides):
    result = cli("pretrain", f"recipe={recipe}", *overrides, "--dry-run", "--device", "cuda", "--world-size", str(world))
    assert result.exit_code == 0, result.output
    assert f"world_size: {world}" in result.stdout
    assert "parameters on rank" not in result.stdout  # the start-up line of a built model


@pytest.mark.parametrize("recipe, world", [("moonlight_16b_a3b", 8), ("deepseek_proxy", 1)])
def test_deepseek_recipes_fit_80_gb_gpus_at_their_layouts(cli, recipe, world):
    """The memory advisor's estimate per GPU at the layout each recipe's header names (80 GiB without a GPU here;
    48.9 and 62.7 GiB when they were written)."""
    result = cli("pretrain", f"recipe={recipe}", "--dry-run", "--device", "cuda", "--world-size", str(world))
    assert result.exit_code == 0, result.output
    total = float(re.search(r"\n  total: ([0-9.]+)", result.stdout).group(1))
    assert total < 75 and "verdict: fits" in result.stdout, result.stdout[-1500:]


def flops_per_token(recipe: str) -> float:
    cfg = ConfigContainer.from_yaml_dict(compose(recipe, []))
    return num_floating_point_operations(cfg.model, batch_size=1) / cfg.model.seq_length


def test_moe_flops_count_routed_top_k_and_shared_experts_and_dense_layers():
    # 6 x (layers x (QKV + output projection + causal attention at seq 4096) + MoE MLPs + logits), per
    # token; a SwiGLU expert is 3 h x F multiply-adds, times top-k routed (+ shared) experts. The vocabulary
    # is padded to a multiple of 128 x TP (Qwen3: 151936 -> 152064 at TP 4).
    qwen3 = 6 * (48 * (2048 * (4096 + 2 * 512) + 4096 * 2048 + 4096 * 4096 + 3 * 2048 * 768 * 8) + 2048 * 152064)
    assert flops_per_token("qwen3_30b_a3b") == qwen3
    # MLA: q = q_lora (h + heads (qk + rope) + 1), kv = kv_lora (h + heads (qk + v) + 1) + h rope, out heads v h;
    # attention heads (qk + rope + v) / 2 per position; 3 dense layers of FFN 18432, 58 MoE layers of
    # 8 routed + 1 shared expert of FFN 2048; its one MTP layer is an MoE layer more, a 2h -> h
    # projection and a second pass through the output layer.
    mla = 1536 * (7168 + 128 * 192 + 1) + 512 * (7168 + 128 * 256 + 1) + 7168 * 64 + 128 * 128 * 7168
    deepseek = 6 * (62 * (mla + 128 * 320 / 2 * 4096) + 3 * 3 * 7168 * 18432 + 59 * 3 * 7168 * 2048 * 9
                    + 2 * 7168 * 7168 + 2 * 7168 * 129280)
    assert flops_per_token("deepseek_v3") == pytest.approx(deepseek, rel=1e-12)
