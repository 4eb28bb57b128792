"""The one validate-and-derive pass: a pure function of (config, world size, device).

It checks every rule a run would hit before its first step (sections, cross-field rules, the
device table, model shapes megatron-core would only trip over while building the model) and
returns the values a run derives from the config, frozen. The config itself is never written:
what a tokenizer, the world size or the batch sizes imply lives in :class:`Derived`. The one exception is
the comm_overlap section, whose set fields stand for model, ddp and optimizer fields and are written onto them.
``bridge config validate``, ``--dry-run`` and a real run all call it, so they refuse the same things; a run checks
once, and its later stages reuse that pass while the config, world size and device stay the same.
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

from bridge_cli.config.comm_overlap_config import apply_comm_overlap
from bridge_cli.config.errors import ConfigError
from bridge_cli.config.fields import check_section
from bridge_cli.config.finetune_config import check_objective
from bridge_cli.config.ranges import check_ranges
from bridge_cli.config.schema import mcore_sections
from bridge_cli.config.unsupported import check_unsupported
from bridge_cli.models.attention.config_checks import check_attention
from bridge_cli.models.fp8_checks import check_low_precision
from bridge_cli.models.layer_option_checks import check_layer_options
from bridge_cli.models.moe_checks import check_moe
from bridge_cli.models.specs import SPEC_NAMES, check_spec, default_spec_name
from bridge_cli.models.wgrad_accumulation import check as check_wgrad_accumulation
from bridge_cli.config.data_configs import FinetuningDatasetConfig
from bridge_cli.runtime.device_rules import check_device, default_device
from bridge_cli.runtime.fsdp import check_fsdp
from bridge_cli.runtime.launcher_fields import check_launcher_fields
from bridge_cli.runtime.mcore_import import megatron_core_version
from bridge_cli.runtime.nccl_groups import check_nccl_groups
from bridge_cli.runtime.output_paths import check_output_folders

SCHEDULER_STEP_FIELDS = ("lr_warmup_steps", "lr_decay_steps", "wd_incr_steps", "wsd_decay_steps")
"""SchedulerConfig fields the reference derives; here they are in Derived and refused when set."""


@dataclass(frozen=True)
class Derived:
    """What one run derives from its config; computed once, never written back into the config."""

    world_size: int
    """Processes the run is checked for."""
    device: str
    """cpu or cuda."""
    data_parallel_size: int
    """world size / (TP x PP x CP)."""
    num_microbatches: int
    """global batch / (micro batch x data-parallel size)."""
    global_batch_size: int
    """train.global_batch_size (rounded down to a multiple of micro batch x data-parallel size with
    train.decrease_batch_size_if_needed), or that product when it is unset."""
    vocab_size: int
    """The tokenizer's vocabulary (model.vocab_size for the null tokenizer)."""
    padded_vocab_size: int
    """Embedding rows: vocab_size padded to model.make_vocab_size_divisible_by x TP."""
    lr_warmup_steps: int
    """Scheduler warmup, in samples (megatron-core's scheduler counts samples)."""
    lr_decay_steps: int
    """Scheduler decay, in samples."""
    wd_incr_steps: int
    """Weight-decay ramp, in samples."""
    wsd_decay_steps: Optional[int]
    """WSD annealing phase, in samples (None unless lr_decay_style=WSD)."""
    model: Any = dataclasses.field(compare=False, repr=False)
    """The GPTModelProvider the run builds: the model section with the tokenizer's vocabulary and,
    on the CPU, megatron-core's CPU initialization. megatron-core attaches its runtime hooks to it."""
    comm_overlap: dict = dataclasses.field(default_factory=dict, compare=False)
    """{model/ddp/optimizer key: value} that the comm_overlap section set (bridge_cli/config/comm_overlap_config.py)."""
    checked: Optional[dict] = dataclasses.field(default=None, compare=False, repr=False)
    """The config's values as this pass checked them (ConfigContainer.to_dict()): a later stage of the run reuses the
    pass only for the same values."""

    def holds_for(self, cfg, world_size: int, device: str) -> bool:
        """Whether this pass is ``cfg``'s for ``world_size`` processes on ``device``: nothing changed since."""
        return (self.world_size, self.device) == (world_size, device) and self.checked == cfg.to_dict()

    def as_dict(self) -> dict[str, Any]:
        """The values --dry-run prints and run_config.yaml records."""
        return {
            "world_size": self.world_size,
            "device": self.device,
            "data_parallel_size": self.data_parallel_size,
            "micro_batches_per_step": self.num_microbatches,
            "global_batch_size": self.global_batch_size,
            "vocab_size": self.vocab_size,
            "padded_vocab_size": self.padded_vocab_size,
            "scheduler_steps": {name: getattr(self, name) for name in SCHEDULER_STEP_FIELDS},
            **({"comm_overlap": dict(self.comm_overlap)} if self.comm_overlap else {}),
        }


