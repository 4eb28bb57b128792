"""Expert parallelism against one GPU on the MoE proxy: the same loss curve, the speed, the all-to-all
share of the step, and a checkpoint saved at EP=N that resumes on one GPU.

    python scripts/bench/moe_ep.py [--iters 30] [--ep 2 [4 ...]] [--recipe moe_proxy] [-- OVERRIDE ...]

Runs of `bridge pretrain` with the same global batch:
1. one process, and again with another micro-batch size (``--control-micro-batch``) as a control of bf16 rounding;
2. ``--ep`` processes under torchrun with ``model.expert_model_parallel_size=EP`` (data-parallel EP
   for the rest of the model), megatron-core's timers at level 2 and the PyTorch profiler on rank 0
   over three late iterations: megatron-core has no timer around the token dispatcher, so the
   communication share is read from the trace (NCCL kernels by kind: send/recv for megatron-core's
   all-to-all, all-gather and reduce-scatter for bridge's token exchange and the distributed
   optimizer, against the GPU time of the profiled steps). The one-GPU run is profiled over the same
   iterations, and a table sets each kernel kind's time per micro-batch on one GPU beside EP's: where
   the extra time of a micro-batch under EP goes (communication, idle GPU, GEMMs of uneven size);
3. the same EP layout on a small shape (``--resume-overrides``, so the checkpoint stays a few GB)
   saving at iteration 4, then one process resuming it to iteration 8, and one process running the
   8 iterations straight through for comparison.
Prints each run's tokens/s/GPU, TFLOP/s/GPU and MFU on the activated parameters, peak memory, and
the largest relative difference between the loss curves. OVERRIDEs apply to runs 1 and 2 (default:
``DEFAULT_OVERRIDES`` below).

``--titan`` adds, after bridge's EP runs, torchtitan's MoE (``run_titan_moe.py`` in this folder: its Qwen3 MoE
model, compiled, FSDP2 over the ranks) at each ``--ep`` size on as many GPUs, at the shape, micro-batch and global
batch of bridge's runs (read from the recipe and the OVERRIDEs), for as many steps, and prints the row
``EP=N: bridge / torchtitan tokens/s per GPU``. It needs torchtitan 0.2.2 (``run_titan.py``'s docstring lists
the wheels); ``--titan-arg`` passes a flag to run_titan_moe.py (repeatable, e.g. ``--titan-arg=--load-balance=none``).
"""

from __future__ import annotations

import argparse
import bisect
import importlib.util
import json
import math
import re
import statistics
import sys
import tempfile
from pathlib import Path

from compare_mcore import H100_BF16_PEAK_TFLOPS, ITER_LINE, PEAK, RunFailed
from compare_mcore import run as run_timed
from titan_harness import shape_flags

LOSS = re.compile(r"^iteration\s+(\d+)/\d+ .*\| lm loss ([0-9.]+) ", re.M)
EP_LOAD = re.compile(r"^iteration\s+(\d+)/\d+ .*\| ep load max/mean ([0-9.]+) ", re.M)
"""The log line's expert-parallel load: the busiest rank's (token, expert) pairs in each exchange over the group's
mean, summed over the log interval (bridge_cli/logging/expert_load.py)."""
TOKENS = re.compile(r"^iteration\s+(\d+)/\d+ .*\| tokens/s/gpu ([0-9,]+) ", re.M)
KERNEL_TABLE = re.compile(r"^GPU time of .*by kernel kind:\n(?:  .*\n)+", re.M)
KIND_ROW = re.compile(r"^  (\S.*?)\s+([0-9.]+)\s+[0-9.]+%$", re.M)
MICRO_BATCHES = re.compile(r"\((\d+) micro-batch(?:es)? of \d+\)")
"""The start-up line's micro-batches a step on each rank."""
TIMER = re.compile(r"^\s+(forward-backward|forward-compute|backward-compute|all-grads-sync|params-all-gather|"
                   r"optimizer)\s*\.*:\s*\(([0-9.]+), ([0-9.]+)\)", re.M)
