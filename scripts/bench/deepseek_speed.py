"""bridge against torchtitan's DeepSeek-V3 on one GPU, at the shape of a bridge recipe (issue 43, item 6).

    python scripts/bench/deepseek_speed.py [--recipe deepseek_proxy] [--iters 30] [--titan-arg FLAG ...]
        [-- OVERRIDE ...]

One `bridge pretrain` of the recipe with the OVERRIDEs on one process, then torchtitan 0.2.2's deepseek_v3 model
(``run_titan_deepseek.py`` in this folder: compiled, causal SDPA, one GPU) at the same shape, micro-batch and
global batch, read from bridge's composed config: MLA's q_lora_rank, kv_lora_rank, qk_head_dim,
qk_pos_emb_head_dim and v_head_dim, the experts, top-k, groups, shared expert, dense first layers, YaRN, vocab
and seq. A field torchtitan's DeepSeek-V3 cannot match (multi-token prediction, a shared expert that is no
whole number of experts, MoE layers after a dense one, ...) stops the script with exit 2 naming it, before
anything runs. Each run takes ``--iters`` steps; bridge's first 3 and torchtitan's first 5 (compilation) are
not timed. Prints each run's ms/step, tokens/s/GPU, TFLOP/s/GPU and MFU by activated FLOPs (bridge's formula,
bridge_cli/models/flops.py, for both: multi-latent attention counted; percent of 989 TFLOP/s, the H100's dense
bf16 peak, which the H200 shares) and peak memory, then the row
``bridge / torchtitan tokens/s per GPU: R x``. It needs torchtitan 0.2.2 (``run_titan.py``'s docstring lists
the wheels). On a machine without a GPU both run on the CPU: a dry run whose numbers mean nothing.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import sys
from pathlib import Path

from compare_mcore import RunFailed
from compare_mcore import run as run_timed
from moe_ep import report, summary, titan_row
from titan_harness import shape_flags

TITAN = Path(__file__).with_name("run_titan_deepseek.py")
# bridge's model fields that run_titan_deepseek.py takes as they are
TITAN_FLAGS = {"num_layers": "--layers", "hidden_size": "--hidden", "ffn_hidden_size": "--ffn",
               "num_attention_heads": "--heads", "kv_lora_rank": "--kv-lora-rank", "qk_head_dim": "--qk-head-dim",
               "qk_pos_emb_head_dim": "--qk-rope-head-dim", "v_head_dim": "--v-head-dim",
               "num_moe_experts": "--experts", "moe_router_topk": "--topk", "moe_ffn_hidden_size": "--expert-ffn",
               "vocab_size": "--vocab", "seq_length": "--seq", "layernorm_epsilon": "--norm-eps",
               "rotary_base": "--rope-theta"}
# and those torchtitan's DeepSeek-V3 has fixed (its latent norms are always there: model.qk_layernorm in MLA)
TITAN_FIXED = {"multi_latent_attention": True, "qk_layernorm": True, "normalization": "RMSNorm",
               "gated_linear_unit": True, "add_bias_linear": False, "share_embeddings_and_output_weights": False,
               "moe_router_pre_softmax": False}


def titan_shape(recipe: str, overrides: list[str]) -> list[str]:
    """run_titan_deepseek.py's flags for the model and batch of bridge's ``recipe`` with ``overrides``; stops (exit 2)
    naming the fields torchtitan's DeepSeek-V3 cannot match."""
    from bridge_cli.config.compose import compose

    cfg = compose(recipe, overrides)
    m = cfg.model
    unlike = []
    if m.get("mtp_num_layers"):
        unlike.append(f"model.mtp_num_layers={m.mtp_num_layers} (torchtitan's DeepSeek-V3: no multi-token prediction)")
    layers, experts = m.num_layers, m.num_moe_experts
    freq = m.moe_layer_freq
    moe = [bool(f) for f in freq] if not isinstance(freq, int) else [i % freq == 0 for i in range(layers)]
    dense = moe.index(True) if experts and True in moe else layers
    if not experts or moe != [False] * dense + [True] * (layers - dense):
        unlike.append(f"model.moe_layer_freq={list(freq) if not isinstance(freq, int) else freq} with "
                      f"model.num_moe_experts={experts} (torchtitan's DeepSeek-V3: dense first layers, then MoE ones)")
    expert_ffn, shared = m.moe_ffn_hidden_size, m.moe_shared_expert_intermediate_size or 0
    if expert_ffn and shared % expert_ffn:
        unlike.append(f"model.moe_shared_expert_intermediate_size={shared} (torchtitan's DeepSeek-V3: a whole number "
                      f"of experts of model.moe_ffn_hidden_size={expert_ffn})")
    score = m.moe_router_score_function
    if score not in ("sigmoid", "softmax"):  # megatron-core normalises the top-k of both (without pre-softmax)
        unlike.append(f"model.moe_router_score_function={score} (torchtitan's DeepSeek-V3: sigmoid or softmax)")
    yarn = m.rope_type == "yarn"
    if yarn and m.mscale != m.mscale_all_dim:
        unlike.append(f"model.mscale={m.mscale} and model.mscale_all_dim={m.mscale_all_dim} (torchtitan's DeepSeek-V3: "
                      "one mscale, as if both were equal)")
    if not yarn and m.rope_type != "rope":
        unlike.append(f"model.rope_type={m.rope_type} (torchtitan's DeepSeek-V3: yarn or rope)")
    flags = shape_flags("deepseek_speed.py", "torchtitan's DeepSeek-V3", recipe, m, TITAN_FLAGS, TITAN_FIXED, unlike)
    flags += [f"--dense-layers={dense}", f"--q-lora-rank={m.q_lora_rank or 0}",
              f"--groups={m.moe_router_num_groups or 0}", f"--group-topk={m.moe_router_group_topk or 0}",
              f"--shared-experts={shared // expert_ffn}", f"--score-func={score}", "--route-norm",
              f"--route-scale={m.moe_router_topk_scaling_factor or 1.0}",
              f"--bias-update={m.moe_router_bias_update_rate if m.moe_router_enable_expert_bias else 0}",
              # without YaRN: no scaling, as torchtitan skips YaRN where seq <= its original length
              f"--rope-factor={m.rotary_scaling_factor if yarn else 1.0}",
              f"--original-seq={m.original_max_position_embeddings if yarn else m.seq_length}",
              f"--beta-fast={int(m.beta_fast)}", f"--beta-slow={int(m.beta_slow)}",
              f"--mscale={m.mscale_all_dim if yarn else 1.0}"]
    return [*flags, f"--local-batch={cfg.train.micro_batch_size}", f"--global-batch={cfg.train.global_batch_size}"]


