"""Everything before the first step: process groups, seeds, model, optimizer, scheduler, data."""

from __future__ import annotations

import os
import random
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from bridge_cli.logging.startup import StartupClock
from bridge_cli.training.config import ConfigContainer
from bridge_cli.training.state import GlobalState


@dataclass
class SetupOutput:
    model: list
    optimizer: Any
    scheduler: Any
    train_data_iterator: Any
    valid_data_iterator: Any
    test_data_iterator: Any
    checkpointing_context: dict
    """Megatron-Bridge's; bridge keeps its checkpoint state in ``state.checkpoint_manager``."""
    startup: StartupClock


def set_seeds(seed: int, runtime) -> None:
    """Same seed on every data-parallel replica; megatron-core offsets it per tensor/pipeline rank."""
    from megatron.core import parallel_state, tensor_parallel

    seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    # Also on the CPU, where cpu_patches backs megatron-core's RNG tracker with the CPU generator:
    # recompute and the local spec fork that tracker.
    tensor_parallel.model_parallel_cuda_manual_seed(seed)


def build_model(cfg: ConfigContainer, runtime) -> list:
    """One GPTModel per (virtual) pipeline stage this rank holds, on the run's device; with ``peft``,
    frozen and carrying LoRA adapters; with ``model.compile_layers``, its layers compiled."""
    from megatron.core import parallel_state
    from megatron.core.transformer.module import Float16Module

    model_config = cfg.derived.model
    vpp = cfg.model.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        stage = vp_stage if vpp else None
        pre = parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage) if vpp else \
            parallel_state.is_pipeline_first_stage()
        post = parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage) if vpp else \
            parallel_state.is_pipeline_last_stage()
        model = model_config.provide(pre_process=pre, post_process=post, vp_stage=stage).to(runtime.device)
        if model_config.fp16 or model_config.bf16:
            # As Megatron-LM: half-precision weights, fp32 at the loss boundary.
            model = Float16Module(model_config, model)
        chunks.append(model)
    if model_config.num_moe_experts and (model_config.fp16 or model_config.bf16):
        from bridge_cli.models.moe_compat import keep_router_biases_in_fp32

        keep_router_biases_in_fp32(chunks)
    if model_config.fp8:
        _report_fp8(chunks, model_config, runtime)
    if cfg.peft is not None:
        from bridge_cli.peft.lora import apply_lora
        from bridge_cli.runtime.collectives import is_last_rank

        counts = apply_lora(chunks, cfg.peft, cfg.rng.seed)
        if is_last_rank():
            print(f"{counts.describe(cfg.peft)} (rank {runtime.rank})", flush=True)
    if cfg.model.compile_layers:
        from bridge_cli.models.regional_compile import compile_layers

        compile_layers(chunks)
    return chunks


def _report_fp8(chunks: list, model_config, runtime) -> None:
    from bridge_cli.models.fp8_linear import fp8_linear_count
    from bridge_cli.runtime.collectives import is_last_rank

    fp8, bf16 = map(sum, zip(*(fp8_linear_count(chunk) for chunk in chunks)))
    if is_last_rank() and fp8 + bf16:  # none on the te spec, whose own FP8 is Transformer Engine's
        kept = "routers and routed experts"
        if not model_config.fp8_output_layer:
            kept = f"the output layer, {kept}"
        print(f"FP8 GEMMs ({model_config.fp8_recipe} scaling, {model_config.fp8}): {fp8} linear layers in fp8, {bf16} "
              f"in bf16; {kept} in bf16 (rank {runtime.rank})", flush=True)


def adapter_policy(cfg: ConfigContainer):
    """How checkpoints of this run's model are saved and loaded when it carries adapters (``peft``), else None."""
    if cfg.peft is None:
        return None
    from bridge_cli.peft.lora import adapter_policy as lora_policy

    return lora_policy(cfg.peft)


def build_scheduler(cfg: ConfigContainer, optimizer):
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    s, opt, steps = cfg.scheduler, cfg.optimizer, cfg.derived
    return OptimizerParamScheduler(
        optimizer,
        init_lr=s.lr_warmup_init,
        max_lr=opt.lr,
        min_lr=opt.min_lr or 0.0,
        lr_warmup_steps=steps.lr_warmup_steps,
        lr_decay_steps=steps.lr_decay_steps,
        lr_decay_style=s.lr_decay_style,
        start_wd=s.start_weight_decay if s.start_weight_decay is not None else opt.weight_decay,
        end_wd=s.end_weight_decay if s.end_weight_decay is not None else opt.weight_decay,
        wd_incr_steps=steps.wd_incr_steps,
        wd_incr_style=s.weight_decay_incr_style,
        use_checkpoint_opt_param_scheduler=s.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=s.override_opt_param_scheduler,
        wsd_decay_steps=steps.wsd_decay_steps,
        lr_wsd_decay_style=s.lr_wsd_decay_style,
    )


