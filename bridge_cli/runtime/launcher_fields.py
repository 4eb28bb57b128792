"""Model fields that megatron-core leaves to its launcher (Megatron-LM's training script) rather than reading in
its layers: bridge passes the pipeline's communication backend on (runtime/distributed.py) and refuses what it does
not set up."""

from __future__ import annotations

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
    "hierarchical_context_parallel_sizes": "sizes the groups of Transformer Engine's a2a+p2p context parallelism; "
                                           "bridge's context parallelism all-gathers keys and values over one group",
}
"""model field -> what it does that bridge does not (refused away from its default)."""


def check_launcher_fields(model, device: str) -> None:
    """Raise ConfigError for a launcher-level model field this run cannot honour."""
    import dataclasses

    import torch

    for f in dataclasses.fields(model):
        if f.name in NOT_SET_UP and getattr(model, f.name) != f.default:
            raise ConfigError(f"model.{f.name}", f"{NOT_SET_UP[f.name]}.", f"Leave it at its default ({f.default!r}).")
    backend = model.pipeline_model_parallel_comm_backend  # nccl or ucc (the schema's choices)
    if backend is None:
        return
    available = torch.distributed.is_ucc_available() if backend == "ucc" else device == "cuda"
    if not available:
        why = "this torch was built without UCC" if backend == "ucc" else "NCCL needs CUDA"
        raise ConfigError("model.pipeline_model_parallel_comm_backend", f"{backend}: {why}.",
                          "Unset it to use the process group's backend.")
