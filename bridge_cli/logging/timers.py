"""Step timers: megatron-core's ``Timers`` at ``logger.timing_log_level``, reported every log interval.

Level 1 times what runs once per step (``forward-backward``, ``optimizer``, the gradient
all-reduce megatron-core times itself); level 2 adds what runs per micro-batch (forward and
backward compute, pipeline sends and receives, ``batch-generator``). Level 0 creates none:
the log line's ms/iter is the only timing, at no cost.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

from bridge_cli.config.logger_config import LoggerConfig

TIMER_NAMES = (
    "forward-backward", "forward-compute", "backward-compute", "batch-generator",
    "forward-recv", "forward-send", "backward-recv", "backward-send",
    "forward-send-forward-recv", "forward-send-backward-recv",
    "backward-send-forward-recv", "backward-send-backward-recv",
    "forward-backward-send-forward-backward-recv",
    "layernorm-grads-all-reduce", "embedding-grads-all-reduce", "all-grads-sync", "params-all-gather",
    "optimizer-copy-to-main-grad", "optimizer-unscale-and-check-inf", "optimizer-clip-main-grad",
    "optimizer-count-zeros", "optimizer-inner-step", "optimizer-copy-main-to-model-params", "optimizer",
)
"""What Megatron-LM reports, in its order; timers that never ran are left out of the report."""


def build_timers(cfg: LoggerConfig):
    """megatron-core Timers for this run, or None at level 0."""
    if cfg.timing_log_level == 0:
        return None
    from megatron.core.timers import Timers

    return Timers(cfg.timing_log_level, cfg.timing_log_option)


def interval_report(timers, interval: int) -> tuple[Optional[str], dict[str, float]]:
    """The timers' console block (per the log option) and each timer's max over ranks in seconds
    (``<name>-time``), both averaged per iteration over the last ``interval``; resets the timers.

    A collective: every rank must call it at the same step.
    """
    names = [name for name in TIMER_NAMES if name in timers._timers]
    # Read the maxima without resetting, then let megatron-core format (and reset) the same numbers.
    extremes = timers._get_global_min_max_time(names, reset=False, barrier=False, normalizer=interval)
    scalars = {f"{name}-time": high for name, (_, high) in extremes.items()}
    return timers.get_all_timers_string(names, normalizer=interval, reset=True), scalars


@contextlib.contextmanager
def timed(timers, name: str, log_level: int, barrier: bool = False) -> Iterator[None]:
    """Time the block under ``name`` when ``timers`` exists and its level covers ``log_level``."""
    if timers is None:
        yield
        return
    timer = timers(name, log_level=log_level)
    timer.start(barrier=barrier)
    try:
        yield
    finally:
        timer.stop()