def validate_and_derive(cfg, world_size: int, device: str, previous: Optional[Derived] = None) -> Derived:
    """Check ``cfg`` (a ConfigContainer) for ``world_size`` processes on ``device``; raise ConfigError
    (or RuntimeUnavailable for what the device cannot run) naming the key, else return the derived values.

    ``previous`` is an earlier pass over ``cfg`` (the command's, before pretrain() and setup() ask again): when it
    holds for the same world size, device and config values, its checks stand and only the model the run builds
    is copied afresh, since megatron-core attaches a run's hooks to that copy.
    """
    if previous is not None and previous.holds_for(cfg, world_size, device):
        return dataclasses.replace(previous, model=_run_model(cfg.model, previous.vocab_size, device))
    mcore = mcore_sections()  # megatron-core's classes check themselves
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.init and f.name not in mcore and dataclasses.is_dataclass(value):
            check_section(f.name, value)
    check_unsupported(cfg)
    _check_required(cfg)
    check_ranges(cfg)
    _check_exit_signal(cfg.train)
    _check_scheduler_fields_unset(cfg.scheduler)
    _check_precision(cfg)
    _check_rerun_mode(cfg)
    _check_gloo_groups(cfg)
    check_nccl_groups(cfg.dist)
    check_objective(cfg)
    check_fsdp(cfg, device)  # before the device table: Megatron-FSDP's own reason beats its optimizer's
    check_device(cfg, device)
    vocab_size = _vocab_size(cfg)
    dp = data_parallel_size(cfg.model, world_size)
    comm_overlap = apply_comm_overlap(cfg, dp)
    _check_model_shape(cfg.model)
    check_unsupported(cfg, launcher=True)  # after comm_overlap, which may set them
    check_launcher_fields(cfg.model, device)
    check_moe(cfg.model, world_size)
    global_batch, microbatches = _batches(cfg.train, dp)
    _check_gradient_norm_logging(cfg, dp)
    _check_sequence_length(cfg)
    check_attention(cfg)
    check_low_precision(cfg, cfg.model.spec or default_spec_name(), device)
    check_layer_options(cfg.model)
    check_wgrad_accumulation(cfg.model)
    _check_layer_spec(cfg.model, device)  # after the options' own rules, which name the option
    ckpt = cfg.checkpoint
    check_output_folders([("checkpoint.save", ckpt.save), ("logger.tensorboard_dir", cfg.logger.tensorboard_dir),
                          ("logger.wandb_save_dir", cfg.logger.wandb_save_dir),
                          ("checkpoint.non_persistent_global_ckpt_dir", ckpt.non_persistent_global_ckpt_dir),
                          ("checkpoint.export_hf_dir", ckpt.export_hf_dir)])
    _check_export_family(ckpt.export_hf_model_type)
    steps = _scheduler_steps(cfg.scheduler, global_batch, cfg.train.train_iters)
    model = _run_model(cfg.model, vocab_size, device)
    return Derived(world_size=world_size, device=device, data_parallel_size=dp, num_microbatches=microbatches,
                   global_batch_size=global_batch, vocab_size=vocab_size, padded_vocab_size=model.padded_vocab_size,
                   **steps, model=model, comm_overlap=comm_overlap, checked=cfg.to_dict())


def _check_layer_spec(model, device: str) -> None:
    """The layer spec's rules (models/specs.py), which layer_spec would otherwise meet only as it builds the model.
    A pass for another machine's device (--device cuda from a CPU machine) knows neither the spec model.spec=null
    picks there nor whether Transformer Engine imports there, so it checks an explicit model.spec only."""
    here = device == default_device()
    name = model.spec or (default_spec_name() if here else None)
    if name is None:
        return
    try:
        check_spec(name, model, transformer_engine_here=here)
    except ValueError as err:  # a name the schema's choices let through
        raise ConfigError("model.spec", f"{name!r} is not a layer spec.", f"Choose one of {', '.join(SPEC_NAMES)}.") from err


