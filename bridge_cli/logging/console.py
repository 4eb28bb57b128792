"""The per-iteration log line, and a rich progress bar when a terminal is attached.

Only the last rank (it holds the loss on the last pipeline stage) prints. Under Slurm or with no
TTY the output is plain lines, one per ``logger.log_interval``.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import Optional

import torch


def _eta(seconds: float) -> str:
    seconds = int(max(seconds, 0))
    return f"{seconds // 3600:d}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


@dataclass
class IntervalStats:
    """What accumulates between two log lines; device tensors until the line is printed."""

    losses: dict[str, torch.Tensor] = field(default_factory=dict)
    iterations: int = 0
    skipped: int = 0
    nan_or_inf: int = 0
    started: float = field(default_factory=time.time)

    def add(self, loss_dict: dict[str, torch.Tensor], skipped: int) -> None:
        for key, value in loss_dict.items():
            self.losses[key] = self.losses.get(key, 0.0) + value
        self.iterations += 1
        self.skipped += skipped


class ConsoleLog:
    """Prints training and validation lines; owns the progress bar."""

    def __init__(self, total_iters: int, start_iter: int, enabled: bool, peak_tflops: Optional[float] = None):
        self.enabled = enabled
        self.total = total_iters
        self.peak_tflops = peak_tflops
        self.progress = None
        if enabled and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                                     TextColumn("{task.fields[loss]}"), transient=True)
            self.task = self.progress.add_task("train", total=total_iters, completed=start_iter, loss="")
            self.progress.start()

    def print(self, line: str) -> None:
        if not self.enabled:
            return
        if self.progress is not None:
            self.progress.console.print(line, highlight=False, markup=False)
        else:
            print(line, flush=True)

    def advance(self, iteration: int, loss: Optional[float] = None) -> None:
        if self.progress is not None:
            fields = {"loss": f"loss {loss:.4f}"} if loss is not None else {}
            self.progress.update(self.task, completed=iteration, **fields)

    def training_line(self, iteration: int, stats: IntervalStats, consumed_samples: int, lr: float,
                      grad_norm: Optional[float], loss_scale: float, tokens_per_iter: int, flops_per_iter: float,
                      world_size: int, elapsed_run: float, first_iter: int,
                      params_norm: Optional[float] = None, extra: tuple[str, ...] = ()) -> Optional[float]:
        """Format and print one line (``extra`` fields go before the ETA); returns the mean of the
        first loss for the progress bar."""
        elapsed = time.time() - stats.started
        per_iter = elapsed / max(stats.iterations, 1)
        losses = {k: float(v) / max(stats.iterations - stats.skipped, 1) for k, v in stats.losses.items()}
        done = iteration - first_iter
        eta = elapsed_run / max(done, 1) * (self.total - iteration)
        tflops = flops_per_iter / per_iter / world_size / 1e12
        parts = [
            f"iteration {iteration:>{len(str(self.total))}}/{self.total}",
            f"consumed samples {consumed_samples}",
            f"elapsed ms/iter {per_iter * 1000:.1f}",
            f"tokens/s/gpu {tokens_per_iter / per_iter / world_size:,.0f}",
            f"TFLOP/s/gpu {tflops:.2f}",
            *([f"MFU {tflops / self.peak_tflops:.1%}"] if self.peak_tflops else []),
            f"lr {lr:.3e}",
            *(f"{k} {v:.6f}" for k, v in losses.items()),
            f"loss scale {loss_scale:.1f}",
            f"grad norm {grad_norm:.3f}" if grad_norm is not None else "grad norm n/a",
            *([f"params norm {params_norm:.3f}"] if params_norm is not None else []),
            f"skipped {stats.skipped}",
            f"nan {stats.nan_or_inf}",
            *extra,
            f"ETA {_eta(eta)}",
        ]
        self.print(" | ".join(parts))
        return next(iter(losses.values()), None)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
            self.progress = None
