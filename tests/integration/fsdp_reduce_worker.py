"""ddp.grad_reduce_in_fp32 under torch FSDP2, on each rank of a 4-process torchrun job (test_fsdp_reduce_cpu.py).

Builds fp8_fsdp_worker's bf16 GPTModel (no FP8) twice from one seed: one stays whole on this process, the other
bridge wraps as dist.use_torch_fsdp2=true does (:func:`wrap_fsdp`) with ``--fp32-reduce`` as
ddp.grad_reduce_in_fp32. Each rank runs its own tokens through the FSDP2 model; the whole model runs every rank's
tokens, and the reference gradient is the average of those bf16 gradients taken in fp32, rounded to bf16 once. Writes
to ``--out``/rank<N>.json: the reduce dtype each FSDP2 unit was given, how many gradient elements are not that
correctly rounded average (off by more than half a bf16 unit in the last place) and their count.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bridge_cli.runtime.distributed import destroy_distributed, init_distributed
from tests.integration.fp8_fsdp_worker import build, forward_backward, tokens_of


def off_by_more_than_half_an_ulp(grad: torch.Tensor, exact: torch.Tensor) -> int:
    """Elements of the bf16 ``grad`` farther from the fp32 ``exact`` than half a bf16 unit in the last place of it."""
    ulp = (exact.to(torch.bfloat16).float().abs() * 2.0 ** -7).clamp_min(torch.finfo(torch.bfloat16).tiny)
    return int(((grad.float() - exact).abs() > ulp / 2 * (1 + 1e-6)).sum())


def main() -> None:
    from megatron.core.distributed import DistributedDataParallelConfig

    from bridge_cli.runtime.fsdp import wrap_fsdp

    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--fp32-reduce", action="store_true")
    args = parser.parse_args()
    init_distributed("gloo", 2, 1, 1)
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    whole, sharded = build(None), build(None)
    [sharded] = wrap_fsdp([sharded], DistributedDataParallelConfig(grad_reduce_in_fp32=args.fp32_reduce), True,
                          torch.device("cpu"))
    runs = [forward_backward(whole, tokens_of(r))[1] for r in range(world)]
    exact = {name: sum(run[name] for run in runs) / world for name in runs[0]}  # fp32 sums of the bf16 gradients
    _, grads, _ = forward_backward(sharded, tokens_of(rank))
    grads = {name.removeprefix("module."): g for name, g in grads.items()}
    policies = {str(state._mp_policy.reduce_dtype) for state in _fsdp_states(sharded)}
    result = {"reduce_dtypes": sorted(policies), "elements": sum(g.numel() for g in exact.values()),
              "off": sum(off_by_more_than_half_an_ulp(grads[name], exact[name]) for name in exact)}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))
    destroy_distributed()


def _fsdp_states(model):
    from torch.distributed.fsdp import FSDPModule

    return [module._get_fsdp_state() for module in model.modules() if isinstance(module, FSDPModule)]


if __name__ == "__main__":
    main()