def build_data_iterators(cfg: ConfigContainer, state: GlobalState, n_chunks: int,
                         sizes: Optional[list[int]] = None) -> tuple:
    """Train/valid/test iterators; one copy per model chunk with virtual pipeline stages.

    ``sizes`` (samples per split) defaults to what training reads (see ``data.builders.dataset_sizes``).
    """
    from megatron.core import parallel_state

    from bridge_cli.data.builders import build_datasets, build_iterator
    from bridge_cli.data.tokenizers import build_tokenizer
    from bridge_cli.training.rerun import replayable

    tokenizer = build_tokenizer(cfg.tokenizer, cfg.derived.vocab_size)
    train_ds, valid_ds, test_ds = build_datasets(cfg, tokenizer, sizes)
    dp_rank = parallel_state.get_data_parallel_rank()
    dp_size = parallel_state.get_data_parallel_world_size()
    ts = state.train_state
    pin = state.runtime.is_cuda

    def iterators(dataset, consumed):
        made = [build_iterator(dataset, cfg, consumed, dp_rank, dp_size, pin) for _ in range(n_chunks)]
        if made[0] is None:  # a split the data lacks: None, not a list of None the loop would take for data
            return None
        return made if n_chunks > 1 else made[0]

    # the rerun state machine replays a step's training micro-batches
    return (replayable(iterators(train_ds, ts.consumed_train_samples)),
            iterators(valid_ds, ts.consumed_valid_samples), iterators(test_ds, 0))


def init_microbatch_calculator(rank: int, rampup: Optional[list[int]], global_batch: int, micro_batch: int,
                               data_parallel: int) -> None:
    """megatron-core's micro-batch calculator, ramping the batch up as ``train.rampup_batch_size`` says.

    megatron-core 0.19 ignores ``rampup_batch_size`` (deprecated for ``step_batch_size_schedule``):
    where the calculator takes a step schedule, the ramp is given as the steps it makes. The global
    batch is already a multiple of micro batch x data-parallel size (validation rounds it down when
    ``train.decrease_batch_size_if_needed`` asks), so nothing is left to decrease here.
    """
    import inspect

    from megatron.core.num_microbatches_calculator import init_num_microbatches_calculator

    if rampup and "step_batch_size_schedule" in inspect.signature(init_num_microbatches_calculator).parameters:
        init_num_microbatches_calculator(rank, None, global_batch, micro_batch, data_parallel,
                                         step_batch_size_schedule=rampup_steps(rampup, global_batch))
    else:
        init_num_microbatches_calculator(rank, rampup, global_batch, micro_batch, data_parallel)


