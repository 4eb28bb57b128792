#!/usr/bin/env python3
"""torchtitan's DeepSeek-V3 on one GPU at the shape of a bridge recipe: the torchtitan row of deepseek_speed.py.

    python scripts/bench/run_titan_deepseek.py [--layers 8 --hidden 2048 ...] [--steps 25 --warmup 5]
        [-- TORCHTITAN_FLAGS ...]

Runs torchtitan 0.2.2's own Trainer on its deepseek_v3 model (models/deepseek_v3: multi-latent attention with
the latent RMSNorms, YaRN, a first ``--dense-layers`` of SwiGLU FFN ``--ffn``, then MoE layers of routed
experts plus ``--shared-experts`` experts always on, group-limited top-k, the auxiliary-loss-free expert bias),
through the same extension points as run_titan.py and run_titan_moe.py in this folder (titan_harness.py: its
TrainSpec with one flavor, a dummy tokenizer, synthetic tokens, a metrics recorder). deepseek_speed.py reads
the flags from bridge's composed config and refuses the fields this model cannot match.

The defaults are DeepSeek-V3's head dims at torchtitan's 16B flavor's width (hidden 2048, 16 heads, q_lora_rank
1536, kv_lora_rank 512, qk 128 + 64 RoPE, v 128), 64 experts of FFN 1408 top-6 in 8 groups (3 a token), one
shared expert, one dense layer of FFN 10944, 8 layers, vocab 102400, seq 4096; micro-batch 2, global batch 32.
On one GPU torchtitan applies no FSDP: bf16 is autocast and weights, gradients and AdamW states stay fp32.
Compiled as torchtitan 0.2.2 compiles DeepSeek-V3 for its users (llama4's apply_compile: the dense block whole; in
an MoE block the attention, norms, router and shared expert, and the routed experts' grouped-GEMM function, while
the experts module and the MoE layer's gather and scatter stay eager; and the loss). Attention is torchtitan's SDPA wrapper (cuDNN,
then flash, then math) with a causal mask, as bridge's mock data has no document boundaries; ``--attn flex``
takes its FlexAttention (what its 16B flavor ships, block-causal on the EOS token).

What differs from bridge (megatron-core), by design of torchtitan 0.2.2:
  * no multi-token prediction (deepseek_speed.py refuses model.mtp_num_layers), no auxiliary loss (bridge adds
    its seq_aux_loss where the recipe sets one; both update the expert bias at --bias-update a step);
  * YaRN only where seq > --original-seq (megatron-core applies its frequencies at any length), with one
    mscale (megatron-core's mscale_all_dim; the two are refused unless equal); FLOPs and speed are the same;
  * router GEMM in bf16 (bridge: moe_router_dtype fp32), torchtitan's cross entropy on an fp32 copy of the
    logits, fp32 weights under autocast (bridge: bf16 weights with fp32 main weights in the optimizer).

Prints one JSON line: tokens_per_s_per_gpu (global batch x seq / median step time), tflops_per_s_per_gpu and
mfu_pct by the activated FLOPs of bridge's own formula (bridge_cli/models/flops.py with multi-latent attention:
what bridge's log prints), peak_mem_gib, and titan_harness.py's other fields. Needs torchtitan 0.2.2 and the
wheels run_titan.py's docstring lists; `--device cpu` (automatic without a GPU) is a dry run with torchtitan's
for-loop experts, whose numbers mean nothing.
"""
import argparse
import os
import time
from types import SimpleNamespace

