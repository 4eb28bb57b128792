#!/usr/bin/env python3
"""torchtitan's MoE at bridge's moe_proxy shape, with expert parallelism: the torchtitan row of moe_ep.py --titan.

    torchrun --nproc-per-node EP scripts/bench/run_titan_moe.py --ep EP [--layers 8] [--steps 25 --warmup 5]
        [-- TORCHTITAN_FLAGS ...]

Runs torchtitan 0.2.2's own Trainer on its Qwen3 MoE model (models/qwen3: QK norm, GQA, softmax top-k router
with the top-k scores renormalised, no shared expert, grouped-GEMM experts, torchtitan's all-to-all expert
parallelism) through the same extension points as run_titan.py in this folder (its TrainSpec with one flavor,
a dummy tokenizer, synthetic tokens, a metrics recorder). Of torchtitan's three MoE models this one has
moe_proxy's attention and router; deepseek_v3 has multi-latent attention and llama4 a shared expert and
sigmoid scores.

The shape of recipes/moe_proxy.yaml: hidden 2048, 16 heads, 4 KV heads, head dim 128, RMSNorm eps 1e-6 (also
on q and k), 64 routed experts of FFN 768, top-8, vocab 151936, seq 4096, RoPE base 1e6, untied embeddings;
8 layers by default (the proxy's size for an 80 GB H100; 16 on an H200). Micro-batch 2, global batch 32, as
moe_ep.py runs bridge. Under `torchrun --nproc-per-node N` torchtitan shards every weight with FSDP2 over
the N data-parallel ranks (the experts over N / EP of them) and splits the experts over --ep ranks;
compiled as torchtitan compiles MoE blocks for its users (attention, norms, router, token sort and the loss;
the experts, their token exchange and the MoE layer's gather and scatter stay eager); bf16 through FSDP2's mixed
precision (weights in bf16, gradients reduced in fp32; one GPU: autocast).

What differs from bridge's moe_proxy (megatron-core), by design of torchtitan 0.2.2:
  * load balancing: torchtitan has no auxiliary loss; its own balancing is the auxiliary-loss-free expert bias
    (MoEArgs.load_balance_coeff, 1e-3 a step, updated before each optimizer step from an all-reduce of the
    token counts), which deepseek_v3 and llama4 use. bridge adds megatron-core's aux loss (coeff 1e-3).
    --load-balance none runs torchtitan's Qwen3 spec as shipped (no balancing at all).
  * router GEMM in bf16 with the softmax in fp32 (bridge: moe_router_dtype fp32, the GEMM too);
  * FSDP2 (weights, gradients and AdamW states sharded, all-gathers each step) against bridge's distributed
    optimizer (bf16 weights whole on each rank, optimizer state sharded);
  * torchtitan's cross entropy (an fp32 copy of the bf16 logits) against bridge's Triton loss.

Prints one JSON line (rank 0): tokens_per_s_per_gpu (global batch x seq / median step time / GPUs),
tflops_per_s_per_gpu and mfu_pct by the activated FLOPs of bridge's own formula
(bridge_cli/models/flops.py on this shape: what bridge's log and moe_ep.py report), peak_mem_gib (the largest
over the ranks), and run_titan.py's other fields. Needs torchtitan 0.2.2 and the wheels run_titan.py's
docstring lists; `--device cpu` (automatic without a GPU) is a dry run under gloo, with torchtitan's for-loop
experts (torch's CPU grouped GEMM has no backward), whose numbers mean nothing.
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
    p.add_argument("--global-batch", type=int, default=32,
                   help="sequences a step over all ranks (training.global_batch_size); micro-batches per rank = "
                        "global-batch / (local-batch x data-parallel ranks)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel size (parallelism.expert_parallel_degree)")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--topk", type=int, default=8)
    p.add_argument("--expert-ffn", type=int, default=768, help="each expert's SwiGLU hidden size")
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--norm-eps", type=float, default=1e-6)
    p.add_argument("--rope-theta", type=float, default=1e6)
    p.add_argument("--load-balance", choices=["bias", "none"], default="bias",
                   help="bias: torchtitan's auxiliary-loss-free expert bias at 1e-3 a step; none: no balancing")
    p.add_argument("--grouped-mm", action=argparse.BooleanOptionalAction, default=None,
                   help="torchtitan's grouped-GEMM experts (default: on a GPU; the CPU dry run takes its for-loop)")
    a = p.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if a.experts % a.ep or world % a.ep:
        p.error(f"--ep {a.ep} must divide --experts ({a.experts}) and the number of processes ({world}); "
                f"run under torchrun --nproc-per-node {a.ep}")
    if a.global_batch % (a.local_batch * world):
        p.error(f"--global-batch {a.global_batch} must be a multiple of --local-batch ({a.local_batch}) x the number "
                f"of processes ({world})")
    return a


def model_args(a, grouped_mm=True):
    """torchtitan's Qwen3ModelArgs for the flags' shape: every layer MoE, no shared expert, softmax scores with
    the top-k renormalised and applied after the experts (megatron-core's default router: softmax over the top-k
    logits), untied embeddings."""
    from torchtitan.models.moe import MoEArgs
    from torchtitan.models.qwen3 import Qwen3ModelArgs

    return Qwen3ModelArgs(
        dim=a.hidden, n_layers=a.layers, n_heads=a.heads, n_kv_heads=a.kv_heads, head_dim=a.head_dim,
        vocab_size=a.vocab, norm_eps=a.norm_eps, rope_theta=a.rope_theta, qk_norm=True, max_seq_len=a.seq,
        enable_weight_tying=False, attn_type="sdpa", attn_mask_type="causal",
        moe_enabled=True, moe_inter_dim=a.expert_ffn,
        moe_args=MoEArgs(num_experts=a.experts, num_shared_experts=0, top_k=a.topk, score_func="softmax",
                         route_norm=True, route_scale=1.0, score_before_experts=False, use_grouped_mm=grouped_mm,
                         load_balance_coeff=1e-3 if a.load_balance == "bias" else None),
    )


def bridge_flops_per_token(a):
    """bridge's activated FLOPs per token (bridge_cli/models/flops.py) for the flags' shape, the vocabulary padded
    to a multiple of 128 as bridge pads it at TP 1."""
    from bridge_cli.models.flops import num_floating_point_operations

    shape = SimpleNamespace(
        seq_length=a.seq, hidden_size=a.hidden, num_layers=a.layers, gated_linear_unit=True, ffn_hidden_size=None,
        num_moe_experts=a.experts, moe_layer_freq=1, moe_ffn_hidden_size=a.expert_ffn, moe_router_topk=a.topk,
        moe_shared_expert_intermediate_size=None, mtp_num_layers=None, multi_latent_attention=False,
        num_attention_heads=a.heads, num_query_groups=a.kv_heads, kv_channels=a.head_dim,
        padded_vocab_size=-(-a.vocab // 128) * 128)
    return num_floating_point_operations(shape, 1) / a.seq


def main(argv=None):
    a = parse_args(argv)
    t_start = time.time()
    torch, use_cuda, datasets_mode = start("run_titan_moe.py", a)

    from torchtitan.components.optimizer import build_optimizers_with_moe_load_balancing
    from torchtitan.models import qwen3 as tt_qwen3

    grouped_mm = use_cuda if a.grouped_mm is None else a.grouped_mm
    optimizers = {"build_optimizers_fn": build_optimizers_with_moe_load_balancing} if a.load_balance == "bias" else {}
    register_bench_spec("bench_qwen3_moe", tt_qwen3.get_train_spec(), model_args(a, grouped_mm), a, a.vocab,
                        use_cuda, **optimizers)
    trainer, step_s, t_init = train(a, "bench_qwen3_moe", a.global_batch, a.seq, f"titan MoE bench, EP={a.ep}",
                                    use_cuda, ["--parallelism.expert_parallel_degree", str(a.ep),
                                               "--parallelism.data_parallel_shard_degree", "-1"])
    report(a, "qwen3 MoE", trainer, step_s, use_cuda, bridge_flops_per_token(a), datasets_mode, t_init, t_start,
           ep=a.ep, load_balance=a.load_balance, grouped_mm=grouped_mm,
           **{k: getattr(a, k) for k in ("seq", "layers", "hidden", "heads", "kv_heads", "head_dim", "experts", "topk",
                                         "expert_ffn", "vocab")})


if __name__ == "__main__":
    main()
