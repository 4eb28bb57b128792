"""ConfigContainer: every section of one run, its derived values, and its cross-field checks.

Mirrors Megatron-Bridge's ``bridge.training.config``. The section dataclasses live in
``bridge_cli.config`` (importable without torch); model, optimizer and ddp are megatron-core's own
config objects. ``validate()`` raises ConfigError naming the key and the fix, never an assert.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, Optional, Union

from megatron.core.distributed import DistributedDataParallelConfig

from bridge_cli.config import mcore_schema
from bridge_cli.config.checkpoint_config import CheckpointConfig
from bridge_cli.config.comm_overlap_config import CommOverlapConfig
from bridge_cli.config.data_configs import (
    DataloaderConfig,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    MockGPTDatasetConfig,
    TokenizerConfig,
)
from bridge_cli.config.errors import ConfigError
from bridge_cli.config.finetune_config import DistillConfig, DPOConfig, FinetuneConfig
from bridge_cli.config.logger_config import LoggerConfig
from bridge_cli.config.loop_configs import SchedulerConfig, TrainingConfig
from bridge_cli.config.peft_config import LoRAConfig
from bridge_cli.config.runtime_configs import (
    DistributedInitConfig,
    FaultToleranceConfig,
    NVRxStragglerDetectionConfig,
    ProfilingConfig,
    RerunStateMachineConfig,
    RNGConfig,
    StragglerDetectionConfig,
)
from bridge_cli.config.schema import mcore_sections
from bridge_cli.models.provider import GPTModelProvider
from bridge_cli.runtime.optimizer_config import OptimizerConfig
from bridge_cli.training.validation import Derived, data_parallel_size, validate_and_derive

__all__ = [
    "CheckpointConfig", "CommOverlapConfig", "ConfigContainer", "DataloaderConfig", "DistributedInitConfig",
    "DistillConfig", "DPOConfig", "FaultToleranceConfig", "FinetuneConfig", "FinetuningDatasetConfig",
    "GPTDatasetConfig", "LoggerConfig", "LoRAConfig", "MockGPTDatasetConfig", "NVRxStragglerDetectionConfig",
    "ProfilingConfig",
    "RerunStateMachineConfig", "RNGConfig", "SchedulerConfig", "StragglerDetectionConfig",
    "TokenizerConfig", "TrainingConfig",
]

_MCORE = mcore_sections()
"""The sections whose schema is megatron-core's config classes (the schema's list: bridge_cli/config/schema.py)."""


@dataclass
class ConfigContainer:
    """Top-level container holding all configuration objects of one run."""

    train: TrainingConfig
    model: GPTModelProvider
    optimizer: OptimizerConfig
    scheduler: SchedulerConfig
    dataset: Union[GPTDatasetConfig, FinetuningDatasetConfig]
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    rng: RNGConfig = field(default_factory=RNGConfig)
    rerun_state_machine: RerunStateMachineConfig = field(default_factory=RerunStateMachineConfig)
    ddp: DistributedDataParallelConfig = field(default_factory=DistributedDataParallelConfig)
    dist: DistributedInitConfig = field(default_factory=DistributedInitConfig)
    ft: Optional[FaultToleranceConfig] = None
    straggler: Optional[StragglerDetectionConfig] = None
    nvrx_straggler: Optional[NVRxStragglerDetectionConfig] = None
    profiling: Optional[ProfilingConfig] = None
    peft: Optional[LoRAConfig] = None
    mixed_precision: Optional[str] = None
    comm_overlap: Optional[CommOverlapConfig] = None
    finetune: FinetuneConfig = field(default_factory=FinetuneConfig)
    dpo: DPOConfig = field(default_factory=DPOConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)

    derived: Optional[Derived] = field(default=None, init=False, repr=False)
    """Set by validate(): the values this run derives from the config (the config itself is never written)."""

    @classmethod
    def from_yaml_dict(cls, values: dict) -> "ConfigContainer":
        """Build from a composed, resolved YAML config (what `bridge_cli.config.compose` returns)."""
        from omegaconf import OmegaConf

        from bridge_cli.config.schema import SECTIONS

        sections = {name: OmegaConf.to_object(values[name]) for name in SECTIONS}
        sections["dataset"] = OmegaConf.to_object(values["dataset"])
        sections["peft"] = OmegaConf.to_object(values["peft"]) if values.get("peft") is not None else None
        if values["model"]["bf16"] and values["model"]["fp16"]:
            raise ConfigError("model.bf16", "model.bf16 and model.fp16 are mutually exclusive.",
                              "Pick one precision, e.g. mixed_precision=bf16_mixed.")
        for name, mcore_cls in _MCORE.items():
            sections[name] = mcore_schema.build(name, mcore_cls, OmegaConf.to_container(values[name], resolve=True))
        return cls(**sections, mixed_precision=values.get("mixed_precision"))

    def to_dict(self) -> dict[str, Any]:
        """Every section as plain YAML-able values (dtypes and functions by name)."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if not f.init:
                continue
            if f.name in _MCORE:
                out[f.name] = mcore_schema.to_yaml_values(f.name, _MCORE[f.name], value)
            elif dataclasses.is_dataclass(value):
                out[f.name] = dataclasses.asdict(value)
            else:
                out[f.name] = value
        return out

    def run_record(self) -> dict[str, Any]:
        """What a checkpoint's run_config.yaml holds: the config, its model section as the run built it
        (the tokenizer's vocabulary), and the derived values."""
        return {**self.to_dict(), "model": mcore_schema.to_yaml_values("model", GPTModelProvider, self.derived.model),
                "derived": self.derived.as_dict()}

    @property
    def world_size(self) -> Optional[int]:
        """The number of processes validate() checked the run for."""
        return self.derived.world_size if self.derived else None

    @property
    def data_parallel_size(self) -> Optional[int]:
        """world size / (TP x PP x CP), once validated."""
        return self.derived.data_parallel_size if self.derived else None

    @property
    def num_microbatches(self) -> Optional[int]:
        """global batch / (micro batch x data-parallel size), once validated."""
        return self.derived.num_microbatches if self.derived else None

    def get_data_parallel_size(self, world_size: int) -> int:
        """world_size / (TP x PP x CP); raises ConfigError when the sizes do not divide it."""
        return data_parallel_size(self.model, world_size)

    def validate(self, world_size: Optional[int] = None, device: Optional[str] = None) -> Derived:
        """Check every section for ``world_size`` processes on ``device`` and derive the run's values.

        ``world_size`` defaults to $WORLD_SIZE (torchrun), else 1; ``device`` to cuda when a GPU is
        visible, else cpu. A second call for the same values, world size and device reuses the first's checks.
        See :mod:`bridge_cli.training.validation`.
        """
        from bridge_cli.runtime.device_rules import default_device

        self.derived = validate_and_derive(self, world_size or int(os.environ.get("WORLD_SIZE", "1")),
                                           device or default_device(), previous=self.derived)
        return self.derived
