"""GPU time by kernel kind from PyTorch profiler traces: bridge's, torchtitan's or any other run's.

    python scripts/bench/kernel_breakdown.py TRACE.pt.trace.json[.gz] [TRACE ...] --steps N [--ops 40]

bridge prints the same table itself when `profiling.use_pytorch_profiler=true` runs on CUDA; this
reads traces other trainers wrote (torchtitan: `--profiling.enable_profiling`) so both are split the
same way. ``--steps`` is how many training steps the trace covers. ``--ops N`` also lists the N largest
(kind, kernel, launching op, its input shapes): which op a kind's time goes to (shapes where the run
recorded them, ``profiling.record_shapes=true``). Below the table, the idle time split by cause: the host
late (the next kernel launched after the GPU ran dry: Python and launch overhead set the pace) or a wait on a
launched kernel's dependency (another stream, a peer rank's collective).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from bridge_cli.training import kernel_breakdown


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", type=Path, nargs="+")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--ops", type=int, default=0, help="also list the N largest (kernel, launching op) rows")
    args = parser.parse_args()
    missing = [str(trace) for trace in args.trace if not trace.is_file()]
    if missing:
        parser.error(f"no such file: {', '.join(missing)}")
    empty = []
    for trace in args.trace:
        kernels = kernel_breakdown.from_trace_file(trace)
        if not kernels:
            empty.append(str(trace))
            continue
        shares = kernel_breakdown.breakdown(kernels, args.steps)
        print(kernel_breakdown.table(shares, f"{trace} ({args.steps} steps), per step:"))
        late, waiting = kernel_breakdown.idle_causes(trace, args.steps)
        print(f"  of the idle time: host late {late:.1f} ms/step (the next kernel launched after the GPU ran dry), "
              f"waiting on a dependency {waiting:.1f} ms/step (read host-late time as an upper bound: the profiler "
              "slows the host)")
        if args.ops:
            rows = kernel_breakdown.by_launching_op(trace, args.steps, args.ops)
            print(kernel_breakdown.op_table(rows, f"the {args.ops} largest by launching op, per step:"))
    if empty:
        sys.exit(f"no GPU kernels in {', '.join(empty)}: a trace of a run on the CPU has none")


if __name__ == "__main__":
    main()