def _check_export_family(model_type: Optional[str]) -> None:
    if model_type is None:
        return
    from bridge_cli.convert import families  # the family modules: imported only to check a name given

    if model_type not in families.FAMILIES:
        raise ConfigError("checkpoint.export_hf_model_type", f"{model_type!r} is not a family bridge converts.",
                          f"Choose one of {families.supported()}, or leave it unset for the one the model fits.")


def data_parallel_size(model, world_size: int) -> int:
    """world_size / (TP x PP x CP); raises ConfigError when the sizes do not divide it."""
    model_parallel = model.tensor_model_parallel_size * model.pipeline_model_parallel_size * model.context_parallel_size
    if world_size % model_parallel:
        raise ConfigError(
            "model.tensor_model_parallel_size",
            f"TP ({model.tensor_model_parallel_size}) x PP ({model.pipeline_model_parallel_size}) x "
            f"CP ({model.context_parallel_size}) = {model_parallel} does not divide the world size ({world_size}).",
            "Change the parallel sizes or the number of processes.",
        )
    return world_size // model_parallel


def _run_model(model, vocab_size: int, device: str):
    """A copy of the model section as the run builds it (the user's section stays as given)."""
    run = copy.copy(model)
    run.vocab_size = vocab_size
    if device == "cpu":
        # megatron-core's GPU init path forks the CUDA RNG tracker; its CPU path builds each full
        # weight from torch's seed and slices it, so any TP size gets the same model.
        run.use_cpu_initialization = True
    return run


def _vocab_size(cfg) -> int:
    """A tokenizer with its own vocabulary (all but the null one) sets the model's, as the tokenizer
    alone does in Megatron-LM; the model pads it (Derived.padded_vocab_size)."""
    tok, model = cfg.tokenizer, cfg.model
    if tok.make_vocab_size_divisible_by != model.make_vocab_size_divisible_by:
        raise ConfigError("tokenizer.make_vocab_size_divisible_by", f"{tok.make_vocab_size_divisible_by} differs "
                          f"from model.make_vocab_size_divisible_by ({model.make_vocab_size_divisible_by}), "
                          "which pads the embedding.", "Set model.make_vocab_size_divisible_by only.")
    if tok.vocab_extra_ids:
        raise ConfigError("tokenizer.vocab_extra_ids", "is not supported by bridge's tokenizers.", "Leave it at 0.")
    if tok.tokenizer_type != "NullTokenizer":
        from bridge_cli.data.tokenizers import build_tokenizer

        return build_tokenizer(tok).vocab_size
    if model.vocab_size is None or model.vocab_size < 1:
        raise ConfigError("model.vocab_size", "is not set.", "Set model.vocab_size to the tokenizer's vocabulary size.")
    return model.vocab_size


def _check_required(cfg) -> None:
    if not cfg.train.train_iters or cfg.train.train_iters < 1:
        raise ConfigError("train.train_iters", "is not set.", "Set train.train_iters=N (N >= 1).")
    m = cfg.model
    if m.num_layers < 1 or m.hidden_size < 1 or m.num_attention_heads < 1:
        raise ConfigError("model", "num_layers, hidden_size and num_attention_heads must be set.",
                          "Pick a recipe (bridge recipes list) or set them.")
    if cfg.optimizer.lr is None:
        raise ConfigError("optimizer.lr", "is not set.", "Set optimizer.lr, e.g. optimizer.lr=3e-4.")


def _check_exit_signal(train) -> None:
    import signal

    if train.exit_signal not in {int(s) for s in signal.valid_signals()}:
        raise ConfigError("train.exit_signal", f"{train.exit_signal} is not a signal on this system.",
                          "Use e.g. 15 (SIGTERM) or 10 (SIGUSR1).")
    if train.exit_signal in (signal.SIGKILL, signal.SIGSTOP):
        raise ConfigError("train.exit_signal", f"{signal.Signals(train.exit_signal).name} cannot be caught.",
                          "Use e.g. 15 (SIGTERM) or 10 (SIGUSR1).")