# CPU initialization draws every expert the same under any expert-parallel size (on the GPU each
# EP rank draws its experts from its own seed), so the layouts start from the same model.
# The recipe's micro-batch of 2 on every GPU and its compiled layers (bridge's token dispatch compiles at any EP
# size). At micro-batch 1 the proxy's step is bound by the host on one GPU already (about 1,100 kernel launches a
# micro-batch), and each EP layer adds collectives to launch: see docs/performance.md. The learning rate is the
# hand-made EP runs' 3e-5: at the recipe's 3e-4, 5 warm-up steps into a 16-iteration run, one GPU's loss jumped from
# 8.4 to 13.9 at iteration 10 (4 x H200, 2026-11-28) and the curves' difference measured that spike, not the layout.
DEFAULT_OVERRIDES = ["model.num_layers=8", "optimizer.use_distributed_optimizer=true", "model.use_cpu_initialization=true",
                     "optimizer.lr=3e-5"]
RESUME_OVERRIDES = ["model.num_layers=2", "model.num_moe_experts=16", "model.vocab_size=32768",
                    "optimizer.use_distributed_optimizer=true", "model.use_cpu_initialization=true",
                    "model.compile_layers=false", "train.micro_batch_size=1"]


def run(argv: list[str]) -> tuple[str, float, float]:
    """``compare_mcore.run`` timing the launch to the first iteration's log line; a failed run ends the script."""
    try:
        return run_timed(argv, re.compile(r"^iteration\s+1/", re.M))
    except RunFailed as failure:  # its command and the end of its output are printed above
        sys.exit(f"moe_ep.py stops: {failure}")


def summary(out: str, warmup: int = 3, loss: re.Pattern = LOSS) -> dict:
    """A run's log read: ``loss`` finds each iteration's loss (default: lm loss)."""
    rows = [(float(ms), float(tf)) for i, ms, tf in ITER_LINE.findall(out) if int(i) > warmup]
    tokens = [float(t.replace(",", "")) for i, t in TOKENS.findall(out) if int(i) > warmup]
    loads = [float(x) for i, x in EP_LOAD.findall(out) if int(i) > warmup]
    peak = PEAK.search(out)
    return {"losses": {int(i): float(x) for i, x in loss.findall(out)},
            "tokens": statistics.median(tokens) if tokens else float("nan"),
            "step_ms": statistics.median(ms for ms, _ in rows) if rows else float("nan"),
            "tflops": statistics.median(tf for _, tf in rows) if rows else float("nan"),
            "peak": float(peak.group(1)) if peak else float("nan"),
            "ep_load": statistics.median(loads) if loads else float("nan"),
            "timers": {name: float(high) for name, _, high in TIMER.findall(out)},  # the last interval's
            "kinds": kinds_per_micro_batch(out)}


def kinds_per_micro_batch(out: str) -> dict:
    """The profiled iterations' GPU time by kernel kind (bridge's table) per micro-batch of the rank, in ms; empty
    where the log has no table (no profiler, a CPU)."""
    table, micro = KERNEL_TABLE.search(out), MICRO_BATCHES.search(out)
    if not table or not micro:
        return {}
    return {kind: float(ms) / int(micro.group(1)) for kind, ms in KIND_ROW.findall(table.group(0))}


def kind_comparison(name: str, one: dict, other: dict) -> str:
    """Per micro-batch, each kernel kind's milliseconds on one GPU and in run ``name``, and the difference: where
    expert parallelism's extra time goes at the same micro-batch ("" where either run has no table)."""
    if not one or not other:
        return ""
    lines = [f"GPU time per micro-batch by kernel kind (ms), one GPU against {name}:",
             f"  {'kind':<28} {'one GPU':>8} {name:>8} {'more':>8}"]
    for kind in sorted(set(one) | set(other), key=lambda k: -(other.get(k, 0) - one.get(k, 0))):
        a, b = one.get(kind, 0.0), other.get(kind, 0.0)
        lines.append(f"  {kind:<28} {a:>8.2f} {b:>8.2f} {b - a:>+8.2f}")
    return "\n".join(lines)


def profiled(iters: int, trace_dir: Path) -> list[str]:
    """Overrides that profile iterations ITERS-4..ITERS-2 into ``trace_dir`` (bridge prints its kernel-kind table)."""
    return ["profiling.use_pytorch_profiler=true", f"profiling.profile_step_start={iters - 4}",
            f"profiling.profile_step_end={iters - 2}", f"logger.tensorboard_dir={trace_dir}"]


def report(name: str, r: dict) -> dict:
    load = r.get("ep_load", float("nan"))  # the expert-parallel rows' last column
    print(f"{name:<22} {r['step_ms']:>8.1f} {r['tokens']:>10,.0f} {r['tflops']:>8.1f} "
          f"{r['tflops'] / H100_BF16_PEAK_TFLOPS:>6.1%} {r['peak']:>9.1f}" + ("" if math.isnan(load) else f" {load:>8.3f}"),
          flush=True)
    return r


