"""OptimizerConfig: megatron-core's optimizer settings plus how bridge runs torch's Adam."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig


@dataclass
class OptimizerConfig(MegatronOptimizerConfig):
    """Every megatron-core OptimizerConfig field, plus the choice of Adam kernel."""

    adam_kernel: Literal["triton", "fused", "foreach"] = "triton"
    """On CUDA, where megatron-core falls back to torch's Adam (no Transformer Engine / Apex), what steps it: triton (bridge's kernel, which also writes the bf16 model weights, so megatron-core's copy after the step is skipped), fused (torch's fused kernel) or foreach (torch's foreach kernels, megatron-core's choice). The CPU always runs torch's."""
