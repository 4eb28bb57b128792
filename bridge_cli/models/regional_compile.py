"""Regional compilation: ``torch.compile`` each transformer layer of a built GPTModel, in place.

The layers run the same code on same-shaped inputs, and torch inlines modules with their
parameters as graph inputs, so they share one compiled graph: the first layer compiles and the
others hit its cache. Compiling in place (``Module.compile``) keeps the state-dict keys as they
are (no ``_orig_mod.`` prefix), so checkpoints do not depend on the setting.
"""

from __future__ import annotations

import warnings

import torch


def compile_layers(chunks: list) -> None:
    """Compile every ``TransformerLayer`` of ``chunks`` (before the DDP wrap)."""
    from megatron.core.transformer.transformer_layer import TransformerLayer

    # megatron-core's RowParallelLinear warns that its tp_group is unset on every call (rank 0); traced,
    # that warning splits each layer into several graphs. Inside compiled code, warnings are dropped.
    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                module.compile(dynamic=False)
