"""Expert parallelism against one GPU on the MoE proxy: the same loss curve, the speed, and a checkpoint
saved at EP=N that resumes on one GPU.

    python scripts/bench/moe_ep.py [--iters 30] [--ep 2] [--recipe moe_proxy] [-- OVERRIDE ...]

Three runs of `bridge pretrain` with the same global batch: one process; ``--ep`` processes under
torchrun with ``model.expert_model_parallel_size=EP`` (data-parallel EP for the rest of the model),
saving its last iteration; then one process resuming that checkpoint for 5 more iterations.
Prints each run's tokens/s/GPU, TFLOP/s/GPU and MFU on the activated parameters, peak memory, and
the largest relative difference between the two loss curves. OVERRIDEs apply to every run
(default: ``model.num_layers=8 optimizer.use_distributed_optimizer=true``).
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys
import tempfile

from compare_mcore import H100_BF16_PEAK_TFLOPS, ITER_LINE, PEAK, run

LOSS = re.compile(r"^iteration\s+(\d+)/\d+ .*\| lm loss ([0-9.]+) ", re.M)
TOKENS = re.compile(r"^iteration\s+(\d+)/\d+ .*\| tokens/s/gpu ([0-9,]+) ", re.M)
DEFAULT_OVERRIDES = ["model.num_layers=8", "optimizer.use_distributed_optimizer=true"]


def summary(out: str, warmup: int = 3) -> dict:
    rows = [(float(ms), float(tf)) for i, ms, tf in ITER_LINE.findall(out) if int(i) > warmup]
    tokens = [float(t.replace(",", "")) for i, t in TOKENS.findall(out) if int(i) > warmup]
    peak = PEAK.search(out)
    return {"losses": {int(i): float(x) for i, x in LOSS.findall(out)},
            "tokens": statistics.median(tokens) if tokens else float("nan"),
            "step_ms": statistics.median(ms for ms, _ in rows) if rows else float("nan"),
            "tflops": statistics.median(tf for _, tf in rows) if rows else float("nan"),
            "peak": float(peak.group(1)) if peak else float("nan")}


def report(name: str, r: dict) -> dict:
    print(f"{name:<22} {r['step_ms']:>8.1f} {r['tokens']:>10,.0f} {r['tflops']:>8.1f} "
          f"{r['tflops'] / H100_BF16_PEAK_TFLOPS:>6.1%} {r['peak']:>9.1f}", flush=True)
    return r


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--recipe", default="moe_proxy")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    base = [f"recipe={args.recipe}", "train.eval_iters=0", "logger.log_interval=1",
            *(args.overrides or DEFAULT_OVERRIDES)]
    bridge = [sys.executable, "-m", "bridge_cli", "pretrain"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ep), "-m", "bridge_cli",
                "pretrain"]
    print(f"{'run':<22} {'ms/step':>8} {'tok/s/gpu':>10} {'TFLOP/s':>8} {'MFU':>6} {'peak GiB':>9}", flush=True)
    with tempfile.TemporaryDirectory() as save:
        # each run's line as soon as it ends, so a time limit keeps what finished
        one = report("one GPU", summary(run([*bridge, *base, f"train.train_iters={args.iters}"])[0]))
        ep = report(f"EP={args.ep} on {args.ep} GPUs", summary(run([
            *torchrun, *base, f"train.train_iters={args.iters}", f"model.expert_model_parallel_size={args.ep}",
            f"checkpoint.save={save}", f"checkpoint.save_interval={args.iters}"])[0]))
        resumed = summary(run([*bridge, *base, f"train.train_iters={args.iters + 5}", f"checkpoint.save={save}",
                               "checkpoint.save_interval=1000", "scheduler.override_opt_param_scheduler=true"])[0])
    differences = [abs(ep["losses"][i] / one["losses"][i] - 1) for i in one["losses"]]
    print(f"loss curves over {args.iters} iterations: largest relative difference {max(differences):.2e} "
          f"(first {one['losses'].get(1)}, last one GPU {one['losses'].get(args.iters)}, EP "
          f"{ep['losses'].get(args.iters)})")
    resumed_iters = sorted(i for i in resumed["losses"] if i > args.iters)
    print(f"EP={args.ep} checkpoint resumed on one process: iterations {resumed_iters[:1]}..{resumed_iters[-1:]}, "
          f"losses {[resumed['losses'][i] for i in resumed_iters]}")


if __name__ == "__main__":
    main()
