"""Masked attention kernels on ``[b, heads, s, d]`` tensors, with optional attention sinks and
soft-capped scores.

A sink is one logit per head that joins every query's softmax without a value (GPT-OSS;
megatron-core's ``softmax_type``: ``learnable`` trains it, ``off-by-one`` fixes it at 0): the
keys' probabilities then sum to ``sigmoid(lse - sink)``, where ``lse`` is the log-sum-exp of the
query's scaled scores. FlexAttention returns ``lse``, so sinks cost one rescale of its output; the
dense path appends the sink logit as one more column of the softmax instead.

A soft cap ``c`` (``model.attn_logit_softcapping``, Gemma 2) replaces each scaled score ``s`` by
``c * tanh(s / c)`` before the mask and the softmax: FlexAttention's ``score_mod``, and the dense
path's written-out softmax.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F


def flex(q, k, v, mask, scale: float, sinks: Optional[torch.Tensor], softcap: Optional[float] = None) -> torch.Tensor:
    """FlexAttention with a ``BlockMask``: compiled on the GPU, torch's reference on the CPU."""
    # Inside a compiled layer (model.compile_layers) the layer's own compilation takes the plain function.
    kernel = _compiled_flex() if q.is_cuda and not torch.compiler.is_compiling() else _flex_attention()
    gqa = q.shape[1] != k.shape[1]
    score_mod = None if softcap is None else _soft_cap(softcap)
    if sinks is None:
        return kernel(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=gqa)
    out, lse = kernel(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale, enable_gqa=gqa, return_lse=True)
    keys_share = torch.sigmoid(lse - sinks.float().view(1, -1, 1))
    return (out * keys_share.unsqueeze(-1)).to(q.dtype)


def dense(q, k, v, keep: torch.Tensor, scale: float, sinks: Optional[torch.Tensor], dropout_p: float,
          softcap: Optional[float] = None) -> torch.Tensor:
    """SDPA with a boolean mask (``True`` = attend); with sinks or a soft cap, the softmax written out."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, scale=scale,
                                              **({"enable_gqa": True} if gqa else {}))
    if gqa:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = torch.matmul(q, k.transpose(-2, -1)).float() * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~keep, float("-inf"))
    if sinks is None:
        probs = torch.softmax(scores, dim=-1)
    else:
        sink = sinks.float().view(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(F.dropout(probs, dropout_p).to(v.dtype), v)


def _soft_cap(cap: float):
    def score_mod(score, batch, head, query, key):
        return torch.tanh(score / cap) * cap

    return score_mod


def _flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return flex_attention


@functools.cache
def _compiled_flex():
    # One compiled kernel per process; block masks and sinks are its inputs, so batches reuse it.
    return torch.compile(_flex_attention(), dynamic=False)
