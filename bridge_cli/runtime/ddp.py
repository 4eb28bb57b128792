"""Data parallelism: megatron-core's DDP wrapper on both devices.

megatron-core's ``DistributedDataParallel`` keeps grads in contiguous buffers and all-reduces
them over the data-parallel group in ``finalize_model_grads``; with the CPU patches applied
its buffers live on the CPU and gloo carries the all-reduce. Only the distributed optimizer
(reduce-scatter into sharded fp32 main weights) is CUDA-only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from megatron.core.distributed import DistributedDataParallelConfig
    from megatron.core.optimizer import MegatronOptimizer


def wrap_model(model_chunks: list, ddp_config: DistributedDataParallelConfig, torch_fsdp2: bool = False,
               device=None) -> list:
    """Wrap each model chunk in megatron-core DDP and make the data-parallel replicas equal.

    Chunks after the first (virtual pipeline stages) share one bucket each, as Megatron-LM
    does, so their grads are reduced once the pipeline has drained. Overlapped param all-gathers
    are waited on before each compiled layer rather than inside it
    (:mod:`bridge_cli.runtime.param_gather_hooks`): compile the layers before wrapping. ``torch_fsdp2``
    (``dist.use_torch_fsdp2``) or ``ddp_config.use_megatron_fsdp`` wrap them in an FSDP
    instead (:mod:`bridge_cli.runtime.fsdp`), on ``device``.
    """
    from megatron.core.utils import get_model_config

    from bridge_cli.runtime.param_gather_hooks import GatherBeforeCompiledLayers

    if torch_fsdp2 or ddp_config.use_megatron_fsdp:
        from bridge_cli.runtime.fsdp import wrap_fsdp

        return wrap_fsdp(model_chunks, ddp_config, torch_fsdp2, device)

    wrapped = [
        GatherBeforeCompiledLayers(
            config=get_model_config(chunk),
            ddp_config=ddp_config,
            module=chunk,
            disable_bucketing=index > 0,
        )
        for index, chunk in enumerate(model_chunks)
    ]
    for chunk in wrapped:
        chunk.broadcast_params()
    return wrapped


def configure_grad_sync(
    model_chunks: list, optimizer: MegatronOptimizer, align_grad_reduce: bool = True
) -> None:
    """Give the pipeline schedules the hooks that sync, reduce and scale grads.

    The schedules read these from the model config: ``no_sync_func`` defers the DP all-reduce
    to the last micro-batch, ``finalize_model_grads_func`` runs it (plus the embedding and
    sequence-parallel reductions), ``grad_scale_func`` applies the optimizer's loss scale.
    With overlapped reduction and ``align_grad_reduce`` (``dist.align_grad_reduce``) every
    pipeline stage launches its reduction from the schedule, as Megatron-LM does.
    """
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.utils import get_model_config

    def per_chunk(name: str):
        hooks = [getattr(chunk, name) for chunk in model_chunks]
        return hooks[0] if len(hooks) == 1 else hooks

    config = get_model_config(model_chunks[0])
    ddp_config = model_chunks[0].ddp_config
    config.no_sync_func = per_chunk("no_sync")
    if ddp_config.overlap_grad_reduce and align_grad_reduce:
        config.grad_sync_func = per_chunk("start_grad_sync")
    if ddp_config.overlap_param_gather and ddp_config.align_param_gather:
        config.param_sync_func = per_chunk("start_param_sync")
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
