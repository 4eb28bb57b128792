"""Train a tiny GPTModel with megatron-core's distributed optimizer on the CPU, saving or resuming through bridge's
checkpoint code; run under torchrun (gloo). Used by test_distributed_optimizer_layouts.py.

megatron-core's DistributedOptimizer is CUDA-bound only in where it puts two tensors and how it names dtypes:
``MixedPrecisionOptimizer`` allocates its overflow flag with ``device='cuda'`` and the optimizer sorts the model's
weights by ``param.type() == 'torch.cuda.FloatTensor'``. :func:`run_on_the_cpu` redirects those two (the rest of
the CPU redirections are bridge's own, runtime/cpu_patches.py), so the optimizer shards its state over gloo as on
the GPU: its reduce-scatter of gradients, all-gather of weights, Adam step on the main-weight shards, and its
sharded state dicts for saving and loading all run for real. Steps go through the members'
``prepare_grads`` and ``step_with_ready_grads`` (megatron-core's own step less the grad norm, whose CUDA
kernels have no CPU fallback; clip_grad is 0, so no clip is skipped).

A dense layout starts from the same weights (runtime_worker.init_by_global_name); every run trains on the same
fixed tokens, each data-parallel rank taking its share. ``--save-at N`` saves iteration N into ``--ckpt`` through
bridge's CheckpointManager (as a run saves: spread over the data-parallel ranks) and trains on; ``--resume`` loads
the newest checkpoint there (bridge_cli.checkpoint.load) and trains on to ``--steps``. The last rank writes the
losses and the lines bridge's load printed to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

from bridge_cli.checkpoint import layout, load
from bridge_cli.checkpoint.manager import CheckpointManager
from bridge_cli.checkpoint.train_state import TrainState
from bridge_cli.runtime.cpu_patches import _TorchOnCPU, apply_cpu_patches
from bridge_cli.runtime.ddp import configure_grad_sync, wrap_model
from bridge_cli.runtime.distributed import destroy_distributed, init_distributed
from bridge_cli.runtime.schedules import get_forward_backward_func
from tests.integration.runtime_worker import MICRO_BATCH, SEQ, VOCAB, build_model, forward_step

MICRO_BATCHES = 4
EXPERTS = 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=0, help="expert parallel size of an MoE model (0: dense)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-at", type=int, default=0)
    parser.add_argument("--resume", action="store_true")
    parser.add_argument("--sharding", default="fully_reshardable", choices=["fully_reshardable", "dp_reshardable"],
                        help="how to save the optimizer: fully_reshardable sets checkpoint.dist_ckpt_optim_fully_reshardable")
    parser.add_argument("--mem-efficient", action="store_true",
                        help="checkpoint.distrib_optim_fully_reshardable_mem_efficient")
    args = parser.parse_args()

    runtime = init_distributed("gloo", 2, args.tp, args.pp, expert_model_parallel_size=max(args.ep, 1))
    run_on_the_cpu()
    model = build_moe_model(args.ep) if args.ep else build_model(args.tp, args.pp)
    chunks = wrap_model([model], DistributedDataParallelConfig(use_distributed_optimizer=True))
    adam = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=0.0,
                           use_distributed_optimizer=True)
    optimizer = get_megatron_optimizer(adam, chunks)
    configure_grad_sync(chunks, optimizer)
    run = {"model": {"tensor_model_parallel_size": args.tp, "pipeline_model_parallel_size": args.pp,
                     "virtual_pipeline_model_parallel_size": None, "num_moe_experts": EXPERTS if args.ep else None,
                     "expert_model_parallel_size": max(args.ep, 1)},
           "optimizer": {"use_distributed_optimizer": True}}
    train_state, said = TrainState(), io.StringIO()
    if args.resume:
        with contextlib.redirect_stdout(said):
            load._load(bridge_state(run, train_state), chunks, optimizer, None,
                       layout.find_checkpoint(args.ckpt).path, weights_only=False)

    forward_backward = get_forward_backward_func(runtime)
    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES, MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    local = tokens.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    losses = []
    while train_state.step < args.steps:
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = forward_backward(forward_step_func=forward_step, data_iterator=iter(local), model=chunks,
                                   num_microbatches=len(local), seq_length=SEQ, micro_batch_size=MICRO_BATCH,
                                   forward_only=False)
        for member in optimizer.chained_optimizers:
            member.prepare_grads()
            member.step_with_ready_grads()
        train_state.step += 1
        if outputs:
            summed = torch.stack([out["lm loss"] for out in outputs]).sum(0)
            torch.distributed.all_reduce(summed, group=ps.get_data_parallel_group())
            losses.append((summed[0] / summed[1]).item())
        if train_state.step == args.save_at:
            saver = CheckpointManager(
                SimpleNamespace(save=str(args.ckpt), save_optim=True, save_rng=False, async_save=False,
                                most_recent_k=-1, fully_parallel_save=True, ckpt_assume_constant_structure=False,
                                dist_ckpt_optim_fully_reshardable=args.sharding == "fully_reshardable",
                                distrib_optim_fully_reshardable_mem_efficient=args.mem_efficient),
                model=chunks, optimizer=optimizer, scheduler=None, train_state=train_state, run_record=run,
                use_distributed_optimizer=True, is_cuda=False, world_size=runtime.world_size, seq_length=SEQ)
            saver.save()
            saver.close()
    if runtime.rank == runtime.world_size - 1:  # the rank that prints bridge's log, on the last pipeline stage
        args.out.write_text(json.dumps({"loss": losses, "log": said.getvalue()}))
    destroy_distributed()


def build_moe_model(ep: int) -> torch.nn.Module:
    """A 2-layer MoE GPTModel (4 experts, top 2, bridge's provider) whose experts are spread over ``ep`` ranks,
    megatron-core's initialization: the tests compare a resumed run with the uninterrupted one of the layout that
    saved it."""
    from bridge_cli.models.provider import GPTModelProvider

    return GPTModelProvider(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB, seq_length=SEQ,
        make_vocab_size_divisible_by=128, position_embedding_type="rope", normalization="RMSNorm",
        add_bias_linear=False, gated_linear_unit=True, activation_func=torch.nn.functional.silu, hidden_dropout=0.0,
        attention_dropout=0.0, spec="torch", num_moe_experts=EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=64,
        moe_token_dispatcher_type="alltoall", moe_aux_loss_coeff=1e-2, moe_grouped_gemm=True,
        use_cpu_initialization=True, expert_model_parallel_size=ep).provide()


def run_on_the_cpu() -> None:
    """bridge's CPU redirections, and the distributed optimizer's two CUDA-bound spots (see the module's text)."""
    from megatron.core.optimizer import distrib_optimizer, optimizer

    apply_cpu_patches()
    optimizer.torch = distrib_optimizer.torch = _TorchOnCPU(torch)
    type_name = torch.Tensor.type

    def as_on_cuda(tensor, *args, **kwargs):
        name = type_name(tensor, *args, **kwargs)
        return name.replace("torch.", "torch.cuda.", 1) if not args and not kwargs and "cuda" not in name else name

    torch.Tensor.type = as_on_cuda


def bridge_state(run: dict, train_state: TrainState) -> SimpleNamespace:
    """What bridge_cli.checkpoint.load reads of a run: its checkpoint, optimizer and model settings."""
    checkpoint = SimpleNamespace(load_optim=True, load_rng=False, dist_ckpt_strictness="assume_ok_unexpected",
                                 load_main_params_from_ckpt=False,
                                 fully_parallel_load=False)
    model = SimpleNamespace(**run["model"])
    cfg = SimpleNamespace(checkpoint=checkpoint, optimizer=SimpleNamespace(use_distributed_optimizer=True),
                          model=model, derived=SimpleNamespace(model=model))
    return SimpleNamespace(cfg=cfg, train_state=train_state, runtime=SimpleNamespace(is_cuda=False))


if __name__ == "__main__":
    main()
    os._exit(0)
