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
from bridge_cli.config.data_configs import (
    DataloaderConfig,
    FinetuningDatasetConfig,
    GPTDatasetConfig,
    MockGPTDatasetConfig,
    TokenizerConfig,
)
from bridge_cli.config.errors import ConfigError
from bridge_cli.config.fields import check_section
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
from bridge_cli.models.moe_checks import check_moe
from bridge_cli.models.provider import GPTModelProvider
from bridge_cli.runtime.optimizer_config import OptimizerConfig

__all__ = [
    "CheckpointConfig", "ConfigContainer", "DataloaderConfig", "DistributedInitConfig",
    "FaultToleranceConfig", "FinetuningDatasetConfig", "GPTDatasetConfig", "LoggerConfig", "LoRAConfig",
    "MockGPTDatasetConfig", "NVRxStragglerDetectionConfig", "ProfilingConfig",
    "RerunStateMachineConfig", "RNGConfig", "SchedulerConfig", "StragglerDetectionConfig",
    "TokenizerConfig", "TrainingConfig",
]

_MCORE = {"model": GPTModelProvider, "optimizer": OptimizerConfig, "ddp": DistributedDataParallelConfig}


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

    world_size: Optional[int] = field(default=None, init=False)
    """Derived by validate(): the number of processes the run is checked for."""
    data_parallel_size: Optional[int] = field(default=None, init=False)
    """Derived by validate(): world size / (TP x PP x CP)."""
    num_microbatches: Optional[int] = field(default=None, init=False)
    """Derived by validate(): global batch / (micro batch x data-parallel size)."""

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
            if f.name in _MCORE:
                out[f.name] = mcore_schema.to_yaml_values(f.name, _MCORE[f.name], value)
            elif dataclasses.is_dataclass(value):
                out[f.name] = dataclasses.asdict(value)
            elif f.init:
                out[f.name] = value
        return out

    def derived(self) -> dict[str, Any]:
        """The values validate() computed, for --dry-run."""
        return {
            "world_size": self.world_size,
            "data_parallel_size": self.data_parallel_size,
            "micro_batches_per_step": self.num_microbatches,
            "global_batch_size": self.train.global_batch_size,
            "padded_vocab_size": self.model.padded_vocab_size,
            "scheduler_steps": {
                "lr_warmup_steps": self.scheduler.lr_warmup_steps,
                "lr_decay_steps": self.scheduler.lr_decay_steps,
                "wd_incr_steps": self.scheduler.wd_incr_steps,
                "wsd_decay_steps": self.scheduler.wsd_decay_steps,
            },
        }

    def get_data_parallel_size(self, world_size: int) -> int:
        """world_size / (TP x PP x CP); raises ConfigError when the sizes do not divide it."""
        m = self.model
        model_parallel = m.tensor_model_parallel_size * m.pipeline_model_parallel_size * m.context_parallel_size
        if world_size % model_parallel:
            raise ConfigError(
                "model.tensor_model_parallel_size",
                f"TP ({m.tensor_model_parallel_size}) x PP ({m.pipeline_model_parallel_size}) x "
                f"CP ({m.context_parallel_size}) = {model_parallel} does not divide the world size ({world_size}).",
                "Change the parallel sizes or the number of processes.",
            )
        return world_size // model_parallel

    def validate(self, world_size: Optional[int] = None) -> None:
        """Check every section and compute derived values, for ``world_size`` processes.

        ``world_size`` defaults to $WORLD_SIZE (torchrun), else 1.
        """
        self.world_size = world_size or int(os.environ.get("WORLD_SIZE", "1"))
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name not in _MCORE and dataclasses.is_dataclass(value):
                check_section(f.name, value)
        self._derive_vocab_size()
        self._check_required()
        self._check_precision()
        self.data_parallel_size = self.get_data_parallel_size(self.world_size)
        self._derive_batches()
        self._check_gradient_norm_logging()
        self._check_sequence_length()
        self._derive_scheduler_steps()
        check_moe(self.model, self.world_size)

    def _derive_vocab_size(self) -> None:
        """A tokenizer with its own vocabulary (all but the null one) sets model.vocab_size, as the
        tokenizer alone does in Megatron-LM; the model pads it (model.padded_vocab_size)."""
        tok, model = self.tokenizer, self.model
        if tok.make_vocab_size_divisible_by != model.make_vocab_size_divisible_by:
            raise ConfigError("tokenizer.make_vocab_size_divisible_by", f"{tok.make_vocab_size_divisible_by} differs "
                              f"from model.make_vocab_size_divisible_by ({model.make_vocab_size_divisible_by}), "
                              "which pads the embedding.", "Set model.make_vocab_size_divisible_by only.")
        if tok.vocab_extra_ids:
            raise ConfigError("tokenizer.vocab_extra_ids", "is not supported by bridge's tokenizers.", "Leave it at 0.")
        if tok.tokenizer_type != "NullTokenizer":
            from bridge_cli.data.tokenizers import build_tokenizer

            model.vocab_size = build_tokenizer(tok).vocab_size

    def _check_required(self) -> None:
        if not self.train.train_iters or self.train.train_iters < 1:
            raise ConfigError("train.train_iters", "is not set.", "Set train.train_iters=N (N >= 1).")
        if self.model.num_layers < 1 or self.model.hidden_size < 1 or self.model.num_attention_heads < 1:
            raise ConfigError("model", "num_layers, hidden_size and num_attention_heads must be set.",
                              "Pick a recipe (bridge recipes list) or set them.")
        if self.model.vocab_size is None:
            raise ConfigError("model.vocab_size", "is not set.", "Set model.vocab_size to the tokenizer's vocabulary size.")
        if self.optimizer.lr is None:
            raise ConfigError("optimizer.lr", "is not set.", "Set optimizer.lr, e.g. optimizer.lr=3e-4.")

    def _check_precision(self) -> None:
        for flag in ("bf16", "fp16"):
            if getattr(self.model, flag) != getattr(self.optimizer, flag):
                raise ConfigError(f"optimizer.{flag}", f"differs from model.{flag}.",
                                  f"Set both, or let optimizer.{flag} follow the model (the default).")
        if self.optimizer.use_distributed_optimizer != self.ddp.use_distributed_optimizer:
            raise ConfigError("ddp.use_distributed_optimizer", "differs from optimizer.use_distributed_optimizer.",
                              "Set both, or let ddp.use_distributed_optimizer follow the optimizer (the default).")

    def _check_gradient_norm_logging(self) -> None:
        if self.logger.log_l2_norm_grad_to_tensorboard and self.ddp.use_distributed_optimizer \
                and self.data_parallel_size > 1:
            raise ConfigError("logger.log_l2_norm_grad_to_tensorboard",
                              "needs whole gradients on every rank; the distributed optimizer keeps only a "
                              "data-parallel shard of them.",
                              "Unset it, or set optimizer.use_distributed_optimizer=false.")

    def _derive_batches(self) -> None:
        train, dp = self.train, self.data_parallel_size
        if train.micro_batch_size is None or train.micro_batch_size < 1:
            raise ConfigError("train.micro_batch_size", "must be >= 1.")
        per_step = train.micro_batch_size * dp
        if train.global_batch_size is None:
            train.global_batch_size = per_step
        if train.global_batch_size % per_step:
            raise ConfigError(
                "train.global_batch_size",
                f"{train.global_batch_size} is not a multiple of micro batch ({train.micro_batch_size}) "
                f"x data-parallel size ({dp}) = {per_step}.",
                f"Use a multiple of {per_step}, e.g. train.global_batch_size={max(per_step, train.global_batch_size // per_step * per_step)}.",
            )
        self.num_microbatches = train.global_batch_size // per_step
        if train.rampup_batch_size:
            if len(train.rampup_batch_size) != 3:
                raise ConfigError("train.rampup_batch_size", f"needs 3 numbers, got {train.rampup_batch_size}.",
                                  "Write [start batch, increment, ramp-up samples], e.g. [16,16,300000].")
            start, increment, _ = train.rampup_batch_size
            if start % per_step or increment % per_step:
                raise ConfigError("train.rampup_batch_size", f"start ({start}) and increment ({increment}) must be "
                                  f"multiples of micro batch x data-parallel size ({per_step}).")

    def _check_sequence_length(self) -> None:
        data_len, model_len = self.dataset.seq_length, self.model.seq_length
        if isinstance(self.dataset, FinetuningDatasetConfig):
            if data_len is not None and data_len > model_len:
                raise ConfigError("dataset.seq_length", f"{data_len} is longer than model.seq_length ({model_len}).",
                                  "Lower dataset.seq_length or raise model.seq_length.")
        elif data_len != model_len:
            relation = "is longer than" if data_len > model_len else "differs from"
            raise ConfigError("dataset.seq_length", f"{data_len} {relation} model.seq_length ({model_len}).",
                              "Set them equal (the dataset follows the model by default).")

    def _derive_scheduler_steps(self) -> None:
        """Scheduler steps count samples, as megatron-core's OptimizerParamScheduler expects."""
        s, gbs, iters = self.scheduler, self.train.global_batch_size, self.train.train_iters
        if s.lr_warmup_fraction is not None and s.lr_warmup_iters:
            raise ConfigError("scheduler.lr_warmup_fraction", "and scheduler.lr_warmup_iters are mutually exclusive.",
                              "Set one of them.")
        decay_iters = s.lr_decay_iters or iters
        s.lr_decay_steps = decay_iters * gbs
        s.wd_incr_steps = iters * gbs
        s.lr_warmup_steps = (int(s.lr_warmup_fraction * s.lr_decay_steps) if s.lr_warmup_fraction is not None
                             else s.lr_warmup_iters * gbs)
        if s.lr_warmup_steps > s.lr_decay_steps:
            raise ConfigError("scheduler.lr_warmup_iters", f"warmup ({s.lr_warmup_steps // gbs} iterations) is longer "
                              f"than the decay ({decay_iters} iterations).", "Shorten the warmup.")
        s.wsd_decay_steps = s.lr_wsd_decay_iters * gbs if s.lr_wsd_decay_iters else None
        if s.lr_decay_style == "WSD" and s.wsd_decay_steps is None:
            raise ConfigError("scheduler.lr_wsd_decay_iters", "is required by lr_decay_style=WSD.",
                              "Set scheduler.lr_wsd_decay_iters=N.")
