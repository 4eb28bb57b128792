"""Train a tiny GPTModel through bridge_cli.runtime; run alone or under torchrun.

Used by test_runtime_cpu.py. Every layout starts from the same weights and trains 20 steps of
Adam on the same fixed random tokens, each data-parallel rank taking its share of the batch.
The last pipeline stage's first rank writes ``curve.json`` (global loss and grad norm per step);
every rank writes the replicated norm weights it ends with to ``norms.rank<N>.pt``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import zlib
from pathlib import Path

import torch
from megatron.core import parallel_state as ps
from megatron.core.distributed import DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.optimizer import OptimizerConfig
from megatron.core.transformer.transformer_config import TransformerConfig

from bridge_cli.models.specs import layer_spec
from bridge_cli.runtime.ddp import configure_grad_sync, wrap_model
from bridge_cli.runtime.distributed import destroy_distributed, init_distributed
from bridge_cli.runtime.optimizer import build_optimizer
from bridge_cli.runtime.schedules import get_forward_backward_func

VOCAB, SEQ, MICRO_BATCH, MICRO_BATCHES = 128, 32, 2, 4


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()

    runtime = init_distributed("gloo", 2, args.tp, args.pp)
    model = build_model(args.tp, args.pp)
    chunks = wrap_model([model], DistributedDataParallelConfig())
    adam = OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01, clip_grad=1.0)
    optimizer = build_optimizer(adam, chunks, runtime)
    configure_grad_sync(chunks, optimizer)
    forward_backward = get_forward_backward_func(runtime)

    tokens = torch.randint(0, VOCAB, (MICRO_BATCHES, MICRO_BATCH, SEQ + 1), generator=torch.Generator().manual_seed(0))
    local = tokens.chunk(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
    losses, grad_norms = [], []
    for _ in range(args.steps):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        outputs = forward_backward(
            forward_step_func=forward_step,
            data_iterator=iter(local),
            model=chunks,
            num_microbatches=len(local),
            seq_length=SEQ,
            micro_batch_size=MICRO_BATCH,
            forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        grad_norms.append(grad_norm)
        if outputs:
            summed = torch.stack([out["lm loss"] for out in outputs]).sum(0)
            torch.distributed.all_reduce(summed, group=ps.get_data_parallel_group())
            losses.append((summed[0] / summed[1]).item())

    norms = {name: p.detach().clone() for name, p in model.named_parameters() if "layernorm" in name}
    torch.save(norms, args.out / f"norms.rank{runtime.rank}.pt")
    writes_curve = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    if ps.is_pipeline_last_stage() and writes_curve:
        (args.out / "curve.json").write_text(json.dumps({"loss": losses, "grad_norm": grad_norms}))
    destroy_distributed()


def build_model(tp: int, pp: int) -> torch.nn.Module:
    """The 2-layer Llama-style GPTModel (this rank's stage and shard), torch layer spec."""
    config = TransformerConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        pipeline_dtype=torch.float32,
        use_cpu_initialization=True,
    )
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec("torch", config),
        vocab_size=VOCAB,
        max_sequence_length=SEQ,
        position_embedding_type="rope",
        pre_process=ps.is_pipeline_first_stage(),
        post_process=ps.is_pipeline_last_stage(),
    )
    init_by_global_name(model)
    return model


def forward_step(data_iterator, model):
    batch = next(data_iterator)
    position_ids = torch.arange(SEQ).expand(batch.shape[0], SEQ)
    output = model(batch[:, :-1], position_ids, None, labels=batch[:, 1:])

    def loss_func(per_token_loss: torch.Tensor):
        total, count = per_token_loss.float().sum(), torch.ones_like(per_token_loss).sum().int()
        return total, count, {"lm loss": torch.stack([total.detach(), count.float()])}

    return output, loss_func


def init_by_global_name(model: torch.nn.Module) -> None:
    """Draw every matrix from a seed of its global name, so every parallel layout starts equal.

    megatron-core's initialisation depends on which layers a pipeline stage builds. Here each
    weight is drawn whole from its global name (``layer_number`` is global and 1-based; the last
    stage's copy of the tied output weight takes the embedding's name) and this rank keeps its
    tensor-parallel shard, cut the way megatron-core cuts it (``partition_stride`` chunks dealt
    round-robin, as for SwiGLU's interleaved gate and up halves).
    """
    tp_rank, tp_size = ps.get_tensor_model_parallel_rank(), ps.get_tensor_model_parallel_world_size()
    local_to_global = {
        f"decoder.layers.{i}.": f"decoder.layers.{layer.layer_number - 1}."
        for i, layer in enumerate(model.decoder.layers)
    }
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() < 2:
                continue
            global_name = re.sub(r"decoder\.layers\.\d+\.", lambda m: local_to_global[m.group(0)], name)
            global_name = global_name.replace("output_layer.weight", "embedding.word_embeddings.weight")
            generator = torch.Generator().manual_seed(zlib.crc32(global_name.encode()))
            shape = list(param.shape)
            sharded = getattr(param, "tensor_model_parallel", False)
            if sharded:
                shape[param.partition_dim] *= tp_size
            weight = torch.randn(shape, generator=generator) * 0.02
            if sharded:
                chunk = param.shape[param.partition_dim] // param.partition_stride
                pieces = weight.split(chunk, dim=param.partition_dim)
                weight = torch.cat(pieces[tp_rank::tp_size], dim=param.partition_dim)
            param.copy_(weight)


if __name__ == "__main__":
    main()
    # Tearing down an interpreter with megatron-core loaded takes seconds; nothing is left to flush.
    os._exit(0)
