"""Silence megatron-core's start-up noise that says nothing actionable to a bridge user."""

from __future__ import annotations

import logging
import warnings

_WARNINGS = (
    "Transformer Engine and Apex are not installed",  # bridge picks the torch spec and says so
    "Apex is not installed",
    "full scope is deprecated",  # megatron-core's own default for cuda_graph_scope
    ".*CUDA_DEVICE_MAX_CONNECTIONS",  # bridge sets it on CUDA; meaningless on the CPU
    ".*all_gather_into_tensor` is deprecated",  # megatron-core's Timers, on torch >= 2.12
    # megatron-core >= 0.19: a single process started without torchrun has no RANK to read before
    # its process group exists (the rerun state machine logs then); rank 0 is right
    "Could not determine rank from torch.distributed",
    "MimoModelConfig is experimental",  # megatron-core >= 0.19 defines it on import; bridge never uses it
)
_LOG_LINES = {
    # bridge's own lines say what the machine does; evaluation pauses it (and it logs each switch)
    "megatron.core.rerun_state_machine": ("RerunStateMachine initialized", "Setting RerunStateMachine mode"),
    "megatron.core.datasets.gpt_dataset": ("because path_to_cache is None",),  # mock data has nothing to cache
    # megatron-core >= 0.19 points GPTModel users to HybridModel; bridge builds GPTModel on purpose
    "megatron.core.models.gpt.gpt_model": ("GPTModel IS DEPRECATED",),
    # torch 2.11 fails to JSON-log its own dynamo config once model.compile_layers has set
    # ignore_logging_functions (torch 2.13 leaves that key out), both its compilation and its runtime
    # metrics; compilation itself is unaffected
    "torch._dynamo.metrics_context": ("Unexpected exception logging",),
    # a CUDA build of torch on a machine without a GPU (megatron-core 0.19 imports cpp_extension);
    # bridge's start-up line names the device it runs on
    "torch.utils.cpp_extension": ("No CUDA runtime is found",),
}


def quiet_known_noise() -> None:
    for message in _WARNINGS:
        warnings.filterwarnings("ignore", message=message)
    for name, fragments in _LOG_LINES.items():
        logging.getLogger(name).addFilter(
            lambda record, fragments=fragments: not any(f in record.getMessage() for f in fragments))