def collective_share(trace_dir: Path, steps: int) -> dict:
    """Per-step milliseconds of NCCL kernels by kind, of their time while other kernels ran (``OVERLAPPED``) and of GPU
    time in all, from rank 0's trace (empty on a CPU)."""
    trace = json.loads(next(trace_dir.glob("*.pt.trace.json")).read_text())
    kernels = [e for e in trace["traceEvents"] if e.get("cat") == "kernel" and "dur" in e]
    if not kernels:
        return {}
    span_us = max(e["ts"] + e["dur"] for e in kernels) - min(e["ts"] for e in kernels)
    kinds = {"all-to-all (SendRecv)": "SendRecv", "reduce-scatter": "ReduceScatter", "all-gather": "AllGather",
             "all-reduce": "AllReduce"}
    per_step = {kind: sum(e["dur"] for e in kernels if "nccl" in e["name"].lower() and key in e["name"])
                / steps / 1000 for kind, key in kinds.items()}
    nccl = [e for e in kernels if "nccl" in e["name"].lower()]
    per_step[OVERLAPPED] = overlapped_us(nccl, [e for e in kernels if "nccl" not in e["name"].lower()]) / steps / 1000
    per_step["GPU time"] = span_us / steps / 1000
    return per_step


OVERLAPPED = "of which overlapped"
"""collective_share's key: the NCCL kernels' time during which a compute kernel ran too (issue 44's question whether
model.moe_exchange_chunks overlaps the exchange with the experts on the GPU)."""


def overlapped_us(collectives: list[dict], compute: list[dict]) -> float:
    """Microseconds of the ``collectives`` kernels (trace events: ``ts``, ``dur``) during which some ``compute`` kernel
    ran (on another stream)."""
    busy = []  # the compute kernels' time as disjoint [start, end) spans, in order
    for start, end in sorted((e["ts"], e["ts"] + e["dur"]) for e in compute):
        if busy and start <= busy[-1][1]:
            busy[-1][1] = max(busy[-1][1], end)
        else:
            busy.append([start, end])
    starts = [start for start, _ in busy]
    total = 0.0
    for e in collectives:
        low, high = e["ts"], e["ts"] + e["dur"]
        span = max(bisect.bisect_right(starts, low) - 1, 0)
        while span < len(busy) and busy[span][0] < high:
            total += max(0.0, min(high, busy[span][1]) - max(low, busy[span][0]))
            span += 1
    return total


def curve_difference(a: dict, b: dict, iterations) -> float:
    return max(abs(b[i] / a[i] - 1) for i in iterations)


def torchrun(ranks: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "-m", "bridge_cli", "pretrain"]


# bridge's model fields that run_titan_moe.py takes as flags, and those torchtitan's Qwen3 MoE has fixed
TITAN_FLAGS = {"num_layers": "--layers", "hidden_size": "--hidden", "num_attention_heads": "--heads",
               "num_query_groups": "--kv-heads", "kv_channels": "--head-dim", "num_moe_experts": "--experts",
               "moe_router_topk": "--topk", "moe_ffn_hidden_size": "--expert-ffn", "vocab_size": "--vocab",
               "seq_length": "--seq", "layernorm_epsilon": "--norm-eps", "rotary_base": "--rope-theta"}
TITAN_FIXED = {"moe_layer_freq": 1, "moe_shared_expert_intermediate_size": None, "qk_layernorm": True,
               "share_embeddings_and_output_weights": False, "moe_router_score_function": "softmax",
               "moe_router_pre_softmax": False, "normalization": "RMSNorm", "gated_linear_unit": True,
               "add_bias_linear": False, "multi_latent_attention": False, "moe_router_num_groups": None}


def titan_shape(recipe: str, overrides: list[str]) -> list[str]:
    """run_titan_moe.py's flags for the model and batch of bridge's ``recipe`` with ``overrides``; stops (exit 2)
    naming the fields torchtitan's Qwen3 MoE cannot match."""
    from bridge_cli.config.compose import compose

    cfg = compose(recipe, overrides)
    flags = shape_flags("moe_ep.py --titan", "torchtitan's Qwen3 MoE", recipe, cfg.model, TITAN_FLAGS, TITAN_FIXED)
    return [*flags, f"--local-batch={cfg.train.micro_batch_size}", f"--global-batch={cfg.train.global_batch_size}"]


