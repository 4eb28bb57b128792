"""Grouped-GEMM experts against megatron-core's SequentialMLP on the MoE proxy, in one run on one GPU.

    python scripts/bench/moe_experts.py [--steps 16] [--warmup 6] [--layers 16] [--only ARM ...] [OVERRIDE ...]

Runs `bridge pretrain recipe=moe_proxy` (16 MoE layers, hidden 2048, 64 experts top-8 of FFN 768,
seq 4096, bf16, the torch spec) four times: as the recipe ships (grouped experts, torch._grouped_mm
with the expert weight gradients added into main_grad, local token dispatch, compiled layers,
micro-batches of 2, global batch 32), the same at global batch 8, and at global batch 8 eager with
micro-batches of 1, and so with megatron-core's SequentialMLP experts (one GEMM per expert,
megatron-core's dispatcher; compiled layers need grouped experts, and micro-batches of 2 do not fit).
Prints ms/step, tokens/s/GPU, TFLOP/s/GPU and MFU counted on the activated parameters (top-8
routed experts, not all 64), peak memory, and each row's tokens/s over SequentialMLP's. The first
--warmup steps are not timed. The proxy's weights, gradients and Adam state need about 100 GB: run it
on an H200, or pass --layers 8 on an 80 GB GPU. Extra OVERRIDEs apply to every run.
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys

from compare_mcore import FIRST_ITERATION, H100_BF16_PEAK_TFLOPS, ITER_LINE, PEAK, RunFailed, run

TOKENS = re.compile(r"^iteration\s+(\d+)/\d+ .*\| tokens/s/gpu ([0-9,]+) ", re.M)
BASE = ["recipe=moe_proxy", "model.spec=torch", "train.eval_iters=0", "logger.log_interval=1",
        "dataset.num_workers=2"]
EAGER_MBS1 = ["model.compile_layers=false", "train.micro_batch_size=1"]  # what SequentialMLP fits and runs
ARMS = {  # name: (global batch, overrides)
    "as shipped": (32, []),  # grouped experts, local dispatch, compiled layers, micro-batch 2
    "as shipped, batch 8": (8, []),
    "grouped, eager, mbs 1": (8, EAGER_MBS1),
    "SequentialMLP": (8, [*EAGER_MBS1, "model.moe_grouped_gemm=false"]),
}


def measure(steps: int, warmup: int, global_batch: int, overrides: list[str]) -> dict:
    try:
        out, wall, _ = run([sys.executable, "-m", "bridge_cli", "pretrain", *BASE,
                            f"train.train_iters={steps + warmup}", f"train.global_batch_size={global_batch}",
                            *overrides], FIRST_ITERATION)
    except RunFailed as failure:  # run printed its command and the end of its output
        sys.exit(f"moe_experts.py stops: {failure}")
    rows = [(float(ms), float(tf)) for i, ms, tf in ITER_LINE.findall(out) if int(i) > warmup]
    step_ms = statistics.median(ms for ms, _ in rows)
    tflops = statistics.median(tf for _, tf in rows)
    tokens = statistics.median(float(t.replace(",", "")) for i, t in TOKENS.findall(out) if int(i) > warmup)
    peak = PEAK.search(out)
    return {"ms/step": step_ms, "tok/s/gpu": tokens, "TFLOP/s": tflops,
            "MFU": tflops / H100_BF16_PEAK_TFLOPS, "peak GiB": float(peak.group(1)) if peak else float("nan"),
            "wall s": wall}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=6)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--only", action="append", choices=list(ARMS), help="run only these arms (repeatable)")
    parser.add_argument("overrides", nargs="*", help="extra `bridge pretrain` overrides for every run")
    args = parser.parse_args()
    common = [f"model.num_layers={args.layers}", *args.overrides]
    print(f"MoE proxy, {' '.join(common)}; MFU on activated FLOPs against {H100_BF16_PEAK_TFLOPS:.0f} TFLOP/s "
          "bf16 peak", flush=True)
    results = {}
    for name in args.only or ARMS:  # each row as its run ends, so a cut-off call still reports
        global_batch, overrides = ARMS[name]
        results[name] = r = measure(args.steps, args.warmup, global_batch, [*overrides, *common])
        print(f"{name:<22} {r['ms/step']:>8.1f} ms/step {r['tok/s/gpu']:>10,.0f} tok/s/gpu {r['TFLOP/s']:>7.1f} "
              f"TFLOP/s {r['MFU']:>6.1%} MFU {r['peak GiB']:>6.2f} GiB peak {r['wall s']:>5.0f} s wall", flush=True)
    if "SequentialMLP" not in results:
        return
    sequential = results["SequentialMLP"]["tok/s/gpu"]
    for name, r in results.items():
        print(f"{name:<22} tokens/s / SequentialMLP's: {r['tok/s/gpu'] / sequential:.2f}x")


if __name__ == "__main__":
    main()
