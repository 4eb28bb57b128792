"""progress.txt in the checkpoint folder (logger.log_progress), Megatron-LM's format.

One tab-separated line per job start and per saved checkpoint, so throughput over a run that was
preempted and resumed many times can be read back: job throughput counts this job only,
cumulative throughput counts from the start of the earliest job with the same world size.
"""

from __future__ import annotations

import os
import time
from datetime import datetime
from pathlib import Path
from typing import Optional

FILE_NAME = "progress.txt"
_TIME_FORMAT = "%Y-%m-%d %H:%M:%S"


def _job_id() -> str:
    return os.environ.get("SLURM_JOB_ID", "local")


def append_to_progress_log(save_dir: str, line: str, world_size: int, barrier: bool = True) -> None:
    """Append one line (rank 0 only): timestamp, job id, GPU count, then ``line``."""
    import torch.distributed as dist

    if barrier and dist.is_initialized():
        dist.barrier()
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    Path(save_dir).mkdir(parents=True, exist_ok=True)
    with open(Path(save_dir) / FILE_NAME, "a") as f:
        f.write(f"{datetime.now().strftime(_TIME_FORMAT)}\tJob ID: {_job_id()}\t# GPUs: {world_size}\t{line}\n")


def get_start_time_from_progress_log(save_dir: str, world_size: int) -> tuple[Optional[float], float]:
    """Start time (epoch seconds) of the earliest job in the latest unbroken series of jobs with this
    world size, and the floating-point operations already done when that job started."""
    path = Path(save_dir) / FILE_NAME
    start, flops_at_start, latest_flops = None, 0.0, 0.0
    for raw in (path.read_text().splitlines() if path.is_file() else []):
        fields = raw.split("\t")
        if fields[3] == "Saved checkpoint":
            latest_flops = float(next(f for f in fields if f.startswith("Floating-point operations:")).split(": ")[1])
        if fields[2] != f"# GPUs: {world_size}":
            start = None  # another world size breaks the series
        elif fields[3] == "Starting job" and start is None:
            start = datetime.strptime(fields[0], _TIME_FORMAT).timestamp()
            flops_at_start = latest_flops
    return start, flops_at_start


def log_saved_checkpoint(save_dir: str, iteration: int, consumed_tokens: int, flops_so_far: float,
                         flops_at_job_start: float, job_start: float, world_size: int) -> None:
    """Append the throughput line for a checkpoint just saved (TFLOP/s per GPU)."""
    now = time.time()
    series_start, flops_at_series_start = get_start_time_from_progress_log(save_dir, world_size)
    job_tflops = (flops_so_far - flops_at_job_start) / max(now - job_start, 1e-9) / world_size / 1e12
    cumulative_tflops = ((flops_so_far - flops_at_series_start) / max(now - (series_start or job_start), 1e-9)
                         / world_size / 1e12)
    append_to_progress_log(save_dir, "\t".join([
        "Saved checkpoint", f"Iteration: {iteration}", f"Job throughput: {job_tflops:.3g} TFLOP/s/GPU",
        f"Cumulative throughput: {cumulative_tflops:.3g} TFLOP/s/GPU", f"Floating-point operations: {flops_so_far:.2e}",
        f"Tokens (in billions): {consumed_tokens / 1e9:.2f}"]), world_size, barrier=False)