def titan(script: Path, size: int, flags: list[str], iters: int) -> dict | None:
    """torchtitan's MoE at EP=``size`` on ``size`` GPUs for ``iters`` steps (see :func:`titan_row`)."""
    return titan_row(f"torchtitan EP={size}", [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node",
                                               str(size), str(script), "--ep", str(size)], flags, iters)


def titan_row(name: str, command: list[str], flags: list[str], iters: int) -> dict | None:
    """A torchtitan bench runner (``command``, then ``flags``, which may override its step counts) for ``iters``
    steps, the first 5 untimed (compilation); prints its row ``name`` (or why it failed) and returns its speed and
    memory as summary() names them, or None."""
    argv = [*command, "--warmup", "5", "--steps", str(max(iters - 5, 1)), *flags]
    try:
        out = run_timed(argv, re.compile(r"step:\s+1\s"))[0]
    except RunFailed as failure:  # its command and the end of its output are printed above
        print(f"{name:<22} failed: {failure}", flush=True)
        return None
    res = json.loads(out.strip().splitlines()[-1])
    return report(name, {
        "step_ms": res["step_ms_median"], "tokens": res["tokens_per_s_per_gpu"], "tflops": res["tflops_per_s_per_gpu"],
        "peak": float("nan") if res["peak_mem_gib"] is None else res["peak_mem_gib"]})


def expert_parallel(size: int, base: list[str], iters: int, tmp: Path) -> dict:
    """One EP run under the profiler (three late iterations on rank 0); prints its row, then where its GPU time went."""
    first, last = iters - 4, iters - 2
    trace_dir = tmp / f"tb_ep{size}"
    out = run([*torchrun(size), *base, f"train.train_iters={iters}", f"model.expert_model_parallel_size={size}",
               "logger.timing_log_level=2", *profiled(iters, trace_dir)])[0]
    result = report(f"EP={size} on {size} GPUs", summary(out))
    kinds = KERNEL_TABLE.search(out)
    if kinds:  # rank 0's GPU time by kernel kind, as bridge printed it
        print(f"EP={size} {kinds.group(0).strip()}")
    timers = ", ".join(f"{name} {ms:.1f}" for name, ms in result["timers"].items())
    print(f"EP={size} megatron-core timers (max over ranks, ms per iteration): {timers}")
    share = collective_share(trace_dir, last - first + 1)
    if share:
        from bridge_cli.training import kernel_breakdown

        trace = next(trace_dir.glob("*.pt.trace.json"))
        rows = kernel_breakdown.by_launching_op(trace, last - first + 1, 25)
        print(kernel_breakdown.op_table(rows, f"EP={size} rank 0, the 25 largest kernels by launching op, per step:"))
        collectives = sum(v for k, v in share.items() if k not in ("GPU time", OVERLAPPED))
        print(f"EP={size} rank 0 trace, ms per step: " + ", ".join(f"{k} {v:.1f}" for k, v in share.items())
              + f"; collectives {collectives / share['GPU time']:.1%} of the GPU time (the token exchange and the"
              f" optimizer's gradient reduce-scatter and weight all-gather), {share[OVERLAPPED] / collectives:.0%} of"
              " theirs while compute kernels ran", flush=True)
    return result


EXCHANGE_ONLY = ("model.moe_exchange_chunks=",)
"""Overrides of the expert-parallel exchange, which one process refuses (it exchanges nothing)."""


