"""load_checkpoint(): restore a run from a torch_dist checkpoint, as Megatron-LM / Megatron-Bridge do.

What is restored follows the checkpoint section:

- ``load`` holds a checkpoint: model, optimizer (``load_optim``), scheduler, RNG (``load_rng``)
  and progress (iteration, consumed samples, FLOPs) are restored; ``ckpt_step`` picks an
  iteration other than the tracker's.
- ``finetune``, a ``release`` checkpoint, or ``pretrained_checkpoint`` (used when ``load`` holds
  no checkpoint): the weights only; the run starts at iteration 0 with a fresh optimizer.
- ``load`` holds none: training starts from scratch, or, with ``exit_on_missing_checkpoint``,
  stops with an error.
- with an adapter policy (LoRA): the base weights load first, from ``pretrained_checkpoint`` or the
  base an adapter checkpoint names; then, when ``load`` holds an adapter checkpoint, the adapters
  with their optimizer, scheduler, RNG and progress as above.

Model and optimizer tensors reshard to the run's tensor/pipeline/data-parallel layout; RNG states
are per (pipeline, tensor) rank and are restored only when that layout is unchanged.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from bridge_cli.checkpoint import distributed_optimizer, layout, optimizer_by_name, state_dict, verify
from bridge_cli.checkpoint.adapters import AdapterPolicy
from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.checkpoint.save import NON_PERSISTENT
from bridge_cli.runtime import optimizer_chain
from bridge_cli.runtime.fsdp import load_model_state, restore_sharded_optimizer_state, shard_saved_main_weights


@dataclass
class Source:
    """The checkpoint to load and how much of it."""

    found: layout.Found
    weights_only: bool
    why: str


def resolve_resume(ckpt_cfg, mode: str) -> tuple[Optional[str], list[str]]:
    """``--resume auto``: resume from ``checkpoint.save`` when ``checkpoint.load`` is unset and a checkpoint is there.

    Returns the folder to use as ``checkpoint.load`` (None: leave it as it is) and the lines to tell
    the user (nothing for ``never``). Called while the config is built, before validation.
    """
    if mode != "auto" or ckpt_cfg.load is not None or ckpt_cfg.save is None or Path(ckpt_cfg.save).is_file():
        return None, []  # (a file there is validation's to report)
    found = layout.find_checkpoint(Path(ckpt_cfg.save))
    if found.path is None and not _newer_non_persistent(ckpt_cfg, Path(ckpt_cfg.save), -1):
        return None, [f"resume: {note}" for note in found.notes] + [
            f"resume: no checkpoint in {ckpt_cfg.save} yet; starting from iteration 0."]
    # load_checkpoint reports what the search noticed
    return ckpt_cfg.save, [f"resume: resuming from {ckpt_cfg.save} (--resume auto; --resume never starts from scratch)."]


def load_checkpoint(state, model: list, optimizer, scheduler, weights_only: bool = False,
                    adapters: Optional[AdapterPolicy] = None, pretrained: Optional[str] = None) -> Optional[Path]:
    """Restore what ``state.cfg.checkpoint`` asks for; returns the folder loaded, or None.

    ``weights_only`` loads the model weights alone whatever the checkpoint section says (evaluation,
    merging); ``optimizer`` and ``scheduler`` may then be None. ``pretrained`` is where to read
    ``checkpoint.pretrained_checkpoint`` from (its conversion, when that is a Hugging Face folder). ``adapters`` (a model carrying LoRA
    adapters) loads the base model, then the adapters, and records the base in ``state.base_checkpoint``.
    """
    source = choose_source(state.cfg.checkpoint, state.cfg.checkpoint.load, pretrained)
    if adapters is not None:
        return _load_base_and_adapters(state, model, optimizer, scheduler, source, weights_only, adapters, pretrained)
    if source is None:
        return None
    if adapter_metadata(source.found.path) is not None:
        raise CheckpointError(f"{source.found.path} holds LoRA adapters, not a whole model. Add peft=lora to load "
                              "them onto their base model, or merge them into one first (bridge peft merge).")
    return _load_source(state, model, optimizer, scheduler, source, weights_only or source.weights_only)


def adapter_metadata(path: Path) -> Optional[dict]:
    """The ``peft`` entry of an adapter checkpoint (its LoRA settings and base checkpoint), else None."""
    from megatron.core import dist_checkpointing

    verify.check_files(path)
    common = _read(path, "its common state", lambda: dist_checkpointing.load_common_state_dict(str(path)))
    return common.get("peft")


def _load_source(state, model: list, optimizer, scheduler, source: Source, weights_only: bool,
                 select: state_dict.Selector = None, what: str = "checkpoint") -> Path:
    for note in source.found.notes:
        _say(note)
    path = source.found.path
    loaded_step = _load(state, model, optimizer, scheduler, path, weights_only, select)
    ts = state.train_state
    _say(f"loaded {what} {path} ({source.why}; iteration {loaded_step}): "
         + ("weights only" if weights_only else
            f"resuming at iteration {ts.step}, consumed samples {ts.consumed_train_samples}"))
    return path


def _load_base_and_adapters(state, model: list, optimizer, scheduler, source: Optional[Source],
                            weights_only: bool, adapters: AdapterPolicy, pretrained: Optional[str]) -> Path:
    """The frozen base weights, then the adapters when ``source`` is an adapter checkpoint."""
    ckpt = state.cfg.checkpoint
    if source is None:
        raise CheckpointError("peft=lora trains adapters on a pretrained model, and no checkpoint is set. "
                              "Set checkpoint.pretrained_checkpoint=DIR (a checkpoint `bridge pretrain` wrote).")
    saved = adapter_metadata(source.found.path)
    if saved is None:
        if source.why != "checkpoint.pretrained_checkpoint":
            _say(f"{source.found.path} holds a whole model, not LoRA adapters: loading it as the base model; "
                 "the adapters start from their initial values.")
        state.base_checkpoint = ckpt.pretrained_checkpoint
        return _load_source(state, model, optimizer, scheduler, source, True, adapters.is_base_key, "base model")
    _check_adapters_match(source.found.path, saved, adapters.settings)
    base_dir = pretrained or ckpt.pretrained_checkpoint or saved.get("base_checkpoint")
    if not base_dir:
        raise CheckpointError(f"{source.found.path} holds LoRA adapters and does not name their base model. "
                              "Set checkpoint.pretrained_checkpoint=DIR.")
    key = "checkpoint.pretrained_checkpoint" if ckpt.pretrained_checkpoint else f"the base named by {source.found.path}"
    base = layout.find_checkpoint(Path(base_dir))
    if base.path is None:
        raise CheckpointError(f"{key}: no checkpoint in {base_dir} (no {layout.TRACKER}, no iter_* folder, "
                              "no metadata.json). Set checkpoint.pretrained_checkpoint=DIR to the base model.")
    state.base_checkpoint = ckpt.pretrained_checkpoint or base_dir  # the adapters saved by this run name the same base
    _load_source(state, model, optimizer, scheduler, Source(base, True, key), True, adapters.is_base_key, "base model")
    return _load_source(state, model, optimizer, scheduler, source, weights_only or source.weights_only,
                        adapters.is_adapter_key, "LoRA adapters")


def _check_adapters_match(path: Path, saved: dict, settings: dict) -> None:
    """Shapes are checked tensor by tensor; alpha is not a tensor, and scales every adapter's output."""
    for name in ("dim", "alpha", "target_modules"):
        if name in saved and saved[name] != settings.get(name):
            raise CheckpointError(f"{path} holds LoRA adapters with peft.{name}={saved[name]} "
                                  f"(this run: {settings.get(name)}). Set peft.{name}={saved[name]}.")


