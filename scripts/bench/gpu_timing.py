"""The GPU time of a callable, for the micro-benchmarks in this folder (they import it as a sibling module)."""

from __future__ import annotations

import torch


def time_ms(fn, steps: int = 20, warmup: int = 3) -> float:
    """Mean ms of ``fn`` over ``steps`` calls, by CUDA events, after ``warmup`` calls."""
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
