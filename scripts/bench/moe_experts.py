"""Grouped-GEMM experts against megatron-core's SequentialMLP on the MoE proxy, in one run on one GPU.

    python scripts/bench/moe_experts.py [--steps 12] [--warmup 3] [--layers 16] [OVERRIDE ...]

Runs `bridge pretrain recipe=moe_proxy` (16 MoE layers, hidden 2048, 64 experts top-8 of FFN 768,
seq 4096, bf16, global batch 8 of micro-batch 1, the torch spec) twice: with
model.moe_grouped_gemm=true (torch._grouped_mm) and false (SequentialMLP, one GEMM per expert).
Prints ms/step, tokens/s/GPU, TFLOP/s/GPU and MFU counted on the activated parameters (top-8
routed experts, not all 64), peak memory, and the grouped / sequential ratio. The first --warmup
steps are not timed. The proxy's weights, gradients and Adam state need about 100 GB: run it on an
H200, or pass --layers 8 on an 80 GB GPU. Extra OVERRIDEs apply to both runs.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from compare_mcore import H100_BF16_PEAK_TFLOPS, ITER_LINE, PEAK, run

TOKENS_PER_STEP = 8 * 4096
BASE = ["recipe=moe_proxy", "model.spec=torch", "train.eval_iters=0", "logger.log_interval=1",
        "train.global_batch_size=8", "train.micro_batch_size=1", "dataset.num_workers=2"]


def measure(steps: int, warmup: int, overrides: list[str]) -> dict:
    out, wall = run([sys.executable, "-m", "bridge_cli", "pretrain", *BASE, f"train.train_iters={steps + warmup}",
                     *overrides])
    rows = [(float(ms), float(tf)) for i, ms, tf in ITER_LINE.findall(out) if int(i) > warmup]
    step_ms = statistics.median(ms for ms, _ in rows)
    tflops = statistics.median(tf for _, tf in rows)
    peak = PEAK.search(out)
    return {"ms/step": step_ms, "tok/s/gpu": TOKENS_PER_STEP / step_ms * 1000, "TFLOP/s": tflops,
            "MFU": tflops / H100_BF16_PEAK_TFLOPS, "peak GiB": float(peak.group(1)) if peak else float("nan"),
            "wall s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("overrides", nargs="*", help="extra `bridge pretrain` overrides for both runs")
    args = parser.parse_args()
    common = [f"model.num_layers={args.layers}", *args.overrides]
    results = {name: measure(args.steps, args.warmup, [f"model.moe_grouped_gemm={flag}", *common])
               for name, flag in (("grouped GEMM", "true"), ("SequentialMLP", "false"))}
    print(f"\nMoE proxy, {args.layers} layers, {TOKENS_PER_STEP} tokens/step; MFU on activated FLOPs "
          f"against {H100_BF16_PEAK_TFLOPS:.0f} TFLOP/s bf16 peak")
    print(f"{'experts':<14} {'ms/step':>8} {'tok/s/gpu':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'wall s':>7}")
    for name, r in results.items():
        print(f"{name:<14} {r['ms/step']:>8.1f} {r['tok/s/gpu']:>10,.0f} {r['TFLOP/s']:>8.1f} {r['MFU']:>6.1%} "
              f"{r['peak GiB']:>9.2f} {r['wall s']:>7.0f}")
    grouped, sequential = results["grouped GEMM"], results["SequentialMLP"]
    print(f"grouped / SequentialMLP tokens/s: {grouped['tok/s/gpu'] / sequential['tok/s/gpu']:.2f}x")


if __name__ == "__main__":
    main()