def choose_source(ckpt, load_dir: Optional[str], pretrained: Optional[str] = None) -> Optional[Source]:
    """Which checkpoint to load (None: start from scratch); raises CheckpointError where the config demands one.

    ``pretrained`` replaces the folder of ``checkpoint.pretrained_checkpoint`` (not its name in messages).
    """
    if load_dir is not None:
        found = layout.find_checkpoint(Path(load_dir), ckpt.ckpt_step)
        newer = _newer_non_persistent(ckpt, Path(load_dir), found.iteration if found.path else -1)
        if newer is not None:
            found = layout.Found(newer.path, newer.iteration, notes=found.notes + newer.notes)
        if found.path is not None:
            weights_only = ckpt.finetune or found.release
            why = ("checkpoint.finetune" if ckpt.finetune else
                   "release checkpoint" if found.release else "checkpoint.load")
            return Source(found, weights_only, why)
        if ckpt.pretrained_checkpoint is None:
            if ckpt.exit_on_missing_checkpoint:
                raise CheckpointError(f"checkpoint.load={load_dir}: no checkpoint there (no {layout.TRACKER}, "
                                      "no iter_* folder) and checkpoint.exit_on_missing_checkpoint is set. "
                                      "Check the path, or unset checkpoint.load to start from scratch.")
            for note in found.notes:
                _say(note)
            _say(f"no checkpoint in {load_dir}; starting from iteration 0.")
            return None
    if ckpt.pretrained_checkpoint is not None:
        found = layout.find_checkpoint(Path(pretrained or ckpt.pretrained_checkpoint))
        if found.path is None:
            raise CheckpointError(f"checkpoint.pretrained_checkpoint={ckpt.pretrained_checkpoint}: no checkpoint "
                                  f"there (no {layout.TRACKER}, no iter_* folder, no metadata.json).")
        return Source(found, True, "checkpoint.pretrained_checkpoint")
    return None


