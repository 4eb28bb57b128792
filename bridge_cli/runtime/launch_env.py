"""Which launcher started this process and its rank on its node, read from the environment alone (no torch import:
the CLI's error path reads it too)."""

from __future__ import annotations

import os
from typing import Mapping, Optional

RANK_VARIABLE = {"torchrun": "RANK", "srun": "SLURM_PROCID"}
LOCAL_RANK_VARIABLE = {"torchrun": "LOCAL_RANK", "srun": "SLURM_LOCALID"}


def launcher(env: Mapping[str, str] = os.environ) -> Optional[str]:
    """``torchrun`` (or any launcher that sets RANK and WORLD_SIZE, ft_launcher included), ``srun`` (Slurm's
    SLURM_PROCID and SLURM_NTASKS), or None for a process started on its own."""
    if "RANK" in env and "WORLD_SIZE" in env:
        return "torchrun"
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return "srun"
    return None


def local_rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's rank on its node, as its launcher set it (0 without one)."""
    kind = launcher(env)
    return int(env.get(LOCAL_RANK_VARIABLE[kind], 0)) if kind else 0


def rank(env: Mapping[str, str] = os.environ) -> int:
    """This process's rank in the job, as its launcher set it (0 without one)."""
    kind = launcher(env)
    return int(env[RANK_VARIABLE[kind]]) if kind else 0
