"""Where a run's start-up goes: the time from process launch to the first step, phase by phase."""

from __future__ import annotations

import os
import time

_LOADED = time.time()


def launched_at() -> float:
    """Wall-clock time this process started: from /proc on Linux, else when this module was imported."""
    try:
        with open("/proc/self/stat") as stat, open("/proc/uptime") as uptime:
            start_ticks = int(stat.read().rsplit(")", 1)[1].split()[19])  # field 22, starttime
            booted = time.time() - float(uptime.read().split()[0])
        return booted + start_ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _LOADED


class StartupClock:
    """Laps from process launch; ``summary()`` is the log line (``start-up 7.9 s: ...``)."""

    def __init__(self) -> None:
        self.started = self.last = launched_at()
        self.phases: list[tuple[str, float]] = []

    def lap(self, phase: str) -> None:
        now = time.time()
        self.phases.append((phase, now - self.last))
        self.last = now

    def summary(self) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f} s" for phase, seconds in self.phases)
        return f"start-up {self.last - self.started:.1f} s: {parts}"