def one_gpu(overrides: list[str]) -> list[str]:
    """``overrides`` for the one-GPU runs: those of the expert-parallel exchange left out."""
    return [o for o in overrides if not o.startswith(EXCHANGE_ONLY)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--ep", type=int, nargs="+", default=[2], help="expert-parallel sizes, one run each")
    parser.add_argument("--recipe", default="moe_proxy")
    parser.add_argument("--resume-overrides", nargs="*", default=RESUME_OVERRIDES)
    parser.add_argument("--curves-only", action="store_true", help="only the one-GPU and EP runs")
    parser.add_argument("--control-micro-batch", type=int, default=1,
                        help="the control run's micro-batch size (another than the runs' own)")
    parser.add_argument("--titan", type=Path, nargs="?", const=Path(__file__).with_name("run_titan_moe.py"),
                        metavar="RUN_TITAN_MOE_PY", help="also run torchtitan's MoE at each --ep size (default: "
                        "run_titan_moe.py in this folder)")
    parser.add_argument("--titan-arg", action="append", default=[], metavar="FLAG",
                        help="a flag for run_titan_moe.py (needs --titan)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.iters < 5:
        parser.error("--iters must be at least 5: the profiler takes iterations ITERS-4..ITERS-2 and the first 3 "
                     "are not timed")
    if args.titan_arg and not args.titan:
        parser.error("--titan-arg needs --titan")
    if args.titan and not args.titan.is_file():
        parser.error(f"no such file: {args.titan}")
    if args.titan and importlib.util.find_spec("torchtitan") is None:
        sys.exit("moe_ep.py --titan runs torchtitan 0.2.2, which is not installed here: run_titan.py's docstring "
                 "(--help) lists the wheels it needs.")
    overrides = args.overrides or DEFAULT_OVERRIDES
    titan_flags = [*titan_shape(args.recipe, overrides), *args.titan_arg] if args.titan else []
    base = [f"recipe={args.recipe}", "train.eval_iters=0", "logger.log_interval=1", *overrides]
    single = one_gpu(base)
    bridge = [sys.executable, "-m", "bridge_cli", "pretrain"]
    print(f"{'run':<22} {'ms/step':>8} {'tok/s/gpu':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9} {'ep load':>8}",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        # each result as soon as its run ends, so a time limit keeps what finished
        one = report("one GPU", summary(run([*bridge, *single, f"train.train_iters={args.iters}",
                                             *profiled(args.iters, tmp / "tb_one")])[0]))
        runs = {"one GPU": one}
        for size in args.ep:
            runs[f"EP={size}"] = expert_parallel(size, base, args.iters, tmp)
            comparison = kind_comparison(f"EP={size}", one["kinds"], runs[f"EP={size}"]["kinds"])
            if comparison:
                print(comparison, flush=True)
        titan_runs = {size: titan(args.titan, size, titan_flags, args.iters) for size in args.ep} if args.titan else {}
        for size, theirs in titan_runs.items():
            if theirs:
                ours = runs[f"EP={size}"]["tokens"]
                print(f"EP={size}: bridge / torchtitan tokens/s per GPU {ours / theirs['tokens']:.2f}x (bridge "
                      f"{ours:,.0f}, torchtitan {theirs['tokens']:,.0f})", flush=True)
        # the control: one GPU again with another micro-batch size (the same math, summed in another order),
        # to tell bf16 rounding carried through a steep curve from an EP error
        if not args.curves_only:
            control = f"micro-batch {args.control_micro_batch}"
            runs[control] = report(f"one GPU, {control}", summary(run([
                *bridge, *single, f"train.train_iters={args.iters}",
                f"train.micro_batch_size={args.control_micro_batch}"])[0]))
        for name, r in runs.items():
            print(f"{name} losses: " + " ".join(f"{r['losses'][i]:.3f}" for i in sorted(r["losses"])))
        print(f"loss curves over {args.iters} iterations, largest relative difference from one GPU: " + ", ".join(
            f"{name} {curve_difference(one['losses'], r['losses'], one['losses']):.2e}"
            for name, r in list(runs.items())[1:]), flush=True)
        for name, r in list(runs.items())[1:]:
            print(f"{name}: {r['tokens'] / one['tokens']:.2f}x one GPU's tokens/s per GPU")
        if args.curves_only:
            return
        size = args.ep[-1]
        ep = f"model.expert_model_parallel_size={size}"
        small = [f"recipe={args.recipe}", "train.eval_iters=0", "logger.log_interval=1", *args.resume_overrides]
        save = [*small, "train.train_iters=8", f"checkpoint.save={tmp / 'ckpt'}"]
        straight = summary(run([*bridge, *small, "train.train_iters=8"])[0])["losses"]
        run([*torchrun(size), *save, ep, "train.exit_interval=4"])
        out = run([*bridge, *save])[0]
        resumed = summary(out)["losses"]
        notes = [line.strip() for line in out.splitlines() if "optimizer starts fresh" in line]
        # iteration 5's loss is computed before the resumed run's first update: the same weights
        print(f"EP={size} checkpoint (iteration 4) resumed on one process: losses 5..8 "
              f"{[resumed[i] for i in range(5, 9)]}, one process straight through {[straight[i] for i in range(5, 9)]}"
              f" (iteration 5 relative difference {abs(resumed[5] / straight[5] - 1):.2e})"
              + (f"\n  {notes[0]}" if notes else ""))


if __name__ == "__main__":
    main()
