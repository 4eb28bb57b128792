"""Straggler detection (``straggler.*``): megatron-core's StragglerDetector, as Megatron-LM runs it.

The detector times each micro-batch's forward pass with CUDA events and the host clock, and the
batch loading with the host clock (``gpt_step.forward_step`` opens its timing contexts). Every
``logger.log_interval`` iterations each rank turns its share of the model FLOPs and its measured
time into an estimated throughput, and rank 0 logs the slowest and fastest ranks: throughput
(``MnEtpt``/``MxEtpt``, TFLOP/s and rank), GPU time, batch time, power, temperature, utilization
and clock (``straggler_minmax_count`` > 1 lists that many at each end). A request to
``straggler_ctrlr_port`` on rank 0 toggles the timing at the next report. CUDA only: the
validation pass refuses it on the CPU (``runtime.device_rules``); the GPU readings need nvidia-ml-py.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.distributed as dist

from bridge_cli.logging.python_logging import show_info_records
from bridge_cli.runtime.errors import RuntimeUnavailable

FORWARD_ONLY_AMPLIFICATION = 3.0
"""Forward plus backward FLOPs over the forward's: the detector times the forward passes only."""


def start_straggler_detector(cfg) -> Optional[Any]:
    """megatron-core's StragglerDetector configured from ``cfg`` (the straggler section) on every rank, or
    None without ``log_straggler``. Its report goes to megatron-core's ``megatron.core.utils`` logger."""
    if cfg is None or not cfg.log_straggler:
        return None
    import importlib.util

    from megatron.core.utils import StragglerDetector

    if importlib.util.find_spec("pynvml") is None:
        raise RuntimeUnavailable(
            "straggler.log_straggler=true: megatron-core's StragglerDetector reads each GPU's power, temperature, "
            "utilization and clock through torch.cuda, which needs the nvidia-ml-py package, not installed here. "
            "Run `pip install nvidia-ml-py`, or unset straggler.log_straggler.")

    detector = StragglerDetector()
    detector.configure(dist.get_world_size(), dist.get_rank(), mmcnt=cfg.straggler_minmax_count,
                       amp=FORWARD_ONLY_AMPLIFICATION, port=cfg.straggler_ctrlr_port,
                       enabled=cfg.enable_straggler_on_startup and not cfg.disable_straggler_on_startup)
    show_info_records("megatron.core.utils")
    return detector


class StragglerReport:
    """Reports ``detector``'s measurements every ``log_interval`` iterations (on every rank: it gathers)."""

    def __init__(self, detector, log_interval: int):
        self.detector, self.log_interval = detector, log_interval
        self.flops = 0.0
        """Model FLOPs of the iterations since the last report (every rank's, as Megatron-LM counts them)."""

    def after_step(self, step: int, flops: float) -> None:
        self.flops += flops
        if step % self.log_interval == 0:
            self.detector.report(self.flops, self.log_interval)
            self.flops = 0.0
