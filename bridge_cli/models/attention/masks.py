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
object megatron-core hands unchanged to every layer (in the recomputed forward too). Under context
parallelism the queries are this rank's part of the row and the keys the whole row in rank order,
so the rule compares the tokens' places in the row (:class:`MaskInputs`), not their indices.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional

import torch
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.utils import is_layer_window_attention

from bridge_cli.models.attention.context_parallel import gather_rows, gathered_positions, rank_positions, slice_rows


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


@dataclass(eq=False)
class MaskInputs:
    """Who a layer's queries and keys are: their places in the row (None: 0..len-1, the keys being the
    queries) and their ``[b, len]`` document ids (None: one document per row)."""

    q_len: int
    kv_len: int
    device: torch.device
    q_documents: Optional[torch.Tensor] = None
    kv_documents: Optional[torch.Tensor] = None
    q_positions: Optional[torch.Tensor] = None
    kv_positions: Optional[torch.Tensor] = None


def dense_mask(inputs: MaskInputs, window: Optional[int]) -> torch.Tensor:
    """``[b or 1, 1, q_len, kv_len]`` boolean mask, ``True`` where a query (row) may attend to a key (column)."""
    query = _positions(inputs.q_positions, inputs.q_len, inputs.device).unsqueeze(1)
    key = _positions(inputs.kv_positions, inputs.kv_len, inputs.device).unsqueeze(0)
    keep = key <= query
    if window is not None:
        keep = keep & (query - key <= window)
    if inputs.q_documents is not None:
        return (keep & (inputs.q_documents.unsqueeze(2) == inputs.kv_documents.unsqueeze(1))).unsqueeze(1)
    return keep.view(1, 1, inputs.q_len, inputs.kv_len)


def _positions(positions: Optional[torch.Tensor], length: int, device) -> torch.Tensor:
    return torch.arange(length, device=device) if positions is None else positions


def block_mask(inputs: MaskInputs, window: Optional[int]):
    """The FlexAttention ``BlockMask`` of :func:`dense_mask`'s rule, without materialising it."""
    from torch.nn.attention.flex_attention import create_block_mask

    rows = None if inputs.q_documents is None else inputs.q_documents.shape[0]
    # Compiled on the GPU: eager, evaluating the rule over every (query, key) pair costs milliseconds
    # of host time per micro-batch, in a loop that is host-bound already.
    compile_it = torch.device(inputs.device).type == "cuda" and not torch.compiler.is_compiling()
    return create_block_mask(_mask_mod(inputs, window), B=rows, H=None, Q_LEN=inputs.q_len, KV_LEN=inputs.kv_len,
                             device=inputs.device, _compile=compile_it)


def _mask_mod(inputs: MaskInputs, window: Optional[int]):
    q_documents, kv_documents = inputs.q_documents, inputs.kv_documents
    q_positions, kv_positions = inputs.q_positions, inputs.kv_positions

    def mask_mod(b, h, q, kv):
        # without context parallelism a token's index is its place in the row: no lookup in the kernel
        q_place = q if q_positions is None else q_positions[q]
        kv_place = kv if kv_positions is None else kv_positions[kv]
        keep = q_place >= kv_place
        if window is not None:
            keep = keep & (q_place - kv_place <= window)
        if q_documents is not None:
            keep = keep & (q_documents[b, q] == kv_documents[b, kv])
        return keep

    return mask_mod


def build_mask(inputs: MaskInputs, window: Optional[int], flex: bool):
    """A ``BlockMask`` when ``flex``, else the dense boolean mask."""
    return (block_mask if flex else dense_mask)(inputs, window)


@functools.lru_cache(maxsize=8)
def shape_mask(window: Optional[int], q_len: int, device: torch.device, flex: bool, cp_size: int = 1, cp_rank: int = 0):
    """The mask of rows that are one document each: it depends on the shape (and the context-parallel
    rank) only, so it is built once per run."""
    if cp_size == 1:
        return build_mask(MaskInputs(q_len, q_len, device), window, flex)
    seq = q_len * cp_size
    inputs = MaskInputs(q_len, seq, device, q_positions=rank_positions(seq, cp_size, cp_rank, device),
                        kv_positions=gathered_positions(seq, cp_size, device))
    return build_mask(inputs, window, flex)


@dataclass
class DocumentParams(PackedSeqParams):
    """A ``[s, b]`` batch whose rows hold several documents: megatron-core passes this to every layer
    as ``packed_seq_params``; its ``qkv_format`` is ``sbhd``, so megatron-core's THD code stays off."""

    document_ids: Optional[torch.Tensor] = None
    """``[b, s]`` document number of each token (of this rank's part of the rows under context parallelism)."""

    rope_positions: Optional[torch.Tensor] = None
    """``[b, s]`` RoPE position of each token (restarting per document), or None for megatron-core's."""

    key_document_ids: Optional[torch.Tensor] = None
    """Context parallelism: the document ids of the all-gathered keys (every rank's part, rank by rank)."""

    query_positions: Optional[torch.Tensor] = None
    """Context parallelism: the places in the row of this rank's tokens."""

    key_positions: Optional[torch.Tensor] = None
    """Context parallelism: the places in the row of the all-gathered keys."""

    masks: dict = field(default_factory=dict)
    """Masks built so far, by (window, flex)."""

    def mask(self, window: Optional[int], flex: bool):
        """This batch's mask for a layer with ``window``, built on first use."""
        if (window, flex) not in self.masks:
            keys = self.document_ids if self.key_document_ids is None else self.key_document_ids
            inputs = MaskInputs(self.document_ids.shape[-1], keys.shape[-1], self.document_ids.device,
                                self.document_ids, keys, self.query_positions, self.key_positions)
            self.masks[window, flex] = build_mask(inputs, window, flex)
        return self.masks[window, flex]


def document_params(document_ids: torch.Tensor, rope_positions: Optional[torch.Tensor] = None,
                    cp_size: int = 1, cp_rank: int = 0) -> DocumentParams:
    """The ``packed_seq_params`` of ``[b, s]`` rows of packed documents (whole rows: under context
    parallelism this cuts out the rank's part, and keeps where the gathered keys come from)."""
    seq = document_ids.shape[-1]
    fields = dict(document_ids=document_ids, rope_positions=rope_positions)
    if cp_size > 1:
        device = document_ids.device
        fields = dict(document_ids=slice_rows(document_ids, cp_size, cp_rank),
                      rope_positions=None if rope_positions is None else slice_rows(rope_positions, cp_size, cp_rank),
                      key_document_ids=gather_rows(document_ids, cp_size),
                      query_positions=rank_positions(seq, cp_size, cp_rank, device),
                      key_positions=gathered_positions(seq, cp_size, device))
    # max_seqlen_* is what megatron-core's GPTModel sizes the RoPE table by when packed_seq_params is set
    return DocumentParams(qkv_format="sbhd", max_seqlen_q=seq, max_seqlen_kv=seq, **fields)


def batch_document_params(config, document_ids: torch.Tensor, position_ids: torch.Tensor, cp_size: int = 1,
                          cp_rank: int = 0) -> DocumentParams:
    """A training micro-batch's :class:`DocumentParams`, with the masks of every window the model's
    layers use built now, outside any compiled layer (on the GPU: FlexAttention block masks unless
    attention dropout is on)."""
    params = document_params(document_ids, position_ids, cp_size, cp_rank)
    flex = document_ids.is_cuda and config.attention_dropout == 0.0
    for window in {layer_window(config, n) for n in range(1, config.num_layers + 1)}:
        params.mask(window, flex)
    return params
