"""Norms of the ``local`` and ``torch`` specs that megatron-core (without Transformer Engine) lacks.

``ZeroCenteredRMSNorm``  megatron-core's ``layernorm_zero_centered_gamma`` for RMSNorm: the weight is
                         stored minus one, ``y = x / rms(x) * (1 + w)``, computed in float32 and cast
                         back, as Gemma's RMSNorm computes it (megatron-core's ``WrappedTorchNorm``
                         refuses the setting; Transformer Engine's norms implement it).
``PostNormBiasDropoutAdd``  the bias-dropout-add that ends a layer's attention or MLP, with a norm on
                         the sublayer's output first: ``residual + dropout(norm(x + bias))``
                         (``model.post_sublayer_norm``; Gemma 2/3's post-attention and post-feedforward
                         norms). A megatron-core ``TransformerLayer`` has no norm there, but builds
                         its ``self_attn_bda``/``mlp_bda`` from the layer spec, so the norm lives in
                         them: its weight is ``<layer>.self_attn_bda.norm.weight`` /
                         ``<layer>.mlp_bda.norm.weight``, after the linear layer, so that a LoRA
                         adapter on ``linear_proj``/``linear_fc2`` still adds before the norm.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


class ZeroCenteredRMSNorm(torch.nn.Module):
    """RMSNorm with a zero-centred weight; its parameter is marked for megatron-core's sequence-parallel
    gradient reduction (as :class:`~bridge_cli.models.sequence_parallel_norm.SequenceParallelTorchNorm`)."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__()
        self.eps = eps
        # zero: a new model's norms start as the identity, as megatron-core's zero-centred norms do
        self.weight = torch.nn.Parameter(torch.zeros(hidden_size))
        self.weight.sequence_parallel = config.sequence_parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)


def norm_for(config, hidden_size: int) -> torch.nn.Module:
    """The norm the ``local``/``torch`` specs build for ``config`` (one of ``hidden_size`` channels)."""
    from bridge_cli.models.sequence_parallel_norm import SequenceParallelTorchNorm

    if config.layernorm_zero_centered_gamma:
        return ZeroCenteredRMSNorm(config, hidden_size, eps=config.layernorm_epsilon)
    return SequenceParallelTorchNorm(config, hidden_size, eps=config.layernorm_epsilon)


class PostNormBiasDropoutAdd(torch.nn.Module):
    """``self_attn_bda``/``mlp_bda`` of a layer with post-sublayer norms. megatron-core calls it as it calls
    its ``get_bias_dropout_add``: ``bda(training, fused)((x, bias), residual, dropout_prob)``."""

    def __init__(self, config):
        super().__init__()
        self.norm = norm_for(config, config.hidden_size)

    def forward(self, training: bool, fused: bool):
        def bias_dropout_add(x_with_bias, residual: torch.Tensor, prob: float) -> torch.Tensor:
            x, bias = x_with_bias
            if bias is not None:
                x = x + bias
            return residual + F.dropout(self.norm(x), p=prob, training=training)

        return bias_dropout_add
