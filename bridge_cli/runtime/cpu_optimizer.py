"""megatron-core's fp32 optimizer wrappers with their CUDA-bound parts made device-agnostic.

``FP32Optimizer`` and ``ChainedOptimizer`` keep the loss scale on ``cuda`` and reduce grad
norms and zero counts through ``clip_grads``' ``cuda`` tensors. These subclasses override only
that: state dicts, ``dist_checkpointing`` sharded state, param groups and the inner
``torch.optim`` step stay megatron-core's own. :mod:`bridge_cli.runtime.cpu_patches` binds them
in ``megatron.core.optimizer`` so ``get_megatron_optimizer`` builds them on a CPU-only machine.

The reductions follow megatron-core's rules: grads come from the optimizer's own filter (no
shared or tensor-parallel duplicate params, so each replicated weight counts once) and are
summed over its grad-stats group, the model-parallel group (TP x PP). Every rank of that group
then sees the same norm and clips by the same factor, which keeps replicated weights such as
norms identical across TP ranks.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core.optimizer.optimizer import ChainedOptimizer, FP32Optimizer, MegatronOptimizer


class CPUFP32Optimizer(FP32Optimizer):
    """``FP32Optimizer`` whose loss scale, grad norm, clipping and zero count run on the CPU."""

    def __init__(self, optimizer, config, init_state_fn):
        MegatronOptimizer.__init__(self, optimizer, config, init_state_fn)
        self._scale = torch.ones(1)
        self.is_stub_optimizer = optimizer is None

    def grads_for_norm(self) -> list[torch.Tensor]:
        """Grads that count toward the norm, by megatron-core's own filter."""
        # Renamed to get_grads_for_grad_norm in megatron-core 0.17.
        getter = getattr(self, "get_grads_for_grad_norm", None) or self.get_main_grads_for_grad_norm
        return getter()

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        return grad_norm_fp32(self.grads_for_norm(), self.get_grad_stats_parallel_group())

    @torch.no_grad()
    def clip_grad_norm(self, clip_grad: float) -> float:
        norm = self.get_grad_norm()
        clip_grads_by_total_norm(self.get_parameters(), clip_grad, norm)
        return norm

    @torch.no_grad()
    def count_zeros(self) -> int:
        return count_zeros_fp32(self.grads_for_norm(), self.get_grad_stats_parallel_group())


class CPUChainedOptimizer(ChainedOptimizer):
    """``ChainedOptimizer`` (what ``get_megatron_optimizer`` returns) with a CPU ``step``."""

    def get_loss_scale(self) -> torch.Tensor:
        if self.chained_optimizers:
            return self.chained_optimizers[0].get_loss_scale()
        return torch.ones(1)

    @torch.no_grad()
    def get_grad_norm(self) -> float:
        # Each member reduces over its own group (experts use the expert group), so the global
        # norm is the root of the summed squares, whether or not the groups coincide.
        return math.sqrt(sum(opt.get_grad_norm() ** 2 for opt in self.chained_optimizers))

    @torch.no_grad()
    def count_zeros(self) -> int:
        return sum(opt.count_zeros() for opt in self.chained_optimizers)

    @torch.no_grad()
    def step(self) -> tuple[bool, float | None, int | None]:
        """Same contract as megatron-core: ``(update_successful, grad_norm, num_zeros_in_grad)``."""
        if self.prepare_grads():
            return False, None, None
        norm = self.get_grad_norm()
        for opt in self.chained_optimizers:
            if not opt.is_stub_optimizer and opt.config.clip_grad > 0.0:
                clip_grads_by_total_norm(opt.get_parameters(), opt.config.clip_grad, norm)
        num_zeros = self.count_zeros() if self.config.log_num_zeros_in_grad else None
        # megatron-core 0.17+ skips the update when the norm passes this threshold.
        if norm > getattr(self.config, "grad_norm_skip_threshold", math.inf):
            return False, norm, num_zeros
        return self.step_with_ready_grads(), norm, num_zeros


def grad_norm_fp32(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> float:
    """L2 norm of ``grads`` summed over ``group``; every rank of the group gets the same value.

    Under torch FSDP2 the grads are DTensors, each rank holding a shard: their squares are summed over the
    data-parallel group first, as megatron-core's ``get_grad_norm_fp32`` does.
    """
    grads, shard_group = _local_shards(grads)
    total = torch.zeros(1, dtype=torch.float32)
    for grad in grads:
        total += grad.detach().float().pow(2).sum()
    if shard_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=shard_group)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return total.sqrt().item()


def _local_shards(grads: list[torch.Tensor]) -> tuple[list[torch.Tensor], dist.ProcessGroup | None]:
    """Each grad's local part, and the group its DTensors are sharded over (None: plain tensors)."""
    from megatron.core.utils import get_data_parallel_group_if_dtensor, to_local_if_dtensor

    shard_group = None
    for grad in grads:
        shard_group = get_data_parallel_group_if_dtensor(grad, shard_group)
    return [to_local_if_dtensor(grad) for grad in grads], shard_group


def clip_grads_by_total_norm(params: list[torch.nn.Parameter], max_norm: float, total_norm: float):
    """Scale every grad by ``max_norm / total_norm`` when the norm is above ``max_norm``."""
    coeff = max_norm / (total_norm + 1.0e-6)
    if coeff < 1.0:
        for param in params:
            if param.grad is not None:
                param.grad.detach().mul_(coeff)


def count_zeros_fp32(grads: list[torch.Tensor], group: dist.ProcessGroup | None) -> int:
    """Number of zero entries in ``grads``, summed over ``group`` (and over the shards of FSDP2's DTensors)."""
    grads, shard_group = _local_shards(grads)
    total = torch.zeros(1, dtype=torch.int64)
    for grad in grads:
        total += grad.numel() - torch.count_nonzero(grad)
    if shard_group is not None:
        dist.all_reduce(total, op=dist.ReduceOp.SUM, group=shard_group)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=group)
    return int(total.item())
