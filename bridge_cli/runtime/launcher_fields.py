"""Fields of megatron-core's config classes that Megatron-LM's launcher (its training script), not megatron-core's
layers, acts on: bridge passes the pipeline's communication backend on (runtime/distributed.py), checked here. The
model fields of what bridge does not set up (Transformer Engine's userbuffers, captured CUDA graphs) are rows of the
table of refused fields (config/unsupported.py); the ddp fields of Megatron-FSDP are runtime/fsdp.py's."""

from __future__ import annotations

from bridge_cli.config.errors import ConfigError


def check_launcher_fields(model, device: str) -> None:
    """Raise ConfigError for a pipeline communication backend this run cannot use."""
    import torch

    backend = model.pipeline_model_parallel_comm_backend  # nccl or ucc (the schema's choices)
    if backend is None:
        return
    available = torch.distributed.is_ucc_available() if backend == "ucc" else device == "cuda"
    if not available:
        why = "this torch was built without UCC" if backend == "ucc" else "NCCL needs CUDA"
        raise ConfigError("model.pipeline_model_parallel_comm_backend", f"{backend}: {why}.",
                          "Unset it to use the process group's backend.")
