"""Fields of megatron-core's config classes that Megatron-LM's launcher (its training script), not megatron-core's
layers, acts on: bridge passes the pipeline's communication backend on (runtime/distributed.py) and refuses the
model fields of what it does not set up (Transformer Engine's userbuffers, captured CUDA graphs). The ddp fields of
Megatron-FSDP are runtime/fsdp.py's."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

from bridge_cli.config.errors import ConfigError

NOT_SET_UP = {
    "tp_comm_overlap": "overlaps tensor-parallel communication through Transformer Engine's userbuffers, which "
                       "bridge does not initialize",
    "tp_comm_bootstrap_backend": "bootstraps Transformer Engine's userbuffers, which bridge does not initialize",
    "external_cuda_graph": "is Megatron-LM's training-loop capture of Transformer Engine CUDA graphs",
    "cuda_graph_impl": "captures CUDA graphs from Megatron-LM's training loop (its create_cudagraphs calls, or Transformer "
                       "Engine's graphed callables), which bridge does not run; whole-step graphs measured within 1% of "
                       "eager on gpt2_124m (docs/performance.md)",
    "use_inference_optimized_layers": "selects megatron-core's inference layers; bridge trains",
    "overlap_moe_expert_parallel_comm": "runs megatron-core's combined 1F1B schedule, which needs a forward step that "
                                        "builds its schedule plan; bridge's forward step does not",
    "hierarchical_context_parallel_sizes": "sizes the groups of Transformer Engine's a2a+p2p context parallelism; "
                                           "bridge's context parallelism all-gathers keys and values over one group",
}
"""model field -> what it does that bridge does not (refused away from its default)."""


def check_launcher_fields(model, ddp_config, device: str) -> None:
    """Raise ConfigError for a launcher-level model field this run cannot honour."""
    import torch

    _refuse_set("model", model, NOT_SET_UP.get)
    backend = model.pipeline_model_parallel_comm_backend  # nccl or ucc (the schema's choices)
    if backend is None:
        return
    available = torch.distributed.is_ucc_available() if backend == "ucc" else device == "cuda"
    if not available:
        why = "this torch was built without UCC" if backend == "ucc" else "NCCL needs CUDA"
        raise ConfigError("model.pipeline_model_parallel_comm_backend", f"{backend}: {why}.",
                          "Unset it to use the process group's backend.")


def _refuse_set(section: str, config: Any, why: Callable[[str], Optional[str]], fix: str = "") -> None:
    """Raise ConfigError for the first field of ``config`` that ``why`` names a reason for and that is set away
    from its default."""
    for f in dataclasses.fields(config):
        reason = why(f.name)
        if reason is None:
            continue
        default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
        if getattr(config, f.name) != default:
            raise ConfigError(f"{section}.{f.name}", f"{reason}.", f"Leave it at its default ({default!r}){fix}.")
