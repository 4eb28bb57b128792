"""LoRA on grouped-GEMM experts (:class:`~bridge_cli.models.moe_experts.GroupedGemmExperts`).

Each local expert gets the adapter a ``SequentialMLP`` expert's linear layer gets (:mod:`.lora`):
A (``dim x in``) and B (``out x dim``) per targeted projection, stacked over the local experts
(``[experts, dim, in]``, ``[experts, out, dim]``), run as grouped GEMMs next to the expert weights.
An expert's A is drawn from the seed ``SequentialMLP``'s adapter of the same global expert draws,
so grouped and per-expert LoRA start alike, at any expert-parallel size; B starts at zero.

Checkpoints hold the adapters under ``SequentialMLP``'s keys and global shapes
(``<layer>.mlp.experts.experts.linear_fc1.adapter.linear_in.weight``, ``[experts, dim, in]`` with the
expert axis split over expert-parallel ranks), so adapters move between grouped and per-expert
experts and across EP sizes. Expert tensor parallelism is not supported (its B would need
linear_fc1's split halves).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bridge_cli.config.peft_config import LoRAConfig
from bridge_cli.models.moe_experts import GroupedGemmExperts, grouped_linear
from bridge_cli.peft.lora_init import adapter_seed, draw_a
from bridge_cli.runtime.errors import RuntimeUnavailable

EXPERT_LINEARS = ("linear_fc1", "linear_fc2")


class GroupedLoRAAdapter(torch.nn.Module):
    """``(alpha / dim) * B_e A_e dropout(x)`` for each local expert ``e``, per targeted projection."""

    def __init__(self, experts: GroupedGemmExperts, cfg: LoRAConfig, targets: list[str], seed_of):
        super().__init__()
        first = experts.ep_group.rank() * experts.num_local_experts
        shapes = {"linear_fc1": experts.weight1.shape[1:], "linear_fc2": experts.weight2.shape[1:]}
        factory = dict(dtype=experts.weight1.dtype, device=experts.weight1.device)
        self.scale, self.dropout, self.targets = cfg.alpha / cfg.dim, cfg.dropout, list(targets)
        for linear in self.targets:
            out_features, in_features = shapes[linear]
            a = torch.stack([draw_a(cfg.dim, in_features, cfg.lora_A_init_method, seed_of(first + e, linear))
                             for e in range(experts.num_local_experts)])
            a_param = torch.nn.Parameter(a.to(**factory))
            b_param = torch.nn.Parameter(torch.zeros(experts.num_local_experts, out_features, cfg.dim, **factory))
            for param in (a_param, b_param):  # reduced as the expert weights are (over expert data parallel)
                param.allreduce = experts.weight1.allreduce
            self.register_parameter(f"{linear}_in", a_param)
            self.register_parameter(f"{linear}_out", b_param)

    def delta(self, linear: str, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        if self.training and self.dropout:
            x = F.dropout(x, self.dropout)
        h = grouped_linear(x, getattr(self, f"{linear}_in"), tokens_per_expert)
        return grouped_linear(h, getattr(self, f"{linear}_out"), tokens_per_expert) * self.scale

    def delta_weight(self, linear: str) -> torch.Tensor:
        """``(alpha / dim) * B_e @ A_e`` per local expert, in fp32: what merging adds to the expert weights."""
        return torch.bmm(getattr(self, f"{linear}_out").float(), getattr(self, f"{linear}_in").float()) * self.scale


class _LoRAGroupedExperts:
    """Mixed in ahead of GroupedGemmExperts: adds the adapters' outputs and their sharded state."""

    def project(self, linear: str, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        out = super().project(linear, x, tokens_per_expert)
        if linear in self.adapter.targets:
            out = out + self.adapter.delta(linear, x, tokens_per_expert).to(out.dtype)
        return out

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata=None) -> dict:
        from megatron.core.dist_checkpointing.mapping import ShardedTensor

        sharded = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        prepend = len(sharded_offsets)
        expert_axis = (prepend, self.ep_group.rank(), self.ep_group.size())
        for linear in self.adapter.targets:
            for own, saved in (("in", "linear_in"), ("out", "linear_out")):
                tensor = getattr(self.adapter, f"{linear}_{own}")
                sharded[f"{prefix}adapter.{linear}_{own}"] = ShardedTensor.from_rank_offsets(
                    f"{prefix}experts.{linear}.adapter.{saved}.weight", tensor, *sharded_offsets, expert_axis,
                    replica_id=(0, 0, self.dp_group.rank()), prepend_axis_num=prepend)
        return sharded


_CLASS = type("LoRAGroupedGemmExperts", (_LoRAGroupedExperts, GroupedGemmExperts), {})


def add_grouped_adapter(experts: GroupedGemmExperts, cfg: LoRAConfig, targets: list[str], layer_number: int,
                        seed: int) -> GroupedLoRAAdapter:
    """Give every local expert of one MoE layer its LoRA adapters, in place."""
    if experts.tp_group.size() > 1:
        raise RuntimeUnavailable(f"peft=lora on grouped-GEMM experts needs expert tensor parallelism 1 (layer "
                                 f"{layer_number} splits its experts over {experts.tp_group.size()} ranks). Set "
                                 "model.expert_tensor_parallel_size=1, or model.moe_grouped_gemm=false.")

    def seed_of(expert: int, linear: str) -> int:
        # the seed SequentialMLP's adapter of this (global) expert draws A from
        return adapter_seed(seed, layer_number, f"mlp.experts.local_experts.{expert}.{linear}")

    adapter = GroupedLoRAAdapter(experts, cfg, targets, seed_of)
    experts.__class__ = _CLASS
    experts.add_module("adapter", adapter)
    return adapter


def merge_grouped(experts) -> None:
    """Fold a LoRAGroupedGemmExperts' adapters into its expert weights and make it plain again."""
    with torch.no_grad():
        for linear, weight in (("linear_fc1", experts.weight1), ("linear_fc2", experts.weight2)):
            if linear in experts.adapter.targets:
                weight.copy_((weight.float() + experts.adapter.delta_weight(linear)).to(weight.dtype))
    del experts.adapter
    experts.__class__ = GroupedGemmExperts


def is_grouped_with_adapters(module) -> bool:
    return isinstance(module, _LoRAGroupedExperts)
