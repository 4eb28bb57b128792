"""Fully sharded data parallelism: torch FSDP2 (``dist.use_torch_fsdp2``) and Megatron-FSDP (``ddp.use_megatron_fsdp``).

Both replace megatron-core's ``DistributedDataParallel`` around each model chunk, as Megatron-LM's ``get_model``
does:

- torch FSDP2 is megatron-core's ``TorchFullyShardedDataParallel``: torch's ``fully_shard`` on every transformer
  layer, the embedding and the root module, each parameter a ``DTensor`` sharded on dim 0 over the data-parallel
  group, all-gathered before its module's forward and backward, its gradient reduce-scattered (averaged over the
  group) in the backward. The optimizer is megatron-core's plain one over the shards, its Adam kernel
  (``optimizer.adam_kernel``) stepping each weight's local shard (:func:`local_shard`: the update is elementwise)
  while its moments stay DTensors; a checkpoint is ``torch_dist``, the shards written as slices of the global
  tensors, so it loads under any layout. With ``model.compile_layers`` each layer is compiled before
  ``fully_shard`` hooks onto it, as torchtitan orders them, and the hooks stay out of the layer's graph (torch
  keeps dynamo out of them): they gather and free the weights around one compiled forward. It runs on the CPU
  (gloo), where megatron-core's wrapper asks for a CUDA device mesh: the mesh is built on the run's device.
- Megatron-FSDP is megatron-core's ``FullyShardedDataParallel`` (mcore_fsdp_adapter): its own buffers, CUDA streams
  and events, ``ddp.data_parallel_sharding_strategy`` choosing what is sharded (``no_shard``, ``optim``,
  ``optim_grads``, ``optim_grads_params``), with megatron-core's distributed optimizer over those buffers. GPU only.
  With ``model.compile_layers`` its hooks gather the weights before each compiled layer and reduce its gradients
  after, outside the layer's graph as FSDP2's are (tests/gpu/test_gpu_fsdp.py holds it to the eager curve).

What each needs and refuses is checked by :func:`check_fsdp` in the validation pass (``--dry-run`` included).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any

from bridge_cli.config.errors import ConfigError
from bridge_cli.runtime import optimizer_chain
from bridge_cli.runtime.errors import RuntimeUnavailable

TORCH_FSDP2 = "dist.use_torch_fsdp2"
MEGATRON_FSDP = "ddp.use_megatron_fsdp"

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
"""``ddp.data_parallel_sharding_strategy``: what Megatron-FSDP shards over the data-parallel group (ZeRO-1, -2, -3)."""

MEGATRON_FSDP_FIELDS = ("use_megatron_fsdp", "use_custom_fsdp", "data_parallel_sharding_strategy",
                        "outer_dp_sharding_strategy", "suggested_communication_unit_size", "preserve_fp32_weights",
                        "gradient_reduce_div_fusion", "fsdp_double_buffer", "fsdp_manual_registration")
"""ddp fields that configure Megatron-FSDP's wrapper (and, by prefix, ``fsdp_*`` and ``megatron_fsdp_*``)."""

MEGATRON_FSDP_PASSED_ON = ("use_megatron_fsdp", "use_custom_fsdp", "data_parallel_sharding_strategy",
                           "suggested_communication_unit_size", "preserve_fp32_weights", "gradient_reduce_div_fusion")
"""The Megatron-FSDP fields bridge hands to megatron-core; the others (hybrid sharding's outer group, NCCL user
buffers, double buffering) need set-up bridge does not do and are refused away from their defaults."""


def fsdp_kind(cfg) -> str | None:
    """The config key of the FSDP a run uses, or None (megatron-core's DDP)."""
    if cfg.dist.use_torch_fsdp2:
        return TORCH_FSDP2
    if cfg.ddp.use_megatron_fsdp:
        return MEGATRON_FSDP
    return None


def is_megatron_fsdp_field(name: str) -> bool:
    return name in MEGATRON_FSDP_FIELDS or name.startswith(("fsdp_", "megatron_fsdp_"))