def _newer_non_persistent(ckpt, load_dir: Path, than: int) -> Optional[layout.Found]:
    """A global non-persistent checkpoint newer than iteration ``than``, when those are enabled."""
    if ckpt.non_persistent_ckpt_type != "global" or ckpt.ckpt_step is not None:
        return None
    root = Path(ckpt.non_persistent_global_ckpt_dir or load_dir / NON_PERSISTENT)
    found = layout.find_checkpoint(root)
    return found if found.path is not None and found.iteration > than else None


def _load(state, model: list, optimizer, scheduler, path: Path, weights_only: bool,
          select: state_dict.Selector = None) -> int:
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    ckpt = state.cfg.checkpoint
    verify.check_files(path)
    stored = _read(path, "its metadata", lambda: load_sharded_metadata(str(path)))
    common = _read(path, "its common state", lambda: dist_checkpointing.load_common_state_dict(str(path)))
    if "checkpoint_version" not in common and "iteration" not in common:
        raise CheckpointError(f"{path} is a torch_dist checkpoint but not one bridge or Megatron-LM wrote "
                              "(its common state has no checkpoint_version or iteration).")
    metadata = state_dict.content_metadata(state.cfg.optimizer.use_distributed_optimizer)
    sharding = distributed_optimizer.saved_sharding(common)
    if sharding is not None and "distrib_optim_sharding_type" in metadata:
        metadata["distrib_optim_sharding_type"] = sharding  # the template takes the checkpoint's layout
    template = state_dict.model_sharded_state_dict(model, metadata, select)
    saved = verify.saved_config(path)
    verify.check_model_matches(path, template, stored, state.cfg.derived.model, saved)
    optim_mode = None if weights_only or optimizer is None else _optimizer_state_fits(path, state.cfg, stored, saved,
                                                                                       optimizer, sharding)
    load_optim = optim_mode == AS_SAVED
    load_rng = not weights_only and _rng_states_fit(path, ckpt, stored)
    load_rerun = not weights_only and _rerun_is_pending(path, common, stored)
    if load_optim:
        _initialize_optimizer_state(optimizer)

    sharded = state_dict.build(state.train_state, model, optimizer, scheduler, metadata=metadata, optim=load_optim,
                               rng=load_rng, is_cuda=state.runtime.is_cuda, is_loading=True, select=select)
    if load_rerun:
        sharded.update(state_dict.rerun_template())
    if optim_mode == BY_NAME:
        sharded["optimizer"] = optimizer_by_name.template(optimizer, sharded, metadata)
    with warnings.catch_warnings():
        # torch's and megatron-core's own deprecation notices about their internals: nothing to act on
        warnings.filterwarnings("ignore", message=".*(deprecating ShardedTensor|`load_state_dict` is deprecated)",
                                category=FutureWarning)
        loaded = _read(path, "its shards", lambda: dist_checkpointing.load(
            sharded, str(path), _load_strategy(state.cfg, path), strict=ckpt.dist_ckpt_strictness))
    for key, chunk in zip(state_dict.model_keys(model), state_dict.model_chunks(model)):
        # a selection (base weights or adapters of a LoRA model) leaves the other keys as they are
        _read(path, f"the {key} weights", lambda: load_model_state(chunk, loaded[key], strict=select is None))
    if load_optim:
        _read(path, "the optimizer state", lambda: _load_optimizer(optimizer, loaded["optimizer"], state, sharding))
    elif optim_mode == BY_NAME:
        _read(path, "the optimizer state", lambda: _load_optimizer_by_name(optimizer, sharded["optimizer"],
                                                                          loaded["optimizer"], common, state))
    elif optimizer is not None:
        # fp32 main copies of half-precision weights follow the loaded weights (or the checkpoint's fp32 ones)
        optimizer.reload_model_params(state_dict=loaded if ckpt.load_main_params_from_ckpt else None)
    if not weights_only:
        _restore_progress(path, state.train_state, scheduler, loaded)
    if load_rng:
        state_dict.restore_rng_states(loaded["rng_state"][0])
    if load_rerun:
        from megatron.core.rerun_state_machine import get_rerun_state_machine

        get_rerun_state_machine().load_state_dict(loaded["rerun_state_machine"])
    dist.barrier()
    return int(loaded.get("iteration", 0))