def _check_gloo_groups(cfg) -> None:
    if not cfg.dist.use_gloo_process_groups and cfg.checkpoint.distrib_optim_fully_reshardable_mem_efficient:
        raise ConfigError("dist.use_gloo_process_groups",
                          "is false, and checkpoint.distrib_optim_fully_reshardable_mem_efficient=true gathers the "
                          "optimizer state over megatron-core's gloo groups.",
                          "Set dist.use_gloo_process_groups=true, or "
                          "checkpoint.distrib_optim_fully_reshardable_mem_efficient=false.")


def _check_scheduler_fields_unset(scheduler) -> None:
    for name in SCHEDULER_STEP_FIELDS:
        if getattr(scheduler, name) is not None:
            source = "lr_wsd_decay_iters" if name == "wsd_decay_steps" else name.replace("_steps", "_iters")
            raise ConfigError(f"scheduler.{name}", "is derived from the iteration settings (in samples) and cannot "
                              "be set.", f"Set scheduler.{source} instead, or leave it unset.")


def _check_precision(cfg) -> None:
    for flag in ("bf16", "fp16"):
        if getattr(cfg.model, flag) != getattr(cfg.optimizer, flag):
            raise ConfigError(f"optimizer.{flag}", f"differs from model.{flag}.",
                              f"Set both, or let optimizer.{flag} follow the model (the default).")
    if cfg.optimizer.use_distributed_optimizer != cfg.ddp.use_distributed_optimizer:
        raise ConfigError("ddp.use_distributed_optimizer", "differs from optimizer.use_distributed_optimizer.",
                          "Set both, or let ddp.use_distributed_optimizer follow the optimizer (the default).")


def _check_rerun_mode(cfg) -> None:
    rerun = cfg.rerun_state_machine
    if rerun.rerun_mode == "report_determinism_stats" and megatron_core_version() < (0, 19):
        raise ConfigError("rerun_state_machine.rerun_mode",
                          "report_determinism_stats fails in megatron-core before 0.19 (its statistics report reads "
                          "fields its own Caller lacks).", "Use validate_results, or upgrade megatron-core to 0.19.")
    if rerun.rerun_mode != "disabled" and rerun.check_for_nan_in_loss and cfg.model.fp16 and not cfg.optimizer.loss_scale:
        raise ConfigError("rerun_state_machine.check_for_nan_in_loss",
                          "under fp16 with dynamic loss scaling, a NaN/Inf loss is the loss scaler's signal, not a fault.",
                          "Set rerun_state_machine.check_for_nan_in_loss=false (Megatron-LM turns it off there), "
                          "or optimizer.loss_scale to a fixed value.")


def _check_model_shape(m) -> None:
    """What megatron-core would only refuse while building the model (or never, splitting unevenly)."""
    heads, groups, tp = m.num_attention_heads, m.num_query_groups or m.num_attention_heads, m.tensor_model_parallel_size
    if heads % groups:
        raise ConfigError("model.num_query_groups", f"{groups} does not divide model.num_attention_heads ({heads}).",
                          "Pick a divisor of the head count.")
    for key, value in (("model.num_attention_heads", heads), ("model.num_query_groups", groups),
                       ("model.ffn_hidden_size", m.ffn_hidden_size)):
        if value % tp:
            raise ConfigError(key, f"{value} is not divisible by model.tensor_model_parallel_size ({tp}).",
                              "Pick a tensor-parallel size that divides it.")
    pp, vpp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size or 1
    uneven = m.num_layers_in_first_pipeline_stage or m.num_layers_in_last_pipeline_stage or \
        getattr(m, "pipeline_model_parallel_layout", None)
    if not uneven and m.num_layers % (pp * vpp):
        raise ConfigError("model.num_layers", f"{m.num_layers} layers do not split evenly into "
                          f"{pp} pipeline stages x {vpp} virtual stages.",
                          "Change model.pipeline_model_parallel_size (or the virtual size), or set "
                          "model.num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage.")


def _check_gradient_norm_logging(cfg, dp: int) -> None:
    if cfg.logger.log_l2_norm_grad_to_tensorboard and cfg.ddp.use_distributed_optimizer and dp > 1:
        raise ConfigError("logger.log_l2_norm_grad_to_tensorboard",
                          "needs whole gradients on every rank; the distributed optimizer keeps only a "
                          "data-parallel shard of them.",
                          "Unset it, or set optimizer.use_distributed_optimizer=false.")