def check_fsdp(cfg, device: str) -> None:
    """Raise ConfigError for an FSDP setting this run cannot honour, naming both keys of a clash, and
    RuntimeUnavailable for Megatron-FSDP on the CPU."""
    _check_megatron_fsdp_fields(cfg.ddp)
    kind = fsdp_kind(cfg)
    if kind is None:
        return
    if cfg.dist.use_torch_fsdp2 and cfg.ddp.use_megatron_fsdp:
        raise ConfigError(TORCH_FSDP2, f"and {MEGATRON_FSDP} are two FSDP implementations; a run uses one.",
                          f"Unset one of them ({_choose}).")
    m = cfg.model
    if m.pipeline_model_parallel_size > 1:
        raise ConfigError(kind, f"does not work with model.pipeline_model_parallel_size={m.pipeline_model_parallel_size}"
                          ": megatron-core shards whole model chunks, not pipeline stages.",
                          f"Set model.pipeline_model_parallel_size=1, or unset {kind}.")
    if m.num_moe_experts:
        raise ConfigError(kind, f"does not work with model.num_moe_experts={m.num_moe_experts} in bridge: its expert "
                          "layers, token dispatch and their checkpoints are not wired for FSDP (Megatron-LM refuses "
                          "expert parallelism under torch FSDP2).", f"Unset {kind} for a mixture of experts; "
                          "optimizer.use_distributed_optimizer=true shards its optimizer state.")
    if cfg.peft is not None:
        raise ConfigError(kind, "does not work with peft: LoRA's frozen base weights would be sharded and "
                          "all-gathered with nothing to train in them.", f"Unset {kind} (LoRA's optimizer state is small).")
    if kind == TORCH_FSDP2:
        _check_torch_fsdp2(cfg)
    else:
        _check_megatron_fsdp(cfg, device)
    shards_weights = kind == TORCH_FSDP2 or cfg.ddp.data_parallel_sharding_strategy == "optim_grads_params"
    if shards_weights and cfg.train.check_weight_hash_across_dp_replicas_interval:
        raise ConfigError(kind, "does not work with train.check_weight_hash_across_dp_replicas_interval: the "
                          "data-parallel ranks hold different shards of the weights, not replicas (Megatron-LM "
                          "refuses it with optim_grads_params too).",
                          "Unset train.check_weight_hash_across_dp_replicas_interval.")
    if cfg.logger.log_params_norm:
        raise ConfigError(kind, "does not work with logger.log_params_norm=true: bridge's norm sums whole weights, "
                          "and FSDP's are shards.", f"Set logger.log_params_norm=false, or unset {kind}.")


_choose = ("docs/parallelism.md#fsdp: torch FSDP2 on the CPU or GPU, Megatron-FSDP on GPUs with the distributed "
           "optimizer")


def _check_torch_fsdp2(cfg) -> None:
    m, opt = cfg.model, cfg.optimizer
    clashes = (
        ("optimizer.use_distributed_optimizer", opt.use_distributed_optimizer,
         "megatron-core's distributed optimizer shards a DDP gradient buffer, which torch FSDP2 does not keep (its "
         "gradients are shards already)", "Set optimizer.use_distributed_optimizer=false"),
        ("model.share_embeddings_and_output_weights", m.share_embeddings_and_output_weights,
         "the output layer would read the embedding's weight outside the module FSDP2 gathers it for (Megatron-LM "
         "requires --untie-embeddings-and-output-weights)", "Set model.share_embeddings_and_output_weights=false"),
        ("model.gradient_accumulation_fusion", m.gradient_accumulation_fusion,
         "it adds into a main_grad buffer next to each weight, and FSDP2's weights are gathered copies",
         "Set model.gradient_accumulation_fusion=false"),
        ("model.fp16", m.fp16, "megatron-core's fp16 loss scaling is not wired for FSDP2 (Megatron-LM refuses it)",
         "Use model.bf16=true"),
        ("ddp.overlap_grad_reduce", cfg.ddp.overlap_grad_reduce,
         "FSDP2 overlaps its reduce-scatters with the backward by itself", "Set ddp.overlap_grad_reduce=false"),
        ("ddp.overlap_param_gather", cfg.ddp.overlap_param_gather,
         "FSDP2 prefetches its all-gathers by itself", "Set ddp.overlap_param_gather=false"),
    )
    for key, on, why, fix in clashes:
        if on:
            raise ConfigError(TORCH_FSDP2, f"does not work with {key}={_shown(on)}: {why}.", f"{fix}, or unset "
                              f"{TORCH_FSDP2}.")


