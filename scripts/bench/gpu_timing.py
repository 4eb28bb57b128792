"""The GPU time of a callable, for the micro-benchmarks in this folder (they import it as a sibling module).

torch is imported where it is used, so that the scripts' ``--help`` answers without it.
"""

from __future__ import annotations

import sys


def require_cuda(what: str) -> None:
    """Exit with ``what`` and a reason, not a traceback, where no CUDA GPU is visible."""
    import torch

    if not torch.cuda.is_available():
        sys.exit(f"{what}, and no CUDA GPU is visible here (torch {torch.__version__}: torch.cuda.is_available() "
                 "is false).")


def time_ms(fn, steps: int = 20, warmup: int = 3) -> float:
    """Mean ms of ``fn`` over ``steps`` calls, by CUDA events, after ``warmup`` calls."""
    import torch

    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(steps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / steps
