"""profiling.*: PyTorch profiler traces, nsys capture ranges and CUDA memory snapshots for a step window."""

from __future__ import annotations

from typing import Optional

import torch

from bridge_cli.config.runtime_configs import ProfilingConfig
from bridge_cli.training import kernel_breakdown

DEFAULT_TRACE_DIR = "torch_profile"


class StepProfiler:
    """Profiles iterations ``profile_step_start..profile_step_end`` (inclusive) on ``profile_ranks``.

    PyTorch traces go to ``trace_dir`` (the TensorBoard folder), or ``./torch_profile`` without one; on CUDA the
    log also gets the window's GPU time by kernel kind (``kernel_breakdown``)."""

    def __init__(self, cfg: Optional[ProfilingConfig], rank: int, is_cuda: bool, trace_dir: Optional[str]):
        self.cfg = cfg
        self.is_cuda = is_cuda
        self.profiled_steps = 0  # a run that ends inside the window profiles fewer than the window's
        self.trace_dir = trace_dir or DEFAULT_TRACE_DIR
        self.active = bool(cfg) and rank in cfg.profile_ranks and (
            cfg.use_pytorch_profiler or cfg.use_nsys_profiler or cfg.record_memory_history)
        self.torch_profiler = None
        if not self.active:
            return
        if cfg.use_pytorch_profiler:
            from torch.profiler import ProfilerActivity, profile, tensorboard_trace_handler

            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if is_cuda else [])
            self.torch_profiler = profile(activities=activities, record_shapes=cfg.record_shapes,
                                          on_trace_ready=tensorboard_trace_handler(self.trace_dir))
        if cfg.record_memory_history:
            torch.cuda.memory._record_memory_history()

    def before_step(self, iteration: int) -> None:
        """Call with the iteration about to run (1-based)."""
        if not self.active:
            return
        if iteration == self.cfg.profile_step_start:
            if self.torch_profiler is not None:
                self.torch_profiler.start()
            if self.cfg.use_nsys_profiler:
                torch.cuda.cudart().cudaProfilerStart()
        if self.cfg.use_nsys_profiler and self._in_window(iteration):
            torch.cuda.nvtx.range_push(f"iteration {iteration}")

    def after_step(self, iteration: int) -> None:
        if not self.active:
            return
        if self.cfg.use_nsys_profiler and self._in_window(iteration):
            torch.cuda.nvtx.range_pop()
        if self.torch_profiler is not None and self._in_window(iteration):
            self.torch_profiler.step()
            self.profiled_steps += 1
        if iteration == self.cfg.profile_step_end:
            self.close()

    def close(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.torch_profiler is not None:
            self.torch_profiler.stop()
            window = f"iterations {self.cfg.profile_step_start}..{self.cfg.profile_step_end}"
            print(f"PyTorch profiler trace of {window} written to {self.trace_dir}", flush=True)
            if self.is_cuda and self.profiled_steps:
                kernels = kernel_breakdown.from_profiler(self.torch_profiler)
                shares = kernel_breakdown.breakdown(kernels, self.profiled_steps)
                print(kernel_breakdown.table(shares, f"GPU time of {window}, per iteration, by kernel kind:"),
                      flush=True)
        if self.cfg.use_nsys_profiler:
            torch.cuda.cudart().cudaProfilerStop()
        if self.cfg.record_memory_history:
            torch.cuda.memory._dump_snapshot(self.cfg.memory_snapshot_path)
            torch.cuda.memory._record_memory_history(enabled=None)

    def _in_window(self, iteration: int) -> bool:
        return self.cfg.profile_step_start <= iteration <= self.cfg.profile_step_end
