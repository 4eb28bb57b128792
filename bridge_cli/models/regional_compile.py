"""Regional compilation: ``torch.compile`` each transformer layer of a built GPTModel, and its loss.

The layers run the same code on same-shaped inputs, and torch inlines modules with their
parameters as graph inputs, so they share one compiled graph: the first layer compiles and the
others hit its cache. Compiling in place (``Module.compile``) keeps the state-dict keys as they
are (no ``_orig_mod.`` prefix), so checkpoints do not depend on the setting.

The last stage's language-model loss (the cross entropy over the vocabulary, with its
tensor-parallel all-reduces) is a second graph: its passes over the fp32 logits fuse, which is
most of the gain for a small model with a large vocabulary (gpt2_124m: 30.2% -> 37.1% MFU).
"""

from __future__ import annotations

import warnings

import torch

from bridge_cli.models import cross_entropy
from bridge_cli.models.linear_cross_entropy import compiled_chunk_math


def compile_layers(chunks: list) -> None:
    """Compile every ``TransformerLayer`` of ``chunks`` and the loss of the last stage (before the DDP wrap)."""
    from megatron.core.models.common.language_module.language_module import LanguageModule
    from megatron.core.transformer.transformer_layer import TransformerLayer

    # megatron-core's RowParallelLinear warns that its tp_group is unset on every call (rank 0); traced,
    # that warning splits each layer into several graphs. Inside compiled code, warnings are dropped.
    torch._dynamo.config.ignore_logging_functions.add(warnings.warn)
    # Its tensor-parallel linear also advises CUDA_DEVICE_MAX_CONNECTIONS=1 once, which bridge leaves unset on the
    # CPU and under FSDP, and marks the advice given on the function: an attribute set dynamo cannot trace, so
    # each layer broke in two and recompiled once the mark was set. Marked given here, as compiled code drops it.
    from megatron.core.tensor_parallel import layers

    layers.linear_with_grad_accumulation_and_async_allreduce.warned = True
    from bridge_cli.models.moe_compat import make_router_loss_entries, number_routers_by_tensor

    number_routers_by_tensor(chunks)  # one graph for every MoE layer, whose routers record their losses by layer
    make_router_loss_entries(chunks)  # and no recompilation once the first layer made the tracker's entry
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TransformerLayer):
                module.compile(dynamic=False, **_layer_options(module))
            elif isinstance(module, LanguageModule) and module.post_process:
                # the cross entropy over the vocabulary: its fp32 passes over the logits fuse
                if getattr(module.config, "fused_linear_cross_entropy", False):  # chunk by chunk, between GEMMs
                    module.loss_chunk_math = compiled_chunk_math()
                elif not cross_entropy.selected(module.config):  # that one is two kernels already
                    module.compute_language_model_loss = torch.compile(module.compute_language_model_loss,
                                                                       dynamic=False)


def _layer_options(layer) -> dict:
    """torch.compile's options for one layer. Where SDPA runs as its math (matmul, softmax, matmul: on the CPU, or
    ``model.sdpa_backend=math``), inductor's attention-fusion patterns rewrite it back into one SDPA call, and with
    multi-latent attention's value heads of another size than its query and key heads torch 2.13's replacement
    fails to trace ("Expected size for first two dimensions of batch2 tensor"): there the pattern matcher is off.
    SDPA's fused kernels on CUDA are one op already, which no pattern rewrites."""
    config = layer.config
    on_cuda = any(p.is_cuda for p in layer.parameters())
    options = {}
    if getattr(config, "multi_latent_attention", False) and (not on_cuda or config.sdpa_backend == "math"):
        options["pattern_matcher"] = False
    if getattr(config, "moe_exchange_chunks", 1) > 1:
        # inductor's peak-memory reordering moves each collective's wait up to its issue, which undoes the chunked
        # exchange's overlap (model.moe_exchange_chunks); without it the graph keeps the program's order
        options["reorder_for_peak_memory"] = False
    return {"options": options} if options else {}