def _restore_progress(path: Path, train_state, scheduler, loaded: dict) -> None:
    """Iteration, consumed samples (the data position), FLOPs so far, and the scheduler."""
    if "train_state" in loaded:
        train_state.load_state_dict(loaded["train_state"])
    else:  # a Megatron-LM checkpoint: the counters live in its saved arguments
        args = loaded.get("args")
        train_state.step = int(loaded.get("iteration", 0))
        train_state.consumed_train_samples = getattr(args, "consumed_train_samples", 0)
        train_state.consumed_valid_samples = getattr(args, "consumed_valid_samples", 0)
        train_state.floating_point_operations_so_far = loaded.get("num_floating_point_operations_so_far", 0.0)
    if "opt_param_scheduler" in loaded and scheduler is not None:
        _load_scheduler(path, scheduler, loaded["opt_param_scheduler"])


AS_SAVED, BY_NAME = "as saved", "by name"
"""How the optimizer state loads: megatron-core's own load, or :mod:`~bridge_cli.checkpoint.optimizer_by_name`'s."""


def _optimizer_state_fits(path: Path, cfg, stored: dict, saved: Optional[dict], optimizer,
                          sharding: Optional[str] = None) -> Optional[str]:
    """How to load the optimizer state (None: not at all); says why not when the checkpoint's cannot be used.

    ``sharding`` is how the checkpoint saved a distributed optimizer's state (its content metadata)."""
    if not cfg.checkpoint.load_optim:
        return None
    if not any(_is_optimizer_key(key) for key in stored):
        _say(f"{path} holds no optimizer state (saved with checkpoint.save_optim=false); the optimizer starts fresh.")
        return None
    saved_distributed = (saved or {}).get("optimizer", {}).get("use_distributed_optimizer")
    fresh = "loading the weights, scheduler and progress; the optimizer starts fresh."
    if saved_distributed is not None and saved_distributed != cfg.optimizer.use_distributed_optimizer:
        _say(f"{path} holds the state of a {'distributed' if saved_distributed else 'plain'} optimizer, which this "
             f"run's optimizer cannot read; {fresh}")
        return None
    saved_experts = _expert_layout((saved or {}).get("model", {}))
    saved_layout = _model_parallel_layout((saved or {}).get("model", {}))
    if cfg.optimizer.use_distributed_optimizer and distributed_optimizer.reshards(sharding):
        ours = _expert_layout(vars(cfg.model)), _model_parallel_layout(vars(cfg.model))
        if saved is not None and (saved_experts, saved_layout) != ours:
            _say(f"{path} holds distributed-optimizer state saved per weight ({sharding}): resharding it to this "
                 "run's layout.")
        return AS_SAVED
    if saved_experts not in (None, _expert_layout(vars(cfg.model))):
        held = (f"{path} holds optimizer state for expert parallel x expert tensor parallel {saved_experts[0]} x "
                f"{saved_experts[1]}")
        if not saved_distributed and optimizer_by_name.supported(optimizer):
            _say(f"{held}: loading its Adam moments weight by weight into this run's layout.")
            return BY_NAME
        _say(f"{held}: megatron-core groups the expert parameters' state of its "
             f"{'distributed' if saved_distributed else 'mixed-precision'} optimizer by that layout, and it does not "
             f"reshard to this run's{_older_sharding(sharding) if saved_distributed else ''}; {fresh}")
        return None
    if saved_distributed and saved_layout not in (None, _model_parallel_layout(vars(cfg.model))):
        _say(f"{path} holds distributed-optimizer state for tensor x pipeline parallel {saved_layout[0]} x "
             f"{saved_layout[1]}, which reshards across data-parallel sizes only{_older_sharding(sharding)}; {fresh}")
        return None
    return AS_SAVED


