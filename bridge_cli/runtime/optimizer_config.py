"""OptimizerConfig: megatron-core's optimizer settings plus how bridge runs torch's Adam."""

from __future__ import annotations

from dataclasses import dataclass

from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig


@dataclass
class OptimizerConfig(MegatronOptimizerConfig):
    """Every megatron-core OptimizerConfig field, plus the choice of torch Adam kernel."""

    use_torch_fused_adam: bool = True
    """Where megatron-core falls back to torch's Adam (no Transformer Engine / Apex) on CUDA, run it as one fused kernel (torch fused=True) instead of foreach."""
