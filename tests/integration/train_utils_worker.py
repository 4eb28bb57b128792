"""Exercise train_utils' model-parallel reductions and model hooks on real process groups and models.

``reductions`` runs under torchrun with 2 processes as two pipeline stages (so the model-parallel
and pipeline groups both hold both ranks); ``hooks`` runs in one process. Rank 0 writes what it
saw to ``--out`` as JSON for test_train_utils.py to check.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

from bridge_cli.runtime.distributed import destroy_distributed, init_distributed


def reductions() -> dict:
    from megatron.core import parallel_state as ps

    from bridge_cli.training.utils.train_utils import (
        logical_and_across_model_parallel_group,
        reduce_max_memory_across_pp_group,
        reduce_max_stat_across_model_parallel_group,
    )

    init_distributed("gloo", 2, 1, 2)
    rank, mp, pp = dist.get_rank(), ps.get_model_parallel_group(), ps.get_pipeline_model_parallel_group()
    memory = {"memory/peak_allocated_mem": [5.5, 2.25][rank], "memory/alloc_retries": [1, 3][rank]}
    result = {
        "max_one_none": reduce_max_stat_across_model_parallel_group(None if rank == 0 else 3.5, mp),
        "max_all_none": reduce_max_stat_across_model_parallel_group(None, mp),
        "max_negative": reduce_max_stat_across_model_parallel_group(-float(rank + 1), mp),
        "and_mixed": logical_and_across_model_parallel_group(rank == 0, mp),
        "and_all": logical_and_across_model_parallel_group(True, mp),
        "memory": reduce_max_memory_across_pp_group(memory, pp),
        "memory_empty": reduce_max_memory_across_pp_group({}, pp),
    }
    result["memory_types"] = {k: type(v).__name__ for k, v in result["memory"].items()}
    return result


def tiny_model(*overrides: str):
    from bridge_cli.config.compose import compose
    from bridge_cli.training.config import ConfigContainer

    cfg = ConfigContainer.from_yaml_dict(compose("tiny", list(overrides)))
    cfg.model.use_cpu_initialization = True
    return cfg, cfg.model.provide(pre_process=True, post_process=True)


def hooks() -> dict:
    from megatron.core.transformer.moe.router import Router

    from bridge_cli.training.utils.train_utils import LinearForLastLayer, freeze_moe_router, make_value_model

    init_distributed("gloo", 2, 1, 1)
    torch.manual_seed(0)
    cfg, model = tiny_model()
    chunks = make_value_model(cfg.model.hidden_size, sequence_parallel=False)([model])
    captured = {}
    model.decoder.register_forward_hook(lambda module, args, output: captured.setdefault("hidden", output))
    tokens = torch.randint(0, cfg.model.vocab_size, (2, 16))
    positions = torch.arange(16).expand(2, 16)
    values = chunks[0](tokens, positions, None)
    expected = (captured["hidden"] @ model.output_layer.weight.t()).transpose(0, 1).float()
    values.sum().backward()
    result = {
        "head_is_linear_for_last_layer": isinstance(model.output_layer, LinearForLastLayer),
        "value_shape": list(values.shape),
        "value_max_diff": float((values - expected).detach().abs().max()),
        "head_has_grad": model.output_layer.weight.grad is not None,
    }

    _, moe = tiny_model("model.num_moe_experts=4", "model.moe_router_topk=2",
                        "model.moe_shared_expert_intermediate_size=64", "model.moe_shared_expert_gate=true")
    frozen = freeze_moe_router(moe)
    names = {name for name, p in frozen[0].named_parameters() if not p.requires_grad}
    result["frozen"] = sorted(names)
    result["routers"] = sum(isinstance(m, Router) for m in moe.modules())
    result["trainable"] = sum(p.requires_grad for p in moe.parameters())
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("check", choices=["reductions", "hooks"])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    result = reductions() if args.check == "reductions" else hooks()
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(result))
    destroy_distributed()


if __name__ == "__main__":
    main()