from titan_harness import common_arguments, register_bench_spec, report, start, train


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    common_arguments(p, compile_default=True)
    p.set_defaults(local_batch=2, steps=25, warmup=5)
    p.add_argument("--global-batch", type=int, default=32, help="sequences a step (training.global_batch_size)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--dense-layers", type=int, default=1, help="the first layers, dense (first_k_dense_replace)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--ffn", type=int, default=10944, help="the dense layers' SwiGLU hidden size")
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--q-lora-rank", type=int, default=1536, help="0: a full-rank query projection (V2-Lite)")
    p.add_argument("--kv-lora-rank", type=int, default=512)
    p.add_argument("--qk-head-dim", type=int, default=128, help="the query and key head size without RoPE")
    p.add_argument("--qk-rope-head-dim", type=int, default=64)
    p.add_argument("--v-head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=6)
    p.add_argument("--groups", type=int, default=8, help="expert groups (0: no group limit)")
    p.add_argument("--group-topk", type=int, default=3, help="groups a token may use")
    p.add_argument("--expert-ffn", type=int, default=1408, help="each expert's SwiGLU hidden size")
    p.add_argument("--shared-experts", type=int, default=1, help="shared experts, each of --expert-ffn")
    p.add_argument("--score-func", choices=["sigmoid", "softmax"], default="sigmoid")
    p.add_argument("--route-norm", action=argparse.BooleanOptionalAction, default=True,
                   help="normalise the top-k probabilities (megatron-core does for sigmoid and softmax after top-k)")
    p.add_argument("--route-scale", type=float, default=1.0, help="routed_scaling_factor")
    p.add_argument("--bias-update", type=float, default=1e-3,
                   help="the expert bias's update rate a step (0: no expert bias)")
    p.add_argument("--vocab", type=int, default=102400)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--norm-eps", type=float, default=1e-6)
    p.add_argument("--rope-theta", type=float, default=10000.0)
    p.add_argument("--rope-factor", type=float, default=40.0, help="YaRN's scaling factor")
    p.add_argument("--original-seq", type=int, default=4096, help="YaRN's original_max_position_embeddings")
    p.add_argument("--beta-fast", type=int, default=32)
    p.add_argument("--beta-slow", type=int, default=1)
    p.add_argument("--mscale", type=float, default=1.0, help="YaRN's mscale (megatron-core's mscale_all_dim)")
    p.add_argument("--attn", choices=["sdpa", "flex"], default="sdpa",
                   help="sdpa: causal, torchtitan's SDPA wrapper; flex: FlexAttention, block-causal")
    p.add_argument("--grouped-mm", action=argparse.BooleanOptionalAction, default=None,
                   help="torchtitan's grouped-GEMM experts (default: on a GPU; the CPU dry run takes its for-loop)")
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.global_batch % (a.local_batch * world):
        p.error(f"--global-batch {a.global_batch} must be a multiple of --local-batch ({a.local_batch}) x the number "
                f"of processes ({world})")
    if not 0 <= a.dense_layers <= a.layers:
        p.error(f"--dense-layers {a.dense_layers} must be between 0 and --layers ({a.layers})")
    if a.groups and (a.experts % a.groups or not 0 < a.group_topk <= a.groups):
        p.error(f"--groups {a.groups} must divide --experts ({a.experts}) and --group-topk ({a.group_topk}) be "
                "between 1 and it")
    return a


def model_args(a, grouped_mm=True):
    """torchtitan's DeepSeekV3ModelArgs for the flags' shape (its output layer untied, as in every flavor)."""
    from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs
    from torchtitan.models.moe import MoEArgs

    return DeepSeekV3ModelArgs(
        vocab_size=a.vocab, dim=a.hidden, inter_dim=a.ffn, moe_inter_dim=a.expert_ffn, n_layers=a.layers,
        n_dense_layers=a.dense_layers, n_heads=a.heads, norm_eps=a.norm_eps, max_seq_len=a.seq,
        q_lora_rank=a.q_lora_rank, kv_lora_rank=a.kv_lora_rank, qk_nope_head_dim=a.qk_head_dim,
        qk_rope_head_dim=a.qk_rope_head_dim, v_head_dim=a.v_head_dim,
        attn_type=a.attn, attn_mask_type="causal" if a.attn == "sdpa" else "block_causal",
        original_seq_len=a.original_seq, rope_theta=a.rope_theta, rope_factor=a.rope_factor,
        beta_fast=a.beta_fast, beta_slow=a.beta_slow, mscale=a.mscale,
        moe_args=MoEArgs(num_experts=a.experts, num_shared_experts=a.shared_experts, top_k=a.topk,
                         num_expert_groups=a.groups or None, num_limited_groups=a.group_topk if a.groups else None,
                         score_func=a.score_func, route_norm=a.route_norm, route_scale=a.route_scale,
                         score_before_experts=False, use_grouped_mm=grouped_mm,
                         load_balance_coeff=a.bias_update or None),
    )


def bridge_flops_per_token(a):
    """bridge's activated FLOPs per token (bridge_cli/models/flops.py, multi-latent attention) for the flags'
    shape, the vocabulary padded to a multiple of 128 as bridge pads it at TP 1."""
    from bridge_cli.models.flops import num_floating_point_operations

    shape = SimpleNamespace(
        seq_length=a.seq, hidden_size=a.hidden, num_layers=a.layers, gated_linear_unit=True, ffn_hidden_size=a.ffn,
        num_moe_experts=a.experts, moe_layer_freq=[0] * a.dense_layers + [1] * (a.layers - a.dense_layers),
        moe_ffn_hidden_size=a.expert_ffn, moe_router_topk=a.topk,
        moe_shared_expert_intermediate_size=a.shared_experts * a.expert_ffn or None, mtp_num_layers=None,
        multi_latent_attention=True, num_attention_heads=a.heads, q_lora_rank=a.q_lora_rank or None,
        kv_lora_rank=a.kv_lora_rank, qk_head_dim=a.qk_head_dim, qk_pos_emb_head_dim=a.qk_rope_head_dim,
        v_head_dim=a.v_head_dim, padded_vocab_size=-(-a.vocab // 128) * 128)
    return num_floating_point_operations(shape, 1) / a.seq


def main(argv=None):
    a = parse_args(argv)
    t_start = time.time()
    torch, use_cuda, datasets_mode = start("run_titan_deepseek.py", a)

    from torchtitan.models import deepseek_v3 as tt_deepseek

    grouped_mm = use_cuda if a.grouped_mm is None else a.grouped_mm
    # its spec's optimizer updates the expert bias where the MoE layers have a rate (--bias-update), else none
    register_bench_spec("bench_deepseek_v3", tt_deepseek.get_train_spec(), model_args(a, grouped_mm), a, a.vocab,
                        use_cuda)
    trainer, step_s, t_init = train(a, "bench_deepseek_v3", a.global_batch, a.seq, "titan DeepSeek-V3 bench",
                                    use_cuda, ["--parallelism.data_parallel_shard_degree", "-1"])
    report(a, "deepseek_v3", trainer, step_s, use_cuda, bridge_flops_per_token(a), datasets_mode, t_init, t_start,
           attn=a.attn, grouped_mm=grouped_mm,
           **{k: getattr(a, k) for k in ("seq", "layers", "dense_layers", "hidden", "ffn", "heads", "q_lora_rank",
                                         "kv_lora_rank", "qk_head_dim", "qk_rope_head_dim", "v_head_dim", "experts",
                                         "topk", "groups", "group_topk", "expert_ffn", "shared_experts", "vocab")})


if __name__ == "__main__":
    main()
