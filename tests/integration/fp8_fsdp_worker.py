"""bridge's FP8 linears under torch FSDP2 against the same model unsharded, on each rank of a 2-process torchrun job.

Used by test_fp8_fsdp_cpu.py. Builds a small bf16 GPTModel with bridge's FP8 spec (``--recipe``: the settings of
mixed_precision=bf16_with_fp8_current_scaling_mixed or bf16_with_fp8_rowwise_mixed) twice from one seed: one stays
whole on this process, the other bridge wraps as dist.use_torch_fsdp2=true does (:func:`wrap_fsdp`). Each rank runs
its own tokens through the FSDP2 model; the whole model runs both ranks' tokens, and its gradients are averaged as
FSDP2's reduce-scatter averages them. Eagerly, then with the layers of both compiled (model.compile_layers, as
``build_model`` compiles them before the wrap). Writes to ``--out``/rank<N>.json, per mode: the largest difference of
the logits and of every gradient (relative to the largest value), whether the logits are bitwise equal, what weight
each FP8 GEMM was handed under FSDP2 (eager: the whole weight, not this rank's shard), the bytes of fp8 and other
tensors the FSDP2 model holds from its forward for its backward, and the graph breaks and graphs compiled.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from bridge_cli.models import fp8_linear
from bridge_cli.models.provider import GPTModelProvider
from bridge_cli.runtime.distributed import destroy_distributed, init_distributed

VOCAB, SEQ, BATCH = 128, 20, 2
"""40 tokens a rank: no activation has a weight's shape, and the weight-gradient GEMMs pad the tokens to 48."""
PRESETS = {"tensorwise": dict(fp8="hybrid", fp8_recipe="tensorwise", first_last_layers_bf16=True),
           "rowwise": dict(fp8="e4m3", fp8_recipe="rowwise")}
"""The model fields of conf/mixed_precision/bf16_with_fp8_{current_scaling,rowwise}_mixed.yaml."""


def build(recipe: str | None):
    """4 layers (the tensor-wise preset keeps the first and last in bf16), bf16 weights as the presets' params_dtype,
    in megatron-core's Float16Module as ``build_model`` wraps them; ``recipe`` None: no FP8 (bf16_mixed's model)."""
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed
    from megatron.core.transformer.module import Float16Module

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    config = GPTModelProvider(
        num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128, vocab_size=VOCAB,
        seq_length=SEQ, position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False,
        gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0, attention_dropout=0.0, spec="torch",
        bf16=True, params_dtype=torch.bfloat16, share_embeddings_and_output_weights=False,
        use_cpu_initialization=True, **(PRESETS[recipe] if recipe else {}))
    return Float16Module(config, config.provide())


def tokens_of(rank: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1 + rank))


def forward_backward(model, tokens, held: list | None = None, weight_shapes=()):
    """Logits, gradients and, with ``held`` (which gets every tensor the forward saves for the backward), the bytes
    held between the forward and the backward (:func:`bytes_held`)."""
    model.zero_grad()
    hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: held.append(t) or t, lambda t: t) if held is not None \
        else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t)
    with hooks:
        logits = model(tokens, torch.arange(SEQ).expand(BATCH, SEQ), None)
    held_bytes = bytes_held(held, weight_shapes) if held is not None else None
    logits.float().square().mean().backward()
    grads = {name: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad).float()
             for name, p in model.named_parameters()}
    return logits.detach().float(), grads, held_bytes


def bytes_held(saved: list, weight_shapes) -> dict:
    """Bytes of the storages behind the saved tensors that are still allocated once the forward is done (FSDP2 has
    freed the gathered weights of every layer by then: their storages are empty): fp8 copies of the FP8 linears'
    whole weights, other fp8 tensors (the inputs' casts), and the rest."""
    storages = {}
    for t in saved:
        storage = t.untyped_storage()
        if storage.nbytes():
            fp8 = t.dtype.itemsize == 1 and t.is_floating_point()
            kind = ("fp8_weights" if list(t.shape) in weight_shapes else "fp8_other") if fp8 else "other"
            storages[storage.data_ptr()] = (storage.nbytes(), kind)
    return {kind: sum(n for n, k in storages.values() if k == kind) for kind in ("fp8_weights", "fp8_other", "other")}


def gemm_weights(record: list):
    """Patch the FP8 linears' GEMM entry to note what weight each call gets: a DTensor, and its shape."""
    real = fp8_linear.fp8_linear

    def noting(x, weight, bias, scaling):
        record.append({"dtensor": isinstance(weight, DTensor), "shape": list(weight.shape)})
        return real(x, weight, bias, scaling)

    fp8_linear.fp8_linear = noting
    return real


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def compare(recipe: str, compiled: bool) -> dict:
    from megatron.core.distributed import DistributedDataParallelConfig
    from torch._dynamo.utils import counters

    from bridge_cli.models.regional_compile import compile_layers
    from bridge_cli.runtime.fsdp import wrap_fsdp

    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    whole, sharded = build(recipe), build(recipe)
    fp8_shapes = sorted(list(m.weight.shape) for m in sharded.modules() if isinstance(m, fp8_linear._Fp8Gemm))
    if compiled:
        compile_layers([whole])
        compile_layers([sharded])
    [sharded] = wrap_fsdp([sharded], DistributedDataParallelConfig(), True, torch.device("cpu"))

    runs = [forward_backward(whole, tokens_of(r)) for r in range(world)]
    logits = runs[rank][0]
    grads = {name: sum(run[1][name] for run in runs) / world for name in runs[0][1]}
    graphs_before = counters["stats"]["unique_graphs"]

    seen, held = [], []
    real = gemm_weights(seen) if not compiled else None
    try:
        fsdp_logits, fsdp_grads, held_bytes = forward_backward(sharded, tokens_of(rank), held, fp8_shapes)
    finally:
        if real is not None:
            fp8_linear.fp8_linear = real
    fsdp_grads = {name.removeprefix("module."): g for name, g in fsdp_grads.items()}
    return {
        "logits": relative(fsdp_logits, logits), "logits_bitwise": torch.equal(fsdp_logits, logits),
        "grads": {name: relative(fsdp_grads[name], grads[name]) for name in grads},
        "missing": sorted(set(grads) ^ set(fsdp_grads)),
        "sharded": all(isinstance(p, DTensor) for p in sharded.parameters()),
        "fp8_weight_shapes": fp8_shapes, "gemm_weights": seen, "held": held_bytes,
        "fp8_weight_bytes": sum(r * c for r, c in fp8_shapes),
        "graph_breaks": sum(counters["graph_break"].values()),
        "graphs_compiled_for_fsdp2": counters["stats"]["unique_graphs"] - graphs_before,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--recipe", choices=sorted(PRESETS), default="tensorwise")
    args = parser.parse_args()
    init_distributed("gloo", 2, 1, 1)
    result = {"eager": compare(args.recipe, compiled=False), "compiled": compare(args.recipe, compiled=True)}
    (args.out / f"rank{torch.distributed.get_rank()}.json").write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
