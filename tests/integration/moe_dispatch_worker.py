"""bridge's token dispatcher against megatron-core's under expert parallelism, on each rank of a torchrun job.

Used by test_moe_dispatch_parallel.py. Builds the same small fp32 MoE model twice (CPU initialization draws
every expert alike at any layout), once with bridge's :class:`DeviceTokenDispatcher` and once with
megatron-core's dispatcher of the same name put back, runs a forward and backward on this rank's own tokens,
and writes the largest differences of the logits and of every parameter's gradient to ``--out``/rank<N>.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core import parallel_state as ps

from bridge_cli.models.provider import GPTModelProvider
from bridge_cli.runtime.distributed import destroy_distributed, init_distributed

VOCAB, SEQ, BATCH = 128, 16, 2


def build(args, sequence_parallel: bool, **fields):
    """The workers' 2-layer MoE model under ``args``' layout; ``fields`` set more of its provider's fields."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    if "moe_token_dispatcher_type" not in fields:
        fields["moe_token_dispatcher_type"] = args.dispatcher
    return GPTModelProvider(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=VOCAB, seq_length=SEQ,
        make_vocab_size_divisible_by=128, position_embedding_type="rope", normalization="RMSNorm",
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0,
        spec="torch", num_moe_experts=8, moe_router_topk=args.topk, moe_ffn_hidden_size=32,
        moe_aux_loss_coeff=1e-2, moe_grouped_gemm=True, moe_expert_capacity_factor=args.capacity,
        use_cpu_initialization=True, tensor_model_parallel_size=args.tp, sequence_parallel=sequence_parallel,
        expert_model_parallel_size=args.ep, expert_tensor_parallel_size=args.etp, **fields).provide()


def with_megatron_dispatchers(model, dispatcher: str):
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.moe import token_dispatcher

    cls = {"alltoall": token_dispatcher.MoEAlltoAllTokenDispatcher,
           "allgather": token_dispatcher.MoEAllGatherTokenDispatcher}[dispatcher]
    groups = ProcessGroupCollection.use_mpu_process_groups()
    for layer in model.decoder.layers:
        layer.mlp.token_dispatcher = cls(layer.mlp.num_local_experts, layer.mlp.local_expert_indices,
                                         config=layer.mlp.config, pg_collection=groups)
    return model


def forward_backward(model):
    # each data-parallel rank its own tokens; tensor-parallel ranks the same ones
    seed = 1 + ps.get_data_parallel_rank()
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))
    model.zero_grad()
    logits = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)
    logits.float().square().mean().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def arguments() -> argparse.ArgumentParser:
    """The worker's output file and the layout and routing that :func:`build` reads."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=2)
    parser.add_argument("--etp", type=int, default=1)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--capacity", type=float, default=None, help="moe_expert_capacity_factor (pairs dropped)")
    return parser


def main() -> None:
    parser = arguments()
    parser.add_argument("--dispatcher", default="alltoall")
    args = parser.parse_args()
    init_distributed("gloo", 2, args.tp, 1, expert_model_parallel_size=args.ep, expert_tensor_parallel_size=args.etp)
    ours = build(args, args.tp > 1)
    dispatchers = {type(layer.mlp.token_dispatcher).__name__ for layer in ours.decoder.layers}
    logits, grads = forward_backward(ours)
    theirs = with_megatron_dispatchers(build(args, args.tp > 1), args.dispatcher)
    their_logits, their_grads = forward_backward(theirs)
    result = {"dispatchers": sorted(dispatchers), "logits": relative(logits, their_logits),
              "reference": sorted({type(layer.mlp.token_dispatcher).__name__ for layer in theirs.decoder.layers}),
              "grads": {name: relative(grads[name], their_grads[name]) for name in their_grads},
              "missing": sorted(set(their_grads) ^ set(grads))}
    (args.out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
