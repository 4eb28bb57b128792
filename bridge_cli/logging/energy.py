"""GPU energy from NVML's total-energy counter, summed over ranks between log intervals.

NVML is reached through the driver's ``libnvidia-ml.so.1`` with ctypes, so no extra package is
needed on a GPU machine. Energy spent in validation and checkpointing counts into its interval.
"""

from __future__ import annotations

import ctypes
import time

import torch
import torch.distributed as dist

from bridge_cli.runtime.errors import RuntimeUnavailable


class _Nvml:
    """The two NVML calls needed: a device handle by UUID and its energy counter in millijoules."""

    def __init__(self):
        try:
            self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError as err:
            raise RuntimeUnavailable("logger.log_energy=true needs NVIDIA's NVML library (libnvidia-ml.so.1), "
                                     "which is not on this machine. Unset logger.log_energy.") from err
        self._check(self.lib.nvmlInit_v2(), "nvmlInit")

    def _check(self, status: int, call: str) -> None:
        if status != 0:
            raise RuntimeUnavailable(f"logger.log_energy=true: NVML {call} failed with status {status}; this GPU or "
                                     "driver may not report energy. Unset logger.log_energy.")

    def energy_mj(self, uuid: str) -> int:
        handle = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)), "device lookup")
        energy = ctypes.c_ulonglong()
        self._check(self.lib.nvmlDeviceGetTotalEnergyConsumption(handle, ctypes.byref(energy)), "energy counter")
        return energy.value


class EnergyMonitor:
    """Joules used by all GPUs of the run since the previous ``lap()``, and the time it took."""

    def __init__(self, device: torch.device):
        if device.type != "cuda":
            raise RuntimeUnavailable("logger.log_energy=true reads NVIDIA GPU energy counters and is GPU-only; "
                                     "unset it on the CPU.")
        self.device = device
        self.uuid = f"GPU-{torch.cuda.get_device_properties(device).uuid}"
        self.nvml = _Nvml()
        self.last_mj, self.last_time = self.nvml.energy_mj(self.uuid), time.time()

    def lap(self) -> tuple[float, float]:
        """(joules over every rank's GPU, seconds) since the last lap. A collective over all ranks."""
        now_mj, now = self.nvml.energy_mj(self.uuid), time.time()
        joules = torch.tensor([(now_mj - self.last_mj) / 1000.0], dtype=torch.float64, device=self.device)
        dist.all_reduce(joules)
        elapsed = now - self.last_time
        self.last_mj, self.last_time = now_mj, now
        return float(joules.item()), elapsed
