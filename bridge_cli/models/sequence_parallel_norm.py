"""A torch norm that sequence parallelism can use, for the ``local`` and ``torch`` specs.

megatron-core's ``WrappedTorchNorm`` (what those specs normalise with when Apex is absent) refuses
``sequence_parallel``: under it each tensor-parallel rank normalises its own slice of the sequence,
so each rank's norm-weight gradient covers only that slice. megatron-core's
``finalize_model_grads`` sums over the tensor-parallel group the gradients of parameters marked
``sequence_parallel`` (as Transformer Engine's and Apex's norms mark theirs); this norm marks its
weights so. Everything else is ``torch.nn.LayerNorm`` / ``torch.nn.RMSNorm`` as in WrappedTorchNorm.
"""

from __future__ import annotations

import torch


class SequenceParallelTorchNorm:
    """Builds ``torch.nn.LayerNorm`` or ``torch.nn.RMSNorm`` (per ``config.normalization``) with its
    parameters marked for megatron-core's sequence-parallel gradient reduction."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "LayerNorm"):
        if config.layernorm_zero_centered_gamma or config.memory_efficient_layer_norm or config.persist_layer_norm:
            raise ValueError("zero-centered gamma, memory-efficient and persistent layer norms need the te spec")
        norm_cls = {"LayerNorm": torch.nn.LayerNorm, "RMSNorm": torch.nn.RMSNorm}[config.normalization]
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            param.sequence_parallel = config.sequence_parallel
        return norm
