"""RoPE with its own base in the sliding-window layers (``model.local_rotary_base``; Gemma 3).

megatron-core's GPTModel computes one rotary table and hands it to every layer. With
``local_rotary_base`` set, :class:`LocalGlobalRotaryEmbedding` computes two, the model's (``rotary_base``
and its scaling) and the local one (``local_rotary_base``, unscaled), and joins them along the last
axis: ``[s, 1, 1, 2 * d]``. Everything that cuts or gathers the table by position (context
parallelism, per-document positions in :mod:`~bridge_cli.models.gpt_model`, recomputation, which
saves only tensors) handles both at once. Each layer's :class:`LocalRopeSelfAttention` keeps its half:
the local one where :func:`~bridge_cli.models.attention.masks.layer_window` gives the layer a window.
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.transformer.attention import SelfAttention

from bridge_cli.models.attention.masks import layer_window


class LocalGlobalRotaryEmbedding(RotaryEmbedding):
    """megatron-core's RotaryEmbedding whose table is ``[global | local]`` along the last axis."""

    def __init__(self, *, local_rotary_base: int, **kwargs):
        super().__init__(**kwargs)
        self.local = RotaryEmbedding(**{**kwargs, "rotary_base": local_rotary_base,
                                        "seq_len_interpolation_factor": None, "rope_scaling": False})

    def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        return torch.cat([super().get_emb(max_seq_len, offset), self.local.get_emb(max_seq_len, offset)], dim=-1)


class LocalRopeSelfAttention(SelfAttention):
    """megatron-core's SelfAttention given the joined table: it rotates with its own layer's half."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.local = layer_window(self.config, self.layer_number) is not None

    def forward(self, *args, rotary_pos_emb=None, **kwargs):
        if rotary_pos_emb is not None:
            half = rotary_pos_emb.shape[-1] // 2
            rotary_pos_emb = rotary_pos_emb[..., half:] if self.local else rotary_pos_emb[..., :half]
        return super().forward(*args, rotary_pos_emb=rotary_pos_emb, **kwargs)
