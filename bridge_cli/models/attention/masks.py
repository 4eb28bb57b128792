"""Which keys each query attends to: the documents of a packed row, and sliding windows.

A row may hold several documents (pretraining with ``dataset.reset_attention_mask``, packed SFT).
``document_ids`` (``[b, s]``, int) number them: a query attends to the keys of its own document at
or before it. A sliding-window layer (megatron-core's ``window_size=(left, right)``, read as
Transformer Engine reads it: keys ``i - left .. i + right``, with ``right`` 0 in a causal model)
further keeps only the ``left`` keys before the query and the query itself; ``window_attn_skip_freq``
picks the layers that have a window (megatron-core's ``is_layer_window_attention``).

On the GPU a mask is a FlexAttention ``BlockMask``: blocks that no query of a tile may see are
skipped, so eight documents in a row cost less than one. Elsewhere it is a dense boolean
``[b, 1, s, s]`` (``True`` = attend) for SDPA or the explicit softmax. A batch's masks are built once,
by the first layer that needs each window, and kept on the batch's :class:`DocumentParams`, the one
object megatron-core hands unchanged to every layer (in the recomputed forward too).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.utils import is_layer_window_attention


def layer_window(config, layer_number: int) -> Optional[int]:
    """How many earlier keys a query of this layer (1-based) sees; None for full causal attention."""
    if not is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        return None
    left = config.window_size[0]
    return None if left < 0 else int(left)


def documents_from_cu_seqlens(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``[1, total]`` document ids of a THD batch; tokens past the last boundary form one more document."""
    positions = torch.arange(total, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), positions, right=True).to(torch.int32).unsqueeze(0)


def dense_mask(documents: Optional[torch.Tensor], window: Optional[int], seq: int, device) -> torch.Tensor:
    """``[b or 1, 1, s, s]`` boolean mask, ``True`` where a query (row) may attend to a key (column)."""
    query = torch.arange(seq, device=device).unsqueeze(1)
    key = torch.arange(seq, device=device).unsqueeze(0)
    keep = key <= query
    if window is not None:
        keep = keep & (query - key <= window)
    if documents is not None:
        return (keep & (documents.unsqueeze(2) == documents.unsqueeze(1))).unsqueeze(1)
    return keep.view(1, 1, seq, seq)


def block_mask(documents: Optional[torch.Tensor], window: Optional[int], seq: int, device):
    """The FlexAttention ``BlockMask`` of :func:`dense_mask`'s rule, without materialising it."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows = None if documents is None else documents.shape[0]
    # Compiled on the GPU: eager, evaluating the rule over every (query, key) pair costs milliseconds
    # of host time per micro-batch, in a loop that is host-bound already.
    return create_block_mask(_mask_mod(documents, window), B=rows, H=None, Q_LEN=seq, KV_LEN=seq, device=device,
                             _compile=torch.device(device).type == "cuda" and not torch.compiler.is_compiling())


def _mask_mod(documents: Optional[torch.Tensor], window: Optional[int]):
    def mask_mod(b, h, q, kv):
        keep = q >= kv
        if window is not None:
            keep = keep & (q - kv <= window)
        if documents is not None:
            keep = keep & (documents[b, q] == documents[b, kv])
        return keep

    return mask_mod


def build_mask(documents: Optional[torch.Tensor], window: Optional[int], seq: int, device, flex: bool):
    """A ``BlockMask`` when ``flex``, else the dense boolean mask."""
    return (block_mask if flex else dense_mask)(documents, window, seq, device)


@functools.lru_cache(maxsize=8)
def shape_mask(window: Optional[int], seq: int, device: torch.device, flex: bool):
    """The mask of a row that is one document: it depends on the shape only, so it is built once per run."""
    return build_mask(None, window, seq, device, flex)


@dataclass
class DocumentParams(PackedSeqParams):
    """A ``[s, b]`` batch whose rows hold several documents: megatron-core passes this to every layer
    as ``packed_seq_params``; its ``qkv_format`` is ``sbhd``, so megatron-core's THD code stays off."""

    document_ids: Optional[torch.Tensor] = None
    """``[b, s]`` document number of each token."""

    rope_positions: Optional[torch.Tensor] = None
    """``[b, s]`` RoPE position of each token (restarting per document), or None for 0..s-1."""

    masks: dict = field(default_factory=dict)
    """Masks built so far, by (window, flex)."""

    def mask(self, window: Optional[int], flex: bool):
        """This batch's mask for a layer with ``window``, built on first use."""
        if (window, flex) not in self.masks:
            seq = self.document_ids.shape[-1]
            self.masks[window, flex] = build_mask(self.document_ids, window, seq, self.document_ids.device, flex)
        return self.masks[window, flex]


def document_params(document_ids: torch.Tensor, rope_positions: Optional[torch.Tensor] = None) -> DocumentParams:
    """The ``packed_seq_params`` of a ``[b, s]`` batch of packed documents."""
    seq = document_ids.shape[-1]
    # max_seqlen_* is what megatron-core's GPTModel sizes the RoPE table by when packed_seq_params is set
    return DocumentParams(qkv_format="sbhd", max_seqlen_q=seq, max_seqlen_kv=seq, document_ids=document_ids,
                          rope_positions=rope_positions)


def batch_document_params(config, document_ids: torch.Tensor, position_ids: torch.Tensor) -> DocumentParams:
    """A training micro-batch's :class:`DocumentParams`, with the masks of every window the model's
    layers use built now, outside any compiled layer (on the GPU: FlexAttention block masks unless
    attention dropout is on)."""
    params = document_params(document_ids, position_ids)
    flex = document_ids.is_cuda and config.attention_dropout == 0.0
    for window in {layer_window(config, n) for n in range(1, config.num_layers + 1)}:
        params.mask(window, flex)
    return params