def _older_sharding(sharding: Optional[str]) -> str:
    """Why a distributed optimizer's state is tied to its layout: the sharding it was saved with."""
    return (f" (saved {sharding or 'without a recorded sharding'}; save with "
            "checkpoint.dist_ckpt_optim_fully_reshardable=true for state that loads under any layout)")


def _is_optimizer_key(key: str) -> bool:
    """``optimizer.*``, or ``chained_<i>.optimizer.*``: megatron-core prefixes each chained distributed
    optimizer's state that way (one for dense and one for expert parameters when EP > 1)."""
    first, _, rest = key.partition(".")
    return first == "optimizer" or (first.startswith("chained_") and rest.startswith("optimizer."))


def _model_parallel_layout(model: dict) -> Optional[tuple]:
    keys = ("tensor_model_parallel_size", "pipeline_model_parallel_size", "virtual_pipeline_model_parallel_size")
    return tuple(model[k] for k in keys) if all(k in model for k in keys) else None


def _expert_layout(model: dict) -> Optional[tuple]:
    if not model.get("num_moe_experts") or "expert_model_parallel_size" not in model:
        return None
    tp = model.get("tensor_model_parallel_size", 1)
    return model["expert_model_parallel_size"], model.get("expert_tensor_parallel_size") or tp


def _rng_states_fit(path: Path, ckpt, stored: dict) -> bool:
    """Whether to restore the RNG states: only under the (pipeline, tensor) layout that saved them."""
    # stored as rng_state/shard_<offset>_<shape>
    rng = next((v for k, v in stored.items() if k.split("/")[0] == "rng_state"), None)
    if not ckpt.load_rng or rng is None:
        return False
    if tuple(rng.global_shape) != state_dict.rng_layout():
        pp, tp = rng.global_shape
        _say(f"{path} was saved with pipeline x tensor parallel {pp} x {tp}; the RNG states are not restored "
             "under this layout (model and optimizer are resharded).")
        return False
    return True


def _rerun_is_pending(path: Path, common: dict, stored: dict) -> bool:
    """Whether the checkpoint holds a step for the rerun state machine to re-run, and this run will.

    Only a checkpoint saved for a re-run elsewhere does (megatron-core 0.16 also saves one when a
    re-run disagreed, which cannot be resumed as a re-run: training goes on from it). It needs the
    machine on and the world size that saved it, as Megatron-LM does.
    """
    from megatron.core.rerun_state_machine import RerunMode, RerunState, get_rerun_state_machine

    machine, saved = get_rerun_state_machine(), common.get("rerun_state_machine")
    if not machine.validate_state_dict(saved) or saved["state"] != RerunState.WILL_RERUN_FROM_CHECKPOINT:
        return False
    step = f"iteration {int(common.get('iteration', 0)) + 1}"
    if machine.get_mode() == RerunMode.DISABLED:
        _say(f"{path} was saved to re-run {step} on another GPU; rerun_state_machine.rerun_mode=disabled "
             "trains on without that re-run.")
        return False
    shards = next((v for k, v in stored.items() if k.split("/")[0] == "rerun_state_machine_state"), None)
    if shards is None or tuple(shards.global_shape) != (dist.get_world_size(),):
        _say(f"{path} was saved to re-run {step} by {shards.global_shape[0] if shards else 'another number of'} "
             f"processes; with {dist.get_world_size()} the re-run is skipped and training goes on.")
        return False
    return True


