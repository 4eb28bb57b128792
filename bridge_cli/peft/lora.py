"""LoRA: low-rank adapters on megatron-core's parallel linear layers, with the base model frozen.

Each targeted layer (``peft.target_modules``: linear_qkv, linear_proj, linear_fc1, linear_fc2)
gets an ``adapter`` child holding A (``dim x in``, ``adapter.linear_in``) and B (``out x dim``,
``adapter.linear_out``) and computes ``W x + (alpha / dim) * B A dropout(x)``. B starts at zero,
so before the first step the model is exactly the base model.

The layer keeps its class's behaviour and its parameter names: its class is swapped for a
subclass that adds the adapter (as ``torch.nn.utils.parametrize`` does), so the base weights
keep their checkpoint keys and the adapters' keys are ``<layer>.adapter.linear_in.weight`` and
``<layer>.adapter.linear_out.weight``.

Mixture-of-experts: every routed expert (megatron-core's SequentialMLP, or the grouped-GEMM experts,
:mod:`.lora_experts`) and shared expert gets its own adapters on linear_fc1/linear_fc2; the router
stays frozen.

Tensor parallel: an adapter is split the way its layer is. On a column-parallel layer
(linear_qkv, linear_fc1) A is replicated and B split by output rows like W; the grad of A's
output is all-reduced over the tensor-parallel group so every rank's A stays equal. On a
row-parallel layer (linear_proj, linear_fc2) A is split by input columns like W and its output
all-reduced; B is replicated. A is drawn from a generator seeded by ``rng.seed``, the layer
number and the layer's name, so it is the same under any tensor/pipeline layout.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from bridge_cli.config.peft_config import LoRAConfig
from bridge_cli.peft.lora_init import adapter_seed, draw_a
from bridge_cli.runtime.errors import RuntimeUnavailable

ADAPTER = "adapter"


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict / checkpoint key belongs to a LoRA adapter."""
    return f".{ADAPTER}." in key


def adapter_policy(cfg: LoRAConfig):
    """How checkpoints of a model carrying these adapters are saved and loaded."""
    import dataclasses

    from bridge_cli.checkpoint.adapters import AdapterPolicy

    return AdapterPolicy({"scheme": "lora", **dataclasses.asdict(cfg)}, is_adapter_key)


class LoRAAdapter(torch.nn.Module):
    """``(alpha / dim) * B A dropout(x)`` for one parallel linear layer, split as that layer is."""

    def __init__(self, base, cfg: LoRAConfig, column_parallel: bool, swiglu: bool, seed: int):
        super().__init__()
        tp_group = base.tp_group
        tp_size, tp_rank = tp_group.size(), tp_group.rank()
        out_local, in_local = base.weight.shape
        in_full = in_local if column_parallel else in_local * tp_size
        factory = dict(dtype=base.weight.dtype, device=base.weight.device)
        self.linear_in = torch.nn.Linear(in_local, cfg.dim, bias=False, **factory)
        self.linear_out = torch.nn.Linear(cfg.dim, out_local, bias=False, **factory)
        self.scale = cfg.alpha / cfg.dim
        self.dropout = cfg.dropout
        self.column_parallel, self.swiglu = column_parallel, swiglu
        self.tp_group = tp_group
        with torch.no_grad():
            full_a = draw_a(cfg.dim, in_full, cfg.lora_A_init_method, seed)
            if not column_parallel:
                full_a = full_a[:, tp_rank * in_local:(tp_rank + 1) * in_local]
            self.linear_in.weight.copy_(full_a)
            self.linear_out.weight.zero_()
        from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

        # Tensor-parallel shards count once per rank in the grad norm, replicated weights once in all.
        split = self.linear_out.weight if column_parallel else self.linear_in.weight
        set_tensor_model_parallel_attributes(split, is_parallel=tp_size > 1, dim=0 if column_parallel else 1, stride=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        from megatron.core.tensor_parallel.mappings import (
            copy_to_tensor_model_parallel_region,
            reduce_from_tensor_model_parallel_region,
        )

        if self.training and self.dropout:
            x = F.dropout(x, self.dropout)
        h = F.linear(x, self.linear_in.weight)
        if self.tp_group.size() > 1:
            h = (copy_to_tensor_model_parallel_region(h, self.tp_group) if self.column_parallel
                 else reduce_from_tensor_model_parallel_region(h, self.tp_group))
        return F.linear(h, self.linear_out.weight) * self.scale

    def delta_weight(self) -> torch.Tensor:
        """This rank's shard of ``(alpha / dim) * B @ A``, in fp32: what merging adds to the layer's weight."""
        return (self.linear_out.weight.float() @ self.linear_in.weight.float()) * self.scale

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        from megatron.core.transformer.mlp import apply_swiglu_sharded_factory
        from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

        # megatron-core's default groups (tensor parallel, data parallel with context) are the layer's
        axis = {"linear_out.weight": 0} if self.column_parallel else {"linear_in.weight": 1}
        sharded = make_sharded_tensors_for_checkpoint(self.state_dict(prefix="", keep_vars=True), prefix, axis,
                                                      sharded_offsets)
        if self.swiglu:  # B's rows are [gate; up] per rank, as linear_fc1's weight: save them as it is saved
            key = f"{prefix}linear_out.weight"
            sharded[key] = apply_swiglu_sharded_factory(sharded[key], sharded_offsets,
                                                        (metadata or {}).get("singleton_local_shards", False))
        return sharded


class _LoRALayer:
    """Mixed in ahead of a parallel linear layer's class: adds the adapter's output and its sharded state."""

    def forward(self, input_, *args, **kwargs):
        output, bias = super().forward(input_, *args, **kwargs)
        return output + self.adapter(input_), bias

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        # the base class also listed the adapter's weights, as replicated: replace them with their true sharding
        sharded.update(self.adapter.sharded_state_dict(f"{prefix}{ADAPTER}.", sharded_offsets, metadata))
        return sharded


_LORA_CLASSES: dict[type, type] = {}


def _lora_class(base_cls: type) -> type:
    if base_cls not in _LORA_CLASSES:
        _LORA_CLASSES[base_cls] = type(f"LoRA{base_cls.__name__}", (_LoRALayer, base_cls), {"_base_cls": base_cls})
    return _LORA_CLASSES[base_cls]


def add_adapter(module, cfg: LoRAConfig, column_parallel: bool, swiglu: bool, seed: int) -> LoRAAdapter:
    """Give one parallel linear layer (anything with ``weight``, ``tp_group`` and a ``(output, bias)``
    forward) a LoRA adapter, in place."""
    adapter = LoRAAdapter(module, cfg, column_parallel, swiglu, seed)
    module.__class__ = _lora_class(type(module))
    module.add_module(ADAPTER, adapter)
    return adapter


@dataclass
class ParameterCounts:
    trainable: int
    total: int

    def describe(self, cfg: LoRAConfig) -> str:
        share = 100.0 * self.trainable / max(self.total, 1)
        return (f"LoRA (dim {cfg.dim}, alpha {cfg.alpha:g}) on {', '.join(cfg.target_modules)}: "
                f"{self.trainable:,} trainable parameters of {self.total:,} ({share:.2f}%); the base model is frozen")


def apply_lora(model_chunks: list, cfg: LoRAConfig, seed: int) -> ParameterCounts:
    """Freeze every parameter and add a trainable adapter to each targeted layer, in place.

    Call before megatron-core's DDP wrapper and optimizer are built: both take only the
    parameters that require grad. Returns this rank's trainable and total parameter counts.
    """
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.transformer_layer import TransformerLayer

    for chunk in model_chunks:
        chunk.requires_grad_(False)
        for layer in [m for m in chunk.modules() if isinstance(m, TransformerLayer)]:
            for name, module in list(layer.named_modules()):
                _adapt_experts(module, name, layer, cfg, seed)
                if name.rsplit(".", 1)[-1] not in cfg.target_modules:
                    continue
                if not isinstance(module, (ColumnParallelLinear, RowParallelLinear)):
                    raise RuntimeUnavailable(
                        f"peft=lora adapts megatron-core's ColumnParallelLinear/RowParallelLinear layers; "
                        f"{name} of layer {layer.layer_number} is a {type(module).__name__} (the te spec's). "
                        "Set model.spec=torch (or local).")
                column = isinstance(module, ColumnParallelLinear)
                _check_layout(module, name, column)
                swiglu = name.endswith("linear_fc1") and layer.config.gated_linear_unit
                add_adapter(module, cfg, column, swiglu, adapter_seed(seed, layer.layer_number, name))
    params = [p for chunk in model_chunks for p in chunk.parameters()]
    return ParameterCounts(sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params))


