"""`bridge ARGS` with megatron-core's distributed optimizer on the CPU; run under torchrun (gloo). Used by
test_param_gather_overlap_cpu.py.

A CPU run refuses ``optimizer.use_distributed_optimizer=true`` (runtime/device_rules.py): megatron-core's
DistributedOptimizer is CUDA-bound in the two spots distributed_optimizer_worker.run_on_the_cpu redirects, and its
gradient norm builds CUDA tensors. Here those are redirected (the norm and zero count to bridge's CPU ones,
runtime/cpu_optimizer.py) and the refusal lifted, so ``bridge pretrain`` runs the distributed optimizer's
reduce-scatters and all-gathers, overlapped or not (``ddp.overlap_grad_reduce``, ``ddp.overlap_param_gather``),
through its own training loop over gloo.
"""

from __future__ import annotations

import sys

import torch
from megatron.core.optimizer import get_megatron_optimizer
from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

from bridge_cli.cli.app import main
from bridge_cli.runtime import device_rules
from bridge_cli.runtime import optimizer as bridge_optimizer
from bridge_cli.runtime.cpu_optimizer import CPUFP32Optimizer
from tests.integration.distributed_optimizer_worker import run_on_the_cpu


def allow_the_distributed_optimizer_on_the_cpu() -> None:
    run_on_the_cpu()
    DistributedOptimizer.grads_for_norm = CPUFP32Optimizer.grads_for_norm
    DistributedOptimizer.get_grad_norm = CPUFP32Optimizer.get_grad_norm
    DistributedOptimizer.count_zeros = CPUFP32Optimizer.count_zeros
    device_rules.CUDA_ONLY = tuple(rule for rule in device_rules.CUDA_ONLY
                                   if rule[0] != "optimizer.use_distributed_optimizer=true")
    # bridge's CPU build refuses members other than its CPU wrappers; megatron-core's own build is the GPU one's
    bridge_optimizer.build_optimizer = lambda config, chunks, runtime: get_megatron_optimizer(
        config, chunks, use_gloo_process_groups=runtime.gloo_groups)


if __name__ == "__main__":
    assert not torch.cuda.is_available(), "for CPU runs: a GPU run takes optimizer.use_distributed_optimizer as is"
    allow_the_distributed_optimizer_on_the_cpu()
    sys.argv = ["bridge", *sys.argv[1:]]
    main()