def _initialize_optimizer_state(optimizer) -> None:
    """Give megatron-core's DistributedOptimizer the torch state its loading template is built from.

    With torch's Adam (no Transformer Engine / Apex) that state exists only after a first step; the
    values this dummy step writes are all overwritten by the load.
    """
    for member in optimizer_chain.members(optimizer):
        initialize = getattr(member, "_init_optimizer_states_with_dummy_values", None)
        if initialize is not None and not member.optimizer.state:
            initialize()


@torch.no_grad()  # the fp32 distributed optimizer copies into main params that are the model's own
def _load_optimizer(optimizer, saved, state, sharding: Optional[str] = None) -> None:
    if state.cfg.optimizer.use_distributed_optimizer and distributed_optimizer.reshards(sharding):
        distributed_optimizer.load(optimizer, saved)
    else:
        shard_saved_main_weights(optimizer, saved)  # FSDP2's fp32 main weights are DTensors, the saved ones shards
        optimizer.load_state_dict(saved)
    restore_sharded_optimizer_state(optimizer)  # FSDP2's moments are DTensors like its weights
    # With torch's Adam, megatron-core's DistributedOptimizer saves the step count in each param
    # group and, loading, leaves the per-parameter "step" tensors at their placeholder value (and
    # shared between parameters): set each from its group.
    for member in optimizer_chain.members(optimizer):
        inner = getattr(member, "optimizer", None)
        for group in getattr(inner, "param_groups", []):
            for param in group["params"]:
                step = inner.state.get(param, {}).get("step")
                if isinstance(step, torch.Tensor):
                    value = torch.full_like(step, float(group["step"])) if "step" in group else step.clone()
                    inner.state[param]["step"] = value
    # torch takes fused/foreach from the checkpoint's param groups: this run's choice wins
    from bridge_cli.runtime.optimizer import apply_adam_kernel_choice

    apply_adam_kernel_choice(optimizer, state.cfg.optimizer, state.runtime.is_cuda)


@torch.no_grad()
def _load_optimizer_by_name(optimizer, template: dict, saved: dict, common: dict, state) -> None:
    optimizer_by_name.load(optimizer, template, saved, common.get("optimizer"))
    from bridge_cli.runtime.optimizer import apply_adam_kernel_choice

    apply_adam_kernel_choice(optimizer, state.cfg.optimizer, state.runtime.is_cuda)


def _load_scheduler(path: Path, scheduler, saved: dict) -> None:
    saved = dict(saved)
    if saved.get("start_wd") == saved.get("end_wd") == scheduler.start_wd == scheduler.end_wd:
        # A constant weight decay never reads its ramp length (train_iters x global batch), so a run
        # resumed with a longer train.train_iters keeps its schedule and needs no override.
        saved["wd_incr_steps"] = scheduler.wd_incr_steps
    try:
        scheduler.load_state_dict(saved)
    except AssertionError as err:  # megatron-core asserts that each value matches the run's
        detail = str(err).replace("checkpointvalue", "checkpoint value")
        raise CheckpointError(
            f"{path}: the learning-rate schedule differs from this run's ({detail}; "
            "its steps count samples). Set scheduler.override_opt_param_scheduler=true to use this run's "
            "schedule, or scheduler.use_checkpoint_opt_param_scheduler=true to keep the checkpoint's.") from err


def _load_strategy(cfg, path: Path):
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.serialization import get_default_load_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelLoadStrategyWrapper

    strategy = get_default_load_sharded_strategy(str(path))
    if cfg.checkpoint.fully_parallel_load and ps.get_data_parallel_world_size(with_context_parallel=True) > 1:
        strategy = FullyParallelLoadStrategyWrapper(strategy, ps.get_data_parallel_group(with_context_parallel=True))
    return strategy


def _read(path: Path, what: str, read):
    """Run ``read``; any failure becomes a CheckpointError naming the checkpoint and the part."""
    try:
        return read()
    except CheckpointError:
        raise
    except Exception as err:  # a damaged file surfaces as whatever its reader raises
        raise CheckpointError(f"{path}: cannot load {what} ({type(err).__name__}: {str(err)[:500]}).") from err


def _say(line: str) -> None:
    from bridge_cli.runtime.collectives import is_last_rank

    if is_last_rank():
        print(f"checkpoint: {line}", flush=True)
