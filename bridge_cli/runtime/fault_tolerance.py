"""Fault tolerance through NVIDIA Resiliency Extension (the ``ft`` section): hang detection and in-job restarts.

ft_launcher (the package's torchrun) starts a rank monitor beside each rank; the rank tells its monitor when
it enters and leaves three sections: ``setup`` (start-up, checkpoint load and the first step, which warms
up), ``step`` (each later training step and each evaluation batch) and ``checkpointing`` (each save). A
section open longer than its timeout, or time outside every section longer than the out-of-section timeout,
is a hang: the monitor kills the rank and the launcher restarts every worker (``--max-restarts``), which
resume from the last checkpoint. A killed rank is seen by the launcher directly. The rank also sends a
heartbeat as each section ends, for the launcher's heartbeat timeouts, which bridge leaves as they are.
Monitoring ends with the last training step: the final evaluation and a Hugging Face export are not watched.

With ``ft.calc_ft_timeouts`` the section timeouts are computed from the run's own timings (the longest time
seen on any rank, times ft_launcher's safety factor), once per start: ``step`` once 16 steps were timed,
``checkpointing`` after a save, ``setup`` in a run that loaded a checkpoint (a value kept from an earlier
start is averaged with the new one). They are sent to the monitors at once and written
to ``<checkpoint.save>/ft_state.json``, which a restarted or later run loads: the timeouts are kept with the
checkpoint, as Megatron-Bridge keeps them. The out-of-section timeout stays ft_launcher's: outside the
sections a bridge run spends milliseconds between steps, and a timeout computed from those would kill a rank
at its first pause (a garbage collection, a slow log write).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Iterator, Optional

from bridge_cli.config.errors import ConfigError
from bridge_cli.runtime.errors import RuntimeUnavailable

SECTIONS = ("setup", "step", "checkpointing")
STATE_FILE = "ft_state.json"
MIN_STEPS_FOR_STEP_TIMEOUT = 16
"""Step sections timed before the step timeout is computed (Megatron-Bridge's figure)."""
LAUNCHER_SECTIONS = ("--ft-rank-section-timeouts=setup:600,step:180,checkpointing:420 "
                     "--ft-rank-out-of-section-timeout=300")
"""ft_launcher's flags that declare bridge's sections, with starting timeouts (seconds) for a first run."""


class FaultToleranceOff:
    """What the training loop calls when ``ft.enable_ft_package`` is off: nothing happens."""

    def checkpoint_loaded(self) -> None:
        """A checkpoint was loaded during setup (the setup section's time now includes a load)."""

    def step_started(self) -> None:
        """A training step begins."""

    def step_ended(self) -> None:
        """A training step ended."""

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Time the block as section ``name`` ('step' for an evaluation batch, 'checkpointing' for a save)."""
        yield

    def training_ended(self) -> None:
        """Training ended cleanly (not by an exception): compute what timeouts the run can now compute."""

    def close(self) -> None:
        """Disconnect from the rank monitor (the run is over, however it ended)."""


class FaultTolerance(FaultToleranceOff):
    """This rank's client of its ft_launcher rank monitor (nvidia_resiliency_ext's RankMonitorClient)."""

    def __init__(self, ft_cfg, save_dir: Optional[str], rank: int, world_size: int) -> None:
        from nvidia_resiliency_ext.fault_tolerance import RankMonitorClient

        self.cfg, self.rank, self.world_size = ft_cfg, rank, world_size
        self.state_path = Path(save_dir) / STATE_FILE if save_dir else None
        self.client = RankMonitorClient()
        self.client.init_workload_monitoring()
        self._check_launcher_sections()
        if ft_cfg.calc_ft_timeouts and self.state_path is not None and self.state_path.is_file():
            self.client.load_state_dict(json.loads(self.state_path.read_text()))
            _say(f"fault tolerance: timeouts from {self.state_path}: {self.describe_timeouts()}")
        else:
            _say(f"fault tolerance: ft_launcher's timeouts: {self.describe_timeouts()}")
        self.open: set[str] = set()
        self.steps_timed = 0
        self.saves = 0
        self.loaded = False
        self.closed = False
        self.computed: set[str] = set()
        self.fault = SimulatedFault.plan(ft_cfg, rank, world_size) if ft_cfg.simulate_fault else None
        self._open("setup")

    def _check_launcher_sections(self) -> None:
        missing = [name for name in SECTIONS if name not in self.client.cfg.rank_section_timeouts]
        if missing:
            self.client.shutdown_workload_monitoring()
            raise RuntimeUnavailable(
                f"ft.enable_ft_package=true: ft_launcher was started without bridge's "
                f"section{'s' * (len(missing) > 1)} {', '.join(missing)}. Start it with {LAUNCHER_SECTIONS} "
                "(seconds; docs/resilience.md).")

    def describe_timeouts(self) -> str:
        """The timeouts in force, e.g. 'setup 600 s, step 1.52 s (computed), ..., out of section 300 s'."""
        st = self.client.section_timeouts

        def one(name: str, value: Optional[float], computed: bool) -> str:
            text = "none" if value is None else f"{value:.2f} s"
            return f"{name} {text}{' (computed)' if computed else ''}"

        parts = [one(name, st.section.get(name), name in st.calculated_sections) for name in SECTIONS]
        parts.append(one("out of section", st.out_of_section, st.is_out_of_section_calculated))
        return ", ".join(parts)

    def _open(self, name: str) -> None:
        self.client.start_section(name)
        self.open.add(name)

    def _close(self, name: str) -> None:
        if name in self.open:
            self.client.end_section(name)
            self.open.discard(name)
            # ft_launcher also watches heartbeats (its --ft-*-heartbeat-timeout, 60 and 45 min by default): one
            # at each section's end keeps a healthy rank from being killed by them
            self.client.send_heartbeat()

    def checkpoint_loaded(self) -> None:
        self.loaded = True

    def step_started(self) -> None:
        if "setup" not in self.open:
            self._open("step")
        if self.fault is not None:
            self.fault.arm()
            self.fault = None

    def step_ended(self) -> None:
        if "setup" in self.open:  # the first step warms up: it belongs to start-up
            self._close("setup")
        else:
            self._close("step")
            self.steps_timed += 1

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        nested = self.closed or name in self.open or (name == "step" and "setup" in self.open)
        if not nested:
            self._open(name)
        try:
            yield
        finally:
            if not nested:
                self._close(name)
        if name == "checkpointing" and not nested:
            self.saves += 1
            self._update_timeouts()

    def training_ended(self) -> None:
        self._close("setup")  # a run that trained no step
        self._update_timeouts()
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.client.shutdown_workload_monitoring()
            self.closed = True

    def _update_timeouts(self) -> None:
        """Compute the timeouts this run has seen enough of, on every rank at the same point (a collective)."""
        if not self.cfg.calc_ft_timeouts:
            return
        due = [name for name, seen in (("setup", self.loaded), ("step", self.steps_timed >= MIN_STEPS_FOR_STEP_TIMEOUT),
                                       ("checkpointing", self.saves > 0)) if seen and name not in self.computed]
        if not due:
            return
        self.computed.update(due)  # once per start; a timeout kept from an earlier one is averaged with it
        self.client.calculate_and_set_section_timeouts(selected_sections=due, calc_out_of_section=False)
        if self.rank == 0:
            partial = self.state_path.with_suffix(".json.partial")
            partial.write_text(json.dumps(self.client.state_dict()))
            partial.replace(self.state_path)
        _say(f"fault tolerance: timeouts computed ({', '.join(due)}), kept in {self.state_path}: "
             f"{self.describe_timeouts()}")


class SimulatedFault:
    """``ft.simulate_fault``: this rank hangs (SIGSTOP) or dies (SIGKILL) a set time after training starts."""

    def __init__(self, kind: str, delay: float, rank: int) -> None:
        self.kind, self.delay, self.rank = kind, delay, rank

    @classmethod
    def plan(cls, ft_cfg, rank: int, world_size: int) -> Optional["SimulatedFault"]:
        """The fault this rank will simulate, or None: none on other ranks, nor after a launcher restart (so the
        restarted run can finish). Every rank takes part (a random target rank is rank 0's pick)."""
        rng = random.Random()  # not the seeded global one: the training's random streams stay as they were
        target = ft_cfg.simulated_fault_rank
        if target is not None and target >= world_size:
            raise ConfigError("ft.simulated_fault_rank", f"is {target}, and this run has ranks 0 to {world_size - 1}.",
                              "Pick one of them, or leave it null for a random rank.")
        if target is None:
            target = _rank0_choice(rng.randrange(world_size))
        if rank != target or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
            return None
        kind = ft_cfg.simulated_fault_type
        if kind == "random":
            kind = rng.choice(("rank_hung", "rank_killed"))
        return cls(kind, ft_cfg.simulated_fault_base_delay + rng.random(), rank)

    def arm(self) -> None:
        threading.Thread(target=self._strike, name="simulated-fault", daemon=True).start()

    def _strike(self) -> None:
        time.sleep(self.delay)
        what = "hangs (SIGSTOP)" if self.kind == "rank_hung" else "is killed (SIGKILL)"
        print(f"fault tolerance: simulated fault ({self.kind}): rank {self.rank} {what} at {time.time():.3f}, "
              f"{self.delay:.2f} s after training started", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGSTOP if self.kind == "rank_hung" else signal.SIGKILL)


def _rank0_choice(value: int) -> int:
    import torch
    import torch.distributed as dist

    box = [value]
    dist.broadcast_object_list(box, src=0, device=torch.device("cuda") if dist.get_backend() == "nccl" else None)
    return box[0]


def start_fault_tolerance(ft_cfg, checkpoint_cfg, rank: int, world_size: int) -> FaultToleranceOff:
    """The run's fault-tolerance client: connected to ft_launcher's rank monitor with ``ft.enable_ft_package``,
    else one that does nothing."""
    if ft_cfg is None or not ft_cfg.enable_ft_package:
        return FaultToleranceOff()
    from nvidia_resiliency_ext.fault_tolerance.data import FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR

    if FT_RANK_MONITOR_IPC_SOCKET_ENV_VAR not in os.environ:
        raise RuntimeUnavailable(
            "ft.enable_ft_package=true needs the run started by ft_launcher (nvidia-resiliency-ext's torchrun), "
            f"which starts a rank monitor beside each rank: ft_launcher {LAUNCHER_SECTIONS} --max-restarts=3 "
            "--nproc-per-node=N -m bridge_cli pretrain ... (docs/resilience.md). Or set ft.enable_ft_package=false.")
    if ft_cfg.calc_ft_timeouts and not checkpoint_cfg.save:
        raise ConfigError("ft.calc_ft_timeouts", "keeps the computed timeouts in checkpoint.save, which is unset.",
                          "Set checkpoint.save (a restart resumes from there too).")
    return FaultTolerance(ft_cfg, checkpoint_cfg.save, rank, world_size)


def _say(line: str) -> None:
    from bridge_cli.runtime.collectives import is_last_rank

    if is_last_rank():
        print(line, flush=True)