def _batches(train, dp: int) -> tuple[int, int]:
    """(global batch, micro-batches per step)."""
    if train.micro_batch_size is None or train.micro_batch_size < 1:
        raise ConfigError("train.micro_batch_size", "must be >= 1.")
    per_step = train.micro_batch_size * dp
    global_batch = train.global_batch_size if train.global_batch_size is not None else per_step
    if train.decrease_batch_size_if_needed and global_batch >= per_step:
        global_batch -= global_batch % per_step
    if global_batch < 1 or global_batch % per_step:
        raise ConfigError(
            "train.global_batch_size",
            f"{global_batch} is not a multiple of micro batch ({train.micro_batch_size}) "
            f"x data-parallel size ({dp}) = {per_step}.",
            f"Use a multiple of {per_step}, e.g. train.global_batch_size={max(per_step, global_batch // per_step * per_step)}, "
            "or set train.decrease_batch_size_if_needed=true to round it down.",
        )
    if train.rampup_batch_size:
        _check_rampup(train.rampup_batch_size, per_step, global_batch)
    return global_batch, global_batch // per_step


def _check_rampup(rampup, per_step: int, global_batch: int) -> None:
    if len(rampup) != 3:
        raise ConfigError("train.rampup_batch_size", f"needs 3 numbers, got {rampup}.",
                          "Write [start batch, increment, ramp-up samples], e.g. [16,16,300000].")
    start, increment, samples = rampup
    if min(start, increment, samples) < 1:
        raise ConfigError("train.rampup_batch_size", f"start ({start}), increment ({increment}) and ramp-up "
                          f"samples ({samples}) must each be >= 1.")
    if start % per_step or increment % per_step:
        raise ConfigError("train.rampup_batch_size", f"start ({start}) and increment ({increment}) must be "
                          f"multiples of micro batch x data-parallel size ({per_step}).")
    if start >= global_batch or (global_batch - start) % increment:
        raise ConfigError("train.rampup_batch_size", f"a ramp from {start} by {increment} does not end at "
                          f"train.global_batch_size ({global_batch}).",
                          "The start must be below the global batch and their difference a multiple of the "
                          "increment; without a ramp, unset train.rampup_batch_size.")


def _check_sequence_length(cfg) -> None:
    data_len, model_len = cfg.dataset.seq_length, cfg.model.seq_length
    if isinstance(cfg.dataset, FinetuningDatasetConfig):
        if data_len is not None and data_len > model_len:
            raise ConfigError("dataset.seq_length", f"{data_len} is longer than model.seq_length ({model_len}).",
                              "Lower dataset.seq_length or raise model.seq_length.")
    elif data_len != model_len:
        relation = "is longer than" if data_len > model_len else "differs from"
        raise ConfigError("dataset.seq_length", f"{data_len} {relation} model.seq_length ({model_len}).",
                          "Set them equal (the dataset follows the model by default).")


def _scheduler_steps(s, global_batch: int, iters: int) -> dict[str, Optional[int]]:
    """Scheduler steps count samples, as megatron-core's OptimizerParamScheduler expects."""
    if s.lr_warmup_fraction is not None and s.lr_warmup_iters:
        raise ConfigError("scheduler.lr_warmup_fraction", "and scheduler.lr_warmup_iters are mutually exclusive.",
                          "Set one of them.")
    decay_iters = s.lr_decay_iters or iters
    decay = decay_iters * global_batch
    warmup = (int(s.lr_warmup_fraction * decay) if s.lr_warmup_fraction is not None
              else s.lr_warmup_iters * global_batch)
    if warmup > decay:
        raise ConfigError("scheduler.lr_warmup_iters", f"warmup ({warmup // global_batch} iterations) is longer "
                          f"than the decay ({decay_iters} iterations).", "Shorten the warmup.")
    wsd = s.lr_wsd_decay_iters * global_batch if s.lr_wsd_decay_iters else None
    if s.lr_decay_style == "WSD" and wsd is None:
        raise ConfigError("scheduler.lr_wsd_decay_iters", "is required by lr_decay_style=WSD.",
                          "Set scheduler.lr_wsd_decay_iters=N.")
    return {"lr_warmup_steps": warmup, "lr_decay_steps": decay, "wd_incr_steps": iters * global_batch,
            "wsd_decay_steps": wsd}