def _adapt_experts(module, name: str, layer, cfg: LoRAConfig, seed: int) -> None:
    """MoE layers: grouped-GEMM experts get their adapters here (:mod:`.lora_experts`); the routed
    experts of megatron-core's SequentialMLP (one MLP per expert) and the shared experts take adapters
    like any MLP, the routed ones only without expert parallelism (their adapters would need the
    expert groups' sharding)."""
    from bridge_cli.models.moe_experts import GroupedGemmExperts
    from bridge_cli.peft.lora_experts import add_grouped_adapter

    expert_targets = [t for t in cfg.target_modules if t in ("linear_fc1", "linear_fc2")]
    if not expert_targets or not name.endswith("mlp.experts"):
        return
    if isinstance(module, GroupedGemmExperts):
        add_grouped_adapter(module, cfg, expert_targets, layer.layer_number, seed)
        return
    config = layer.config
    etp = config.expert_tensor_parallel_size or config.tensor_model_parallel_size
    if config.expert_model_parallel_size > 1 or etp != config.tensor_model_parallel_size:
        raise RuntimeUnavailable(
            f"peft=lora on SequentialMLP experts needs model.expert_model_parallel_size=1 and expert TP equal to TP "
            f"(they are {config.expert_model_parallel_size} and {etp}). Set model.moe_grouped_gemm=true (grouped "
            "experts take adapters under expert parallelism), change the layout, or set "
            "peft.target_modules=[linear_qkv,linear_proj].")


def _check_layout(module, name: str, column: bool) -> None:
    """The adapter math assumes the GPT layer layout: column layers keep their output split, row layers
    get their input split, and the sequence is not split."""
    if module.tp_group.size() == 1:
        return
    if module.sequence_parallel or (column and module.gather_output) or (not column and not module.input_is_parallel):
        raise RuntimeUnavailable(f"peft=lora does not support {name}'s tensor-parallel layout "
                                 "(sequence parallel, gathered output or unsplit input).")


def merge_lora(model_chunks: list) -> int:
    """Fold every adapter into its layer's weight (``W + (alpha / dim) B @ A``) and remove it; returns how many."""
    from bridge_cli.peft.lora_experts import is_grouped_with_adapters, merge_grouped

    merged = 0
    for chunk in model_chunks:
        for module in list(chunk.modules()):
            if is_grouped_with_adapters(module):
                merge_grouped(module)
                merged += 1
            elif isinstance(module, _LoRALayer):
                with torch.no_grad():
                    module.weight.copy_((module.weight.float() + module.adapter.delta_weight()).to(module.weight.dtype))
                del module.adapter
                module.__class__ = module._base_cls
                merged += 1
    return merged
