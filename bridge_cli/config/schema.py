"""The root YAML schema: one section per config dataclass, registered with Hydra's ConfigStore."""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

from bridge_cli.config.checkpoint_config import CheckpointConfig
from bridge_cli.config.comm_overlap_config import CommOverlapConfig
from bridge_cli.config.data_configs import (
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    MockGPTDatasetConfig,
    TokenizerConfig,
)
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

SECTIONS: dict[str, type] = {
    "rng": RNGConfig,
    "rerun_state_machine": RerunStateMachineConfig,
    "train": TrainingConfig,
    "scheduler": SchedulerConfig,
    "tokenizer": TokenizerConfig,
    "checkpoint": CheckpointConfig,
    "logger": LoggerConfig,
    "dist": DistributedInitConfig,
    "ft": FaultToleranceConfig,
    "straggler": StragglerDetectionConfig,
    "nvrx_straggler": NVRxStragglerDetectionConfig,
    "profiling": ProfilingConfig,
    "comm_overlap": CommOverlapConfig,
    "finetune": FinetuneConfig,
    "dpo": DPOConfig,
    "distill": DistillConfig,
}
"""Sections whose schema is a dataclass of this project."""

DATASETS: dict[str, type] = {
    "mock": MockGPTDatasetConfig,
    "gpt": GPTDatasetConfig,
    "finetune": FinetuningDatasetConfig,
}
"""The dataset section takes one of these schemas, picked by the dataset group option."""

PEFT: dict[str, type] = {"lora": LoRAConfig}
"""The optional peft section (default null): `peft=lora` picks LoRA."""


def mcore_sections() -> dict[str, type]:
    """Sections whose schema is read from megatron-core's config classes (imports torch)."""
    from megatron.core.distributed import DistributedDataParallelConfig

    from bridge_cli.models.provider import GPTModelProvider
    from bridge_cli.runtime.optimizer_config import OptimizerConfig

    return {"model": GPTModelProvider, "optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig}


@functools.lru_cache(maxsize=None)
def root_schema() -> type:
    """The whole config's schema as one dataclass."""
    from bridge_cli.config.mcore_schema import schema_dataclass

    sections = {**SECTIONS, **{name: schema_dataclass(cls) for name, cls in mcore_sections().items()}}
    specs: list[tuple[str, Any, Any]] = [
        (name, cls, dataclasses.field(default_factory=cls)) for name, cls in sections.items()
    ]
    specs.append(("dataset", Any, None))
    specs.append(("peft", Any, None))
    specs.append(("mixed_precision", Optional[str], None))
    return dataclasses.make_dataclass("BridgeConfig", specs)


def root_fields() -> set[str]:
    return {f.name for f in dataclasses.fields(root_schema())}


@functools.cache
def register() -> None:
    """Put the schemas where conf/config.yaml and conf/dataset/*.yaml expect them (once a process: Hydra copies
    what it loads)."""
    from hydra.core.config_store import ConfigStore

    store = ConfigStore.instance()
    store.store(name="bridge_schema", node=root_schema())
    for name, cls in DATASETS.items():
        store.store(group="schema/dataset", name=name, node=cls)
    for name, cls in PEFT.items():
        store.store(group="schema/peft", name=name, node=cls)


RENAMED: dict[str, str] = {
    "optimizer.use_torch_fused_adam": "optimizer.adam_kernel (true was fused, false foreach; the default is triton)",
}
"""A key earlier versions of bridge took -> what took its place, for the unknown-key error."""


def all_keys() -> list[str]:
    """Every settable full key, for did-you-mean suggestions."""
    keys = [f"{section}.{f.name}" for section, cls in SECTIONS.items() for f in dataclasses.fields(cls)]
    keys += [f"dataset.{f.name}" for cls in DATASETS.values() for f in dataclasses.fields(cls)]
    keys += [f"peft.{f.name}" for cls in PEFT.values() for f in dataclasses.fields(cls)]
    from bridge_cli.config.mcore_schema import schema_fields

    keys += [f"{section}.{f.name}" for section, cls in mcore_sections().items() for f in schema_fields(cls)]
    return sorted(set(keys))
