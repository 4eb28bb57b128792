"""The ``torch`` spec's core attention: megatron-core's ``SelfAttention`` calls it (0.16 to 0.19).

Two paths, chosen per call:

- **causal**: one row is one document, no window, no sinks. ``F.scaled_dot_product_attention``
  with ``is_causal=True`` (flash / cuDNN on the GPU, no mask tensor, GQA without copying keys),
  optionally pinned to one kernel by ``model.sdpa_backend``. It never forks the CUDA RNG tracker
  (dropout draws from the default generator) and does no host synchronisation.
- **masked**: rows of several documents (:class:`~bridge_cli.models.attention.masks.DocumentParams`
  from the training step, or megatron-core's THD ``PackedSeqParams`` with ``cu_seqlens``, or a
  dense mask from the dataset), a sliding window in this layer, attention sinks, or soft-capped
  scores (``model.attn_logit_softcapping``). FlexAttention
  with a block mask on the GPU; SDPA with a boolean mask (the explicit softmax with sinks) on the
  CPU and wherever attention dropout is on, which FlexAttention lacks. Same numbers on both.

Under context parallelism (``model.context_parallel_size``) every layer takes the masked path:
this rank's queries against the keys and values all-gathered over the CP group
(:mod:`~bridge_cli.models.attention.context_parallel`), masked by the tokens' places in the row.

It is tensor-parallel by construction: ``linear_qkv`` has already split the heads, so inputs are
``[s, b, heads, d]`` with this rank's heads, and head counts are read from them (which also covers
MLA's distinct value head size). Its one parameter is the learnable sink logit per head,
``softmax_offset``, named and sharded as in megatron-core's own attention so checkpoints match.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint
from torch.nn.attention import sdpa_kernel

from bridge_cli.models.attention import kernels
from bridge_cli.models.attention.context_parallel import gather_sequence
from bridge_cli.models.attention.masks import (DocumentParams, MaskInputs, build_mask, dense_mask,
                                               documents_from_cu_seqlens, layer_window, shape_mask)
from bridge_cli.models.attention.sdpa_backend import BACKENDS, SDPA_HAS_GQA, check_backend, heads_per_rank
from bridge_cli.runtime.errors import RuntimeUnavailable

_CAUSAL = (AttnMaskType.causal, AttnMaskType.padding_causal)


class TorchAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron-core's ``SelfAttention``."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        **unused,
    ):
        super().__init__(config=config)
        _check_supported(config)
        self.attn_mask_type = attn_mask_type
        self.window = layer_window(config, layer_number)
        # Megatron's query-key layer scaling divides the scale by the layer number and
        # multiplies it back inside the softmax; the product is the plain scale.
        # MLA's heads: keys of k_channels (its qk_head_dim + qk_pos_emb_head_dim), values of v_channels
        k_channels, v_channels = k_channels or config.kv_channels, v_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(k_channels)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        backend = getattr(config, "sdpa_backend", "auto")
        # None lets torch pick per call; built here so that a call only enters the context.
        self.backends = None if backend == "auto" else [BACKENDS[backend]]
        if self.backends:
            check_backend(backend, config.params_dtype, self.dropout_p > 0, *heads_per_rank(config), k_channels,
                          v_channels)
        self.tp_group = getattr(pg_collection, "tp", None)
        self.cp_group = _context_parallel_group(pg_collection, config)
        self.cp_size = 1 if self.cp_group is None else torch.distributed.get_world_size(self.cp_group)
        self.softmax_type = getattr(config, "softmax_type", "vanilla")
        self.softcap = getattr(config, "attn_logit_softcapping", None)
        self._init_sinks(config)

    def _init_sinks(self, config) -> None:
        heads = heads_per_rank(config)[0]
        device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
        if self.softmax_type == "learnable":
            self.softmax_offset = torch.nn.Parameter(torch.empty(heads, device=device, dtype=config.params_dtype))
            if config.perform_initialization:
                config.init_method(self.softmax_offset)
        elif self.softmax_type == "off-by-one":
            # a fixed sink logit of 0: exp(0) = 1 added to every softmax's denominator
            self.register_buffer("softmax_offset", torch.zeros(heads, device=device, dtype=config.params_dtype),
                                 persistent=False)
        else:
            self.softmax_offset = None

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        **unused,
    ) -> torch.Tensor:
        """``[s, b, heads, d]`` query/key/value (``[t, heads, d]`` for THD) to ``[s, b, heads * d_v]`` context."""
        if attention_bias is not None:
            raise RuntimeUnavailable("attention bias is not supported by the torch layer spec; "
                                     "use model.spec=te (needs transformer_engine).")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if thd:  # one row of all the batch's tokens
            query, key, value = (t.unsqueeze(1) for t in (query, key, value))
        if self.cp_size > 1:
            if thd or attention_mask is not None:
                raise RuntimeUnavailable("context parallelism in the torch layer spec takes neither THD packed "
                                         "sequences nor a dense attention mask; pass document ids instead.")
            key, value = (gather_sequence(t, self.cp_group) for t in (key, value))
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        mask_type = attn_mask_type or self.attn_mask_type
        if (packed_seq_params is None and self.window is None and self.softmax_offset is None and self.softcap is None
                and self.cp_size == 1):
            out = self._sdpa(q, k, v, mask_type, attention_mask)
        else:
            out = self._masked(q, k, v, mask_type, attention_mask, packed_seq_params, thd)
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)

    def _sdpa(self, q, k, v, mask_type, attention_mask) -> torch.Tensor:
        """The fast path: one SDPA call, causal without a mask tensor unless a mask is given."""
        repeats = q.shape[1] // k.shape[1]
        gqa = repeats > 1
        if gqa and not SDPA_HAS_GQA:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
            gqa = False
        mask, causal = _sdpa_mask(mask_type, attention_mask, q, k)
        extra = {"enable_gqa": True} if gqa else {}
        with sdpa_kernel(self.backends) if self.backends else contextlib.nullcontext():
            return F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=causal,
                scale=self.softmax_scale,
                **extra,
            )

    def _masked(self, q, k, v, mask_type, attention_mask, packed_seq_params, thd: bool) -> torch.Tensor:
        """Documents, a window, sinks or a soft cap: FlexAttention on the GPU, an explicit mask elsewhere."""
        if mask_type not in _CAUSAL:
            raise RuntimeUnavailable(f"the torch layer spec's attention supports documents, sliding windows and "
                                     f"sinks in causal layers only, not attn_mask_type={mask_type.name}.")
        dropout_p = self.dropout_p if self.training else 0.0
        seq = q.shape[2]
        documents = isinstance(packed_seq_params, DocumentParams) or thd
        # a dense mask given by the dataset stays dense; FlexAttention has no dropout
        flex = q.is_cuda and dropout_p == 0.0 and (documents or attention_mask is None)
        if isinstance(packed_seq_params, DocumentParams):
            mask = packed_seq_params.mask(self.window, flex)
        elif thd:
            cu_seqlens = packed_seq_params.cu_seqlens_q_padded
            cu_seqlens = packed_seq_params.cu_seqlens_q if cu_seqlens is None else cu_seqlens
            documents = documents_from_cu_seqlens(cu_seqlens, seq)
            mask = build_mask(MaskInputs(seq, seq, q.device, documents, documents), self.window, flex)
        elif attention_mask is not None:  # megatron-core's dataset mask, True = masked out
            mask = ~attention_mask & dense_mask(MaskInputs(seq, seq, q.device), self.window)
        else:
            cp_rank = torch.distributed.get_rank(self.cp_group) if self.cp_size > 1 else 0
            mask = shape_mask(self.window, seq, q.device, flex, self.cp_size, cp_rank)
        if flex:
            return kernels.flex(q, k, v, mask, self.softmax_scale, self.softmax_offset, self.softcap)
        return kernels.dense(q, k, v, mask, self.softmax_scale, self.softmax_offset, dropout_p, self.softcap)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata=None):
        """The learnable sinks, split over tensor-parallel ranks by head, as megatron-core shards them."""
        state_dict = self.state_dict(prefix="", keep_vars=True) if self.softmax_type == "learnable" else {}
        return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets,
                                                   tp_group=self.tp_group,
                                                   dp_cp_group=(metadata or {}).get("dp_cp_group"))


def _sdpa_mask(mask_type: AttnMaskType, attention_mask, q: torch.Tensor, k: torch.Tensor):
    """SDPA's ``(attn_mask, is_causal)`` for a megatron mask (``True`` = masked out): a causal layer
    given no mask runs the causal kernel; a mask given (the dataset's, with documents) is obeyed."""
    causal = mask_type in _CAUSAL
    if causal and attention_mask is None:
        return None, True
    if attention_mask is None or mask_type == AttnMaskType.no_mask:
        return None, False
    keep = ~attention_mask
    if causal:
        keep = keep & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return keep, False


def _context_parallel_group(pg_collection, config):
    """The layer's context-parallel group (megatron-core 0.19 hands it over; 0.16 keeps it in
    parallel_state), or None without context parallelism."""
    if config.context_parallel_size == 1:
        return None
    group = getattr(pg_collection, "cp", None)
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_context_parallel_group()
    return group


def _check_supported(config) -> None:
    unsupported = []  # context parallelism is refused earlier, with the layer spec (models/specs.py)
    window = getattr(config, "window_size", None)
    if window and window[1] not in (0, -1):
        unsupported.append(f"model.window_size={list(window)} (a causal model sees no keys after the query; "
                           "the right side must be 0)")
    # Both read the attention logits, which the fused kernels never materialise.
    for flag in ("qk_clip", "log_max_attention_logit"):
        if getattr(config, flag, False):
            unsupported.append(f"model.{flag}=true")
    if unsupported:
        raise RuntimeUnavailable(
            f"{', '.join(unsupported)} is not supported by the torch layer spec's attention; "
            "use model.spec=te (needs transformer_engine) or drop the setting."
        )