def titan(flags: list[str], iters: int) -> dict | None:
    """torchtitan's DeepSeek-V3 on one process for ``iters`` steps (see moe_ep.titan_row)."""
    return titan_row("torchtitan", [sys.executable, str(TITAN)], flags, iters)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30, help="steps of each run (at least 6)")
    parser.add_argument("--recipe", default="deepseek_proxy")
    parser.add_argument("--titan-arg", action="append", default=[], metavar="FLAG",
                        help="a flag for run_titan_deepseek.py (repeatable, e.g. --titan-arg=--attn=flex)")
    parser.add_argument("overrides", nargs="*", help="bridge overrides (KEY=VALUE), also read for torchtitan's shape")
    args = parser.parse_args()
    if args.iters < 6:
        parser.error("--iters must be at least 6: torchtitan's first 5 steps are not timed")
    if importlib.util.find_spec("torchtitan") is None:
        sys.exit("deepseek_speed.py runs torchtitan 0.2.2, which is not installed here: run_titan.py's docstring "
                 "(--help) lists the wheels it needs.")
    flags = [*titan_shape(args.recipe, args.overrides), *args.titan_arg]
    bridge = [sys.executable, "-m", "bridge_cli", "pretrain", f"recipe={args.recipe}", "train.eval_iters=0",
              "logger.log_interval=1", *args.overrides, f"train.train_iters={args.iters}"]
    print(f"{'run':<22} {'ms/step':>8} {'tok/s/gpu':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}", flush=True)
    try:
        ours = report("bridge", summary(run_timed(bridge, re.compile(r"^iteration\s+1/", re.M))[0]))
    except RunFailed as failure:  # its command and the end of its output are printed above
        sys.exit(f"deepseek_speed.py stops: {failure}")
    theirs = titan(flags, args.iters)
    if theirs:
        print(f"bridge / torchtitan tokens/s per GPU: {ours['tokens'] / theirs['tokens']:.2f}x (bridge "
              f"{ours['tokens']:,.0f}, torchtitan {theirs['tokens']:,.0f})", flush=True)
    else:
        sys.exit(1)


if __name__ == "__main__":
    main()