def _check_megatron_fsdp(cfg, device: str) -> None:
    ddp, opt = cfg.ddp, cfg.optimizer
    if device != "cuda":
        raise RuntimeUnavailable(
            f"{MEGATRON_FSDP}=true needs a GPU: Megatron-FSDP keeps its buffers on the CUDA device and orders its "
            "all-gathers and reduce-scatters with CUDA streams and events, which the CPU does not have. Run it on a "
            f"GPU machine, or use {TORCH_FSDP2}=true (torch's FSDP2, which also runs on the CPU).")
    if ddp.data_parallel_sharding_strategy not in SHARDING_STRATEGIES:
        raise ConfigError("ddp.data_parallel_sharding_strategy", f"{ddp.data_parallel_sharding_strategy!r} is not "
                          "one of Megatron-FSDP's strategies.", f"Use one of {', '.join(SHARDING_STRATEGIES)}.")
    if cfg.model.gradient_accumulation_fusion:
        raise ConfigError(MEGATRON_FSDP, "does not work with model.gradient_accumulation_fusion=true in bridge: its "
                          "weight-gradient GEMMs add into the main_grad buffers of megatron-core's DDP, and "
                          "Megatron-FSDP keeps its own (Megatron-LM leaves that pairing to Transformer Engine).",
                          "Set model.gradient_accumulation_fusion=false.")
    if not opt.use_distributed_optimizer:
        raise ConfigError(MEGATRON_FSDP, "needs optimizer.use_distributed_optimizer=true: megatron-core steps "
                          "Megatron-FSDP's sharded buffers with its distributed optimizer only (Megatron-LM turns it "
                          "on by itself; bridge does not change a field behind your back).",
                          "Set optimizer.use_distributed_optimizer=true.")
    for key, value in (("checkpoint.save", cfg.checkpoint.save), ("checkpoint.load", cfg.checkpoint.load),
                       ("checkpoint.pretrained_checkpoint", cfg.checkpoint.pretrained_checkpoint)):
        if value is not None:
            raise ConfigError(MEGATRON_FSDP, f"does not work with {key}: megatron-core (<0.20) saves Megatron-FSDP's "
                              "weights and optimizer state only in its fsdp_dtensor format (torch DCP), not the "
                              "torch_dist checkpoints bridge writes and resumes across layouts "
                              "(docs/checkpoints.md#fsdp).",
                              f"Unset {key} for a run without checkpoints, or train with {TORCH_FSDP2}=true or "
                              "optimizer.use_distributed_optimizer=true, whose checkpoints are torch_dist.")
    if opt.optimizer == "adam" and opt.adam_kernel != "foreach":
        raise ConfigError(MEGATRON_FSDP, f"does not work with optimizer.adam_kernel={opt.adam_kernel} yet: "
                          "megatron-core's distributed optimizer steps views of Megatron-FSDP's own buffers, which "
                          f"bridge's Triton Adam and torch's fused one have not stepped yet (under {TORCH_FSDP2}=true "
                          "they step each weight's local shard).",
                          "Set optimizer.adam_kernel=foreach (torch's foreach kernels, megatron-core's choice).")


def _check_megatron_fsdp_fields(ddp) -> None:
    """Fields of Megatron-FSDP set without it, or ones bridge does not hand on, away from their defaults."""
    import dataclasses

    for f in dataclasses.fields(ddp):
        if not is_megatron_fsdp_field(f.name) or f.name == "use_megatron_fsdp":
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        value = getattr(ddp, f.name)
        if value == default:
            continue
        if f.name == "data_parallel_sharding_strategy" and ddp.use_megatron_fsdp:
            continue
        if f.name not in MEGATRON_FSDP_PASSED_ON:
            raise ConfigError(f"ddp.{f.name}", "configures a part of Megatron-FSDP that bridge does not set up "
                              "(hybrid sharding's outer group, NCCL user buffers, double buffering).",
                              f"Leave it at its default ({default!r}).")
        if not ddp.use_megatron_fsdp:
            raise ConfigError(f"ddp.{f.name}", f"configures Megatron-FSDP, which is off ({MEGATRON_FSDP}=false).",
                              f"Set {MEGATRON_FSDP}=true (GPU only), or leave it at its default ({default!r}).")