def rampup_steps(rampup: list[int], global_batch: int) -> str:
    """Megatron-LM's ramp [start, increment, samples] as a step schedule "SAMPLES:BATCH ...": the
    batch grows by the increment each samples / increments consumed samples, reaching the global batch
    once all ramp-up samples are consumed (the first consumed count at or past each step's start)."""
    start, increment, samples = rampup
    increments = (global_batch - start) // increment
    steps: dict[int, int] = {}
    for k in range(increments + 1):
        steps[-(-k * samples // increments)] = start + k * increment  # a later step at the same count wins
    return " ".join(f"{threshold}:{batch}" for threshold, batch in steps.items())


def initialize(state: GlobalState):
    """Process groups, the validated config for this world, seeds, timers (the straggler detector's too) and
    the micro-batch calculator."""
    from bridge_cli.logging.python_logging import configure_python_logging
    from bridge_cli.logging.stragglers import start_straggler_detector
    from bridge_cli.logging.timers import build_timers
    from bridge_cli.runtime.compile_cache import use_persistent_compile_cache
    from bridge_cli.runtime.distributed import init_distributed
    from bridge_cli.runtime.fsdp import fsdp_kind
    from bridge_cli.runtime.fault_tolerance import start_fault_tolerance

    cfg = state.cfg
    if torch.cuda.is_available() and not fsdp_kind(cfg):
        # Before the CUDA context exists: keeps tensor-parallel communication ordered ahead of the
        # compute it overlaps with, as Megatron-LM requires (not under FSDP, whose all-gathers and
        # reduce-scatters overlap compute on their own streams: Megatron-LM refuses 1 there).
        os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    if cfg.model.compile_layers or torch.cuda.is_available():  # megatron-core compiles its fused kernels on CUDA
        use_persistent_compile_cache()
    m = cfg.model
    runtime = init_distributed(
        backend=cfg.dist.distributed_backend or "auto",
        timeout_minutes=cfg.dist.distributed_timeout_minutes,
        tensor_model_parallel_size=m.tensor_model_parallel_size,
        pipeline_model_parallel_size=m.pipeline_model_parallel_size,
        context_parallel_size=m.context_parallel_size,
        expert_model_parallel_size=m.expert_model_parallel_size,
        expert_tensor_parallel_size=m.expert_tensor_parallel_size,
        virtual_pipeline_model_parallel_size=m.virtual_pipeline_model_parallel_size,
        pipeline_model_parallel_comm_backend=m.pipeline_model_parallel_comm_backend,
        gloo_groups=cfg.dist.use_gloo_process_groups,
        nccl_settings_path=cfg.dist.nccl_communicator_config_path,
        high_priority_stream_groups=cfg.dist.high_priority_stream_groups,
    )
    state.runtime = runtime
    derived = cfg.validate(runtime.world_size, runtime.device.type)
    configure_python_logging(cfg.logger)
    set_seeds(cfg.rng.seed, runtime)
    # megatron-core's schedules, grad finalization and optimizer time themselves through these.
    state.timers = derived.model.timers = cfg.optimizer.timers = build_timers(cfg.logger)
    state.straggler_timer = start_straggler_detector(cfg.straggler)
    state.fault_tolerance = start_fault_tolerance(cfg.ft, cfg.checkpoint, runtime.rank, runtime.world_size)
    init_microbatch_calculator(runtime.rank, cfg.train.rampup_batch_size, derived.global_batch_size,
                               cfg.train.micro_batch_size, derived.data_parallel_size)
    if runtime.rank == runtime.world_size - 1:  # the rank that prints the log
        vocab, padded = derived.vocab_size, derived.padded_vocab_size  # Megatron-LM's line, so logs compare
        print(f" > padded vocab (size: {vocab}) with {padded - vocab} dummy tokens (new size: {padded})", flush=True)
    return runtime


def setup(state: GlobalState, checkpointing_context: Optional[dict] = None) -> SetupOutput:
    """Initialize this process for ``state.cfg``: distributed, model, optimizer, scheduler, checkpoint, data.

    A checkpoint (``checkpoint.load``, ``pretrained_checkpoint``) is loaded before the data
    iterators are built, so they start at the consumed samples it restores.
    """
    from bridge_cli.checkpoint.load import load_checkpoint
    from bridge_cli.checkpoint.manager import CheckpointManager
    from bridge_cli.convert.hf_training import converted_for_loading
    from bridge_cli.runtime.ddp import configure_grad_sync, wrap_model
    from bridge_cli.runtime.optimizer import build_optimizer

    cfg = state.cfg
    clock = StartupClock()
    clock.lap("python, imports and config")
    runtime = initialize(state)
    clock.lap("process groups")
    # megatron-core's DDP and optimizer take only the parameters that require grad: with peft, the adapters
    model = wrap_model(build_model(cfg, runtime), cfg.ddp, cfg.dist.use_torch_fsdp2, runtime.device)
    if cfg.model.gradient_accumulation_fusion:
        from bridge_cli.models import wgrad_in_graph

        wgrad_in_graph.install(model)
    clock.lap("model")
    optimizer = build_optimizer(cfg.optimizer, model, runtime)
    configure_grad_sync(model, optimizer, cfg.dist.align_grad_reduce)
    scheduler = build_scheduler(cfg, optimizer)
    clock.lap("optimizer")
    adapters = adapter_policy(cfg)
    # built before loading: it takes checkpoint.save's lock, so a second run there stops before reading it
    manager = state.checkpoint_manager = CheckpointManager(
        cfg.checkpoint, model=model, optimizer=optimizer, scheduler=scheduler, train_state=state.train_state,
        run_record=cfg.run_record(), use_distributed_optimizer=cfg.optimizer.use_distributed_optimizer,
        is_cuda=runtime.is_cuda, world_size=runtime.world_size, seq_length=cfg.model.seq_length, adapters=adapters)
    with converted_for_loading(cfg.checkpoint, runtime.local_rank, adapters is not None) as pretrained:  # a Hugging Face folder, converted for the load
        if load_checkpoint(state, model, optimizer, scheduler, adapters=adapters, pretrained=pretrained) is not None:
            state.fault_tolerance.checkpoint_loaded()
    manager.base_checkpoint = state.base_checkpoint
    clock.lap("checkpoint")
    train_it, valid_it, test_it = build_data_iterators(cfg, state, len(model))
    clock.lap("data")
    return SetupOutput(model, optimizer, scheduler, train_it, valid_it, test_it,
                       checkpointing_context if checkpointing_context is not None else {}, clock)
