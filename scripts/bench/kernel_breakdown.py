"""GPU time by kernel kind from PyTorch profiler traces: bridge's, torchtitan's or any other run's.

    python scripts/bench/kernel_breakdown.py TRACE.pt.trace.json[.gz] [TRACE ...] --steps N

bridge prints the same table itself when `profiling.use_pytorch_profiler=true` runs on CUDA; this
reads traces other trainers wrote (torchtitan: `--profiling.enable_profiling`) so both are split the
same way. ``--steps`` is how many training steps the trace covers.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bridge_cli.training import kernel_breakdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, nargs="+")
    parser.add_argument("--steps", type=int, required=True)
    args = parser.parse_args()
    for trace in args.trace:
        shares = kernel_breakdown.breakdown(kernel_breakdown.from_trace_file(trace), args.steps)
        print(kernel_breakdown.table(shares, f"{trace} ({args.steps} steps), per step:"))


if __name__ == "__main__":
    main()