def _shown(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def wrap_fsdp(model_chunks: list, ddp_config, torch_fsdp2: bool, device) -> list:
    """Each model chunk in megatron-core's FSDP wrapper (``torch_fsdp2``: torch's, else Megatron-FSDP).

    The chunks hold the same weights on every data-parallel rank (every rank draws them from the same seed, as
    under DDP, which broadcasts them anyway); the wrappers keep each rank's shard and broadcast nothing.
    """
    from megatron.core.utils import get_model_config

    if torch_fsdp2:
        _match_optimizer_state_to_local_shards()
        with _device_mesh_on(device.type), _reduce_in_fp32(ddp_config.grad_reduce_in_fp32):
            return [_torch_fsdp2_wrapper()(config=get_model_config(chunk), ddp_config=ddp_config, module=chunk,
                                                  sub_modules_to_wrap=_torch_fsdp2_units())
                    for chunk in model_chunks]
    import importlib.util

    if importlib.util.find_spec("einops") is None:  # megatron-core's adapter builds its device meshes with it
        raise RuntimeUnavailable(f"{MEGATRON_FSDP}=true needs the einops package, which megatron-core's Megatron-FSDP "
                                 "imports to build its device meshes: pip install einops (or bridge-cli[megatron-fsdp]).")
    from megatron.core.distributed.fsdp.mcore_fsdp_adapter import FullyShardedDataParallel

    # No broadcast_params() after wrapping, unlike DDP: the parameters are now DTensor shards, which torch cannot
    # broadcast ("c10d.broadcast_ has no sharding strategy", megatron-core 0.19), and a broadcast of rank 0's
    # shard would overwrite the other ranks' shards. Megatron-LM broadcasts only with data_parallel_random_init.
    return [FullyShardedDataParallel(config=get_model_config(chunk), ddp_config=ddp_config, module=chunk,
                                     disable_bucketing=index > 0)
            for index, chunk in enumerate(model_chunks)]


@functools.cache
def _torch_fsdp2_wrapper() -> type:
    """megatron-core's TorchFullyShardedDataParallel, whose ``finish_grad_sync`` takes the ``force_all_reduce``
    that megatron-core's own ``finalize_model_grads`` passes (0.16's base class does not: a TypeError at the first
    step). FSDP2 has reduce-scattered the gradients in the backward, so there is nothing to finish."""
    from megatron.core.distributed.torch_fully_sharded_data_parallel import TorchFullyShardedDataParallel

    class TorchFSDP2(TorchFullyShardedDataParallel):
        def finish_grad_sync(self, force_all_reduce: bool = False) -> None:
            pass

    return TorchFSDP2


def _match_optimizer_state_to_local_shards() -> None:
    """megatron-core pairs each optimizer parameter with the model's ShardedTensor by ``id``: the ShardedTensor holds
    the DTensor's ``_local_tensor``, the optimizer side ``to_local_if_dtensor(param)``, which was that same object
    until torch 2.10 made ``DTensor.to_local()`` of a Parameter a fresh view. The pairing then finds nothing and the
    first save fails ("Param id 0 does not match any model sharded param"). Its pairing module gets the local tensor
    itself; a view of it would serve every other caller as well, so nothing else changes."""
    from megatron.core.dist_checkpointing import optimizer as optim_ckpt

    optim_ckpt.to_local_if_dtensor = local_shard


def local_shard(tensor):
    """A DTensor's local shard itself (not ``to_local()``'s view of it), else ``tensor``: what bridge's Triton Adam,
    the clip it applies and the checkpoint's pairing of optimizer state read under FSDP2."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _torch_fsdp2_units() -> set:
    """The modules FSDP2 gathers one at a time: each transformer layer, the embedding (and RoPE, which holds no
    weights). megatron-core's default adds every ColumnParallelLinear, meaning the output layer of a Transformer
    Engine model; bridge's torch and local specs build the layers' own linears from that class, which fully_shard
    would then shard a second time inside their layer. The output layer is the root unit's."""
    from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from megatron.core.transformer.transformer_layer import TransformerLayer

    return {TransformerLayer, LanguageModelEmbedding, RotaryEmbedding}


@contextlib.contextmanager
def _device_mesh_on(device_type: str):
    """megatron-core's TorchFullyShardedDataParallel builds its mesh as ``DeviceMesh.from_group(group, "cuda")``:
    on the CPU the mesh (and the shards FSDP2 places on it) must be the CPU's, and torch 2.10+'s FSDP2 names each
    mesh dimension (a mesh without names fails in ``fully_shard``), so the mesh gets the run's device and a name."""
    from megatron.core.distributed import torch_fully_sharded_data_parallel as tfsdp

    real = tfsdp.DeviceMesh

    class _MeshOnThisDevice:
        @staticmethod
        def from_group(group, _device_type, *args, **kwargs):
            kwargs.setdefault("mesh_dim_names", ("dp_cp",))
            return real.from_group(group, device_type, *args, **kwargs)

    tfsdp.DeviceMesh = _MeshOnThisDevice
    try:
        yield
    finally:
        tfsdp.DeviceMesh = real


@contextlib.contextmanager
def _reduce_in_fp32(on: bool):
    """``ddp.grad_reduce_in_fp32`` under FSDP2: megatron-core's TorchFullyShardedDataParallel calls ``fully_shard``
    without a mixed-precision policy, so each layer's gradients were reduce-scattered in the weights' bf16 whatever
    the field said. With it on, every ``fully_shard`` gets ``MixedPrecisionPolicy(reduce_dtype=torch.float32)``:
    FSDP2 casts the layer's bf16 gradients to fp32, reduce-scatters and averages them in fp32 (twice the bytes of
    bf16) and rounds the average to the weights' dtype once. The shard's gradient, and so its sum over the
    micro-batches of a step, stays in the weights' dtype (FSDP2 keeps it there): unlike megatron-core's DDP, whose
    fp32 ``main_grad`` buffer also accumulates in fp32. Weights already in fp32 reduce in fp32 either way."""
    if not on:
        yield
        return
    import torch
    from megatron.core.distributed import torch_fully_sharded_data_parallel as tfsdp
    from torch.distributed.fsdp import MixedPrecisionPolicy

    real = tfsdp.fully_shard
    policy = MixedPrecisionPolicy(reduce_dtype=torch.float32)

    def fully_shard(module, **kwargs):
        return real(module, mp_policy=policy, **kwargs)

    tfsdp.fully_shard = fully_shard
    try:
        yield
    finally:
        tfsdp.fully_shard = real


def load_model_state(chunk, state: dict, strict: bool) -> None:
    """``chunk.load_state_dict(state)``, for a chunk whose weights FSDP2 shards as well.

    Under FSDP2 the torch_dist template held each weight's local shard, which ``dist_checkpointing.load`` fills in
    place (Megatron-LM skips the model's load_state_dict there); a shard it handed back as another tensor is copied
    in. The rest (plain tensors, every weight without FSDP) goes through ``load_state_dict``.
    """
    import torch
    from torch.distributed.tensor import DTensor

    current = chunk.state_dict(keep_vars=True)
    sharded = {name for name, value in current.items() if isinstance(value, DTensor)}
    if not sharded:
        chunk.load_state_dict(state, strict=strict)
        return
    missing = sharded - set(state)
    if strict and missing:
        raise RuntimeError(f"missing key(s) in the checkpoint: {', '.join(sorted(missing))}")
    with torch.no_grad():
        for name in sharded & set(state):
            local = current[name]._local_tensor
            if state[name] is not local:
                local.copy_(state[name])
    rest = {name: value for name, value in state.items() if name not in sharded}
    result = chunk.load_state_dict(rest, strict=False)
    if strict and (result.unexpected_keys or set(result.missing_keys) - sharded):
        raise RuntimeError(f"the checkpoint does not match the model: {result}")


def restore_sharded_optimizer_state(optimizer) -> None:
    """After ``optimizer.load_state_dict``: torch's Optimizer casts each loaded state tensor like its parameter but
    leaves it a plain tensor, where FSDP2's parameters are DTensors and Adam needs its moments alike; each local
    shard is made a DTensor of its parameter's mesh and placements again. Nothing to do without FSDP2."""
    from torch.distributed.tensor import DTensor

    for member in optimizer_chain.members(optimizer):
        inner = getattr(member, "optimizer", None)
        for param, state in getattr(inner, "state", {}).items():
            if not isinstance(param, DTensor):
                continue
            for key, value in state.items():
                if key != "step" and not isinstance(value, DTensor) and value.shape == param._local_tensor.shape:
                    state[key] = DTensor.from_local(value, param.device_mesh, param.placements, run_check=False,
                                                    shape=param.shape, stride=param.stride())


def shard_saved_main_weights(optimizer, saved) -> None:
    """Before megatron-core's ``optimizer.load_state_dict(saved)`` under FSDP2 with bf16 weights: its mixed-precision
    optimizer's fp32 main weights are DTensors (copies of FSDP2's bf16 DTensors), the checkpoint hands back each
    one's local shard, and the load copies ``current.data.copy_(saved.data)``, which mixes the two and fails ("got
    mixed torch.Tensor and DTensor"). Each saved shard becomes a DTensor of its main weight's mesh and placements,
    the shard itself (no copy). ``saved`` is what ``load_state_dict`` takes: one member's dict, or one per member of
    a chained optimizer. Nothing to do without FSDP2 or with fp32 weights (no main copies)."""
    from torch.distributed.tensor import DTensor

    members = optimizer_chain.members(optimizer)
    if len(members) == 1:
        states = [saved]
    else:  # megatron-core's ChainedOptimizer reads a dict of them in its keys' order
        states = [v for _, v in sorted(saved.items())] if isinstance(saved, dict) else list(saved)
    for member, member_state in zip(members, states):
        groups = getattr(member, "fp32_from_float16_groups", None)
        key = next((k for k in ("fp32_from_fp16_params", "fp32_from_fp16") if k in member_state), None)
        if not groups or key is None:
            continue
        for current_group, saved_group in zip(groups, member_state[key]):
            for i, (current, value) in enumerate(zip(current_group, saved_group)):
                if isinstance(current, DTensor) and not isinstance(value, DTensor):
                    saved_group[i] = DTensor.from_local(value, current.device_mesh, current.placements,
                                                        run_check=False, shape=current.shape, stride=current.stride())


def fix_gated_linear_shards(chunk, sharded: dict) -> None:
    """Make a gated MLP's fc1 checkpoint the same under FSDP2 as without it, in place of megatron-core's entry.

    megatron-core saves a gated fc1 (SwiGLU's [W; V] rows, per TP rank) through a factory that splits the local
    tensor in halves as W's and V's rows. Under FSDP2 the local tensor is a row shard of [W; V] (rank 0 of 2 holds
    W, rank 1 V), so the halves are labelled wrongly: a checkpoint resumes under the same FSDP2 layout and under no
    other. Here the factory gathers the shard into the TP rank's [W; V] (FSDP2's all-gather, in the same order on
    every rank) before megatron-core's split, and at load keeps this rank's rows of what it merged. The entry's
    ``data`` stays the local shard, which megatron-core pairs the optimizer's moments with (they go the same way).
    """
    import torch
    from megatron.core.dist_checkpointing.mapping import ShardedTensorFactory
    from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
    from megatron.core.utils import make_tp_sharded_tensor_for_checkpoint
    from torch.distributed.tensor import DTensor

    params = {id(p._local_tensor): p for p in chunk.parameters() if isinstance(p, DTensor)}
    for key, entry in list(_walk(sharded)):
        if not isinstance(entry, ShardedTensorFactory) or id(entry.data) not in params:
            continue
        if not entry.key.endswith(("linear_fc1.weight", "linear_fc1.bias")):
            raise NotImplementedError(f"{entry.key}: a megatron-core checkpoint factory bridge does not reshard "
                                      "under FSDP2")
        param = params[id(entry.data)]
        whole = torch.empty(param.shape, dtype=param.dtype, device="meta")
        offsets = _prepended_offsets(entry)
        plain = apply_swiglu_sharded_factory(
            make_tp_sharded_tensor_for_checkpoint(whole, entry.key, tp_axis=0, prepend_offsets=offsets), offsets)
        rows = _local_rows(param)

        def build(key_, local, replica_id, flattened_range, param=param, plain=plain):
            gathered = DTensor.from_local(local, param.device_mesh, param.placements, run_check=False,
                                          shape=param.shape, stride=param.stride()).full_tensor()
            return plain.build_fn(key_, gathered, replica_id, flattened_range)

        def merge(loaded, plain=plain, rows=rows):
            return plain.merge_fn(loaded)[rows].clone()

        key.parent[key.name] = ShardedTensorFactory(entry.key, entry.data, build, merge, plain.replica_id)


def _prepended_offsets(factory) -> tuple:
    """The offsets megatron-core prepended to a factory's tensors (the layer's index in a stacked checkpoint key)."""
    first = factory.build_fn(factory.key, factory.data, factory.replica_id, factory.flattened_range)[0]
    return tuple((axis, first.global_offset[axis], first.axis_fragmentations[axis])
                 for axis in range(first.prepend_axis_num))


def _local_rows(param) -> slice:
    """The rows of the whole tensor this rank's FSDP2 shard (Shard(0) over the data-parallel mesh) holds."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return slice(offset[0], offset[0] + shape[0])


class _Slot:
    def __init__(self, parent: dict, name):
        self.parent, self.name = parent, name


def _walk(tree: dict):
    """(slot, value) for every leaf of a nested dict."""
    for name, value in tree.items():
        if isinstance(value, dict):
            yield from _walk(value)
        else:
            yield _Slot(tree, name), value
