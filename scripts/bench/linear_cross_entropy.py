"""Peak memory and step time of the loss with and without ``model.fused_linear_cross_entropy``, in one command.

    PYTHONPATH=. python scripts/bench/linear_cross_entropy.py            # CPU: tiny layers, vocabulary 128000
    PYTHONPATH=. python scripts/bench/linear_cross_entropy.py --gpu      # GPU: the llama1b recipe (vocabulary 128256)

Each setting is one ``bridge pretrain`` process on mock data; its peak is CUDA's peak allocated memory
(the run's own memory line) on the GPU, the process's peak RSS on the CPU, and its time the mean
ms/iter after the first iterations. Any extra argument is passed to every run.
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys

# 4096 tokens a step, four chunks of 1024 (the unfused run does not read the chunk size)
CPU = ["recipe=tiny", "model.vocab_size=128000", "model.seq_length=512", "train.micro_batch_size=8",
       "train.global_batch_size=8", "train.train_iters=4", "model.linear_cross_entropy_chunk=1024"]
GPU = ["recipe=llama1b", "train.micro_batch_size=4", "train.global_batch_size=32", "train.train_iters=12"]
SETTINGS = {"unfused": [], "fused": ["model.fused_linear_cross_entropy=true"]}

# runs bridge in a child and prints that child's peak RSS (KiB), so each setting is measured alone
MEASURE_RSS = ("import resource, subprocess, sys; code = subprocess.call(sys.argv[1:]); "
               "print(f'peak rss kib {resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}'); sys.exit(code)")


def run(args: list[str], gpu: bool) -> dict:
    command = [sys.executable, "-m", "bridge_cli", "pretrain", *args, "logger.log_interval=1", "train.eval_iters=0"]
    if not gpu:
        command = [sys.executable, "-c", MEASURE_RSS, *command]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode:
        sys.exit(f"failed: {' '.join(args)}\n{result.stderr[-3000:]}")
    out = result.stdout + result.stderr
    times = [float(t) for t in re.findall(r"elapsed ms/iter ([\d.]+)", out)][2:]
    if gpu:
        peak = max(float(p) for p in re.findall(r"peak allocated ([\d.]+) GiB", out))
    else:
        peak = int(re.search(r"peak rss kib (\d+)", out).group(1)) / 2**20
    return {"ms/iter": statistics.mean(times), "peak GiB": peak}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpu", action="store_true", help="the llama1b recipe on the GPU")
    known, extra = parser.parse_known_args()
    base = (GPU if known.gpu else CPU) + extra
    results = {name: run(base + overrides, known.gpu) for name, overrides in SETTINGS.items()}
    print(f"{'setting':<10} {'ms/iter':>9} {'peak GiB':>9}   ({' '.join(base)})")
    for name, r in results.items():
        print(f"{name:<10} {r['ms/iter']:>9.1f} {r['peak GiB']:>9.2f}")
    saved = results["unfused"]["peak GiB"] - results["fused"]["peak GiB"]
    print(f"fused: {saved:.2f} GiB less at its peak, {results['fused']['ms/iter'] / results['unfused']['ms/iter']:.3f}x "
          "the unfused time per iteration")


if __name__ == "__main__":
    main()
