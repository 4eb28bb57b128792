"""Tensor layouts: megatron-core GPTModel (one rank) <-> Hugging Face, for every family.

Which tensors a family has is its module's business (``convert/families``); this module holds the
shapes they share and how a parameter is rearranged. The megatron-core names are the module names
of the ``torch``/``local`` layer spec on one rank; its sharded state dict stores them under
Transformer Engine's keys, so a checkpoint written from it loads with any spec. These layouts
differ from Hugging Face's:

- ``linear_qkv`` fuses q, k and v, interleaved per query group: for each of the
  ``num_query_groups`` groups, that group's query heads, then its key head, then its value head
  (``heads_per_group * kv_channels``, ``kv_channels``, ``kv_channels`` rows). Its bias (Qwen2)
  follows the same order. Phi-3 stores q, k and v as one ``qkv_proj`` tensor, ``[q; k; v]``.
- ``linear_fc1`` is ``[gate; up]``: megatron-core's SwiGLU applies the activation to the first half
  (Phi-3's fused ``gate_up_proj`` is already that).
- The embedding and output layer may hold padding rows beyond the vocabulary
  (``make_vocab_size_divisible_by``); export drops them.
- A mixture-of-experts layer holds one ``linear_fc1``/``linear_fc2`` per expert
  (``experts.local_experts.<j>``, the names of megatron-core's SequentialMLP, whose checkpoint
  format the grouped-GEMM experts share), each laid out as the dense MLP's. GPT-OSS stacks the
  experts instead: one ``[experts, in, out]`` tensor per projection (``x @ w``, the transpose of a
  linear layer's weight) and one ``[experts, out]`` per bias, with gate and up interleaved along
  ``out`` in ``gate_up_proj`` (gate in the even columns, up in the odd ones). One :class:`Pair` then
  maps that tensor to every expert's parameter.
- GPT-2's linears are Conv1Ds (``x @ w + b``): each weight is stored ``[in, out]``, the transpose of
  megatron-core's; its fused ``c_attn`` is ``[q; k; v]`` along ``out``, and its bias ``[q; k; v]``.
- DeepSeek-V3's multi-token-prediction layers each store a copy of the embedding and the output head
  (``embed_tokens``, ``shared_head.head``), which megatron-core's MTP block shares with the model:
  one :class:`Pair` of the SHARED layout maps the megatron-core tensor to every copy.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import Optional, Union

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Hugging Face tensors that carry no weights (old Llama checkpoints saved the RoPE frequencies)."""


class Layout(Enum):
    SAME = "same"
    QKV = "qkv"
    FUSED_QKV = "fused_qkv"
    GATE_UP = "gate_up"
    VOCAB = "vocab"
    EXPERTS = "experts"
    """A tensor stacked over the experts, each expert's slice as megatron-core holds it (a bias)."""
    EXPERTS_T = "experts_t"
    """Stacked over the experts, each slice ``[in, out]``: megatron-core's weight is its transpose."""
    EXPERTS_GATE_UP = "experts_gate_up"
    """Stacked over the experts, gate and up interleaved along the last axis (a weight's slice
    ``[in, 2 * ffn]``, transposed as EXPERTS_T): megatron-core's ``[gate; up]``."""
    TRANSPOSED = "transposed"
    """A weight stored ``[in, out]`` (a Conv1D's): megatron-core's is its transpose."""
    FUSED_QKV_T = "fused_qkv_t"
    """FUSED_QKV stored ``[in, out]``, q, k and v along ``out`` (GPT-2's ``c_attn``)."""
    SHARED = "shared"
    """One vocabulary-sized megatron-core tensor that Hugging Face stores several times, identical (DeepSeek-V3's
    MTP layers repeat the embedding and the output head): import checks the copies equal the first, export writes
    each, padding rows dropped."""


STACKED = (Layout.EXPERTS, Layout.EXPERTS_T, Layout.EXPERTS_GATE_UP)
"""The layouts of a Hugging Face tensor that holds every expert's parameter."""

TRANSPOSES = {Layout.TRANSPOSED: Layout.SAME, Layout.FUSED_QKV_T: Layout.FUSED_QKV}
"""The layouts of a weight stored ``[in, out]`` -> the layout of its transpose, ``[out, in]``."""


@dataclass(frozen=True)
class LatentSizes:
    """The sizes of multi-latent attention (DeepSeek-V2/V3), as megatron-core's MLA fields name them."""

    q_lora_rank: Optional[int]
    kv_lora_rank: int
    qk_head_dim: int
    qk_pos_emb_head_dim: int
    v_head_dim: int


@dataclass(frozen=True)
class Architecture:
    """The shape-defining fields of a Llama-style model."""

    num_layers: int
    hidden_size: int
    ffn_hidden_size: int
    num_attention_heads: int
    num_query_groups: int
    kv_channels: int
    vocab_size: int
    tied: bool
    qkv_bias: bool
    qk_norm: bool
    num_experts: int = 0
    """Routed experts of each mixture-of-experts layer (0: a dense model)."""
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[bool, ...] = ()
    """Per layer, whether it is a mixture-of-experts layer (megatron-core's moe_layer_freq)."""
    shared_expert_size: Optional[int] = None
    """FFN size of the shared experts an MoE layer adds to the routed ones (None: none)."""
    expert_bias: bool = False
    """Whether the router holds a per-expert bias for choosing experts (DeepSeek-V3's e_score_correction_bias)."""
    positions: int = 0
    """Rows of the learned absolute position embedding: megatron-core's has model.seq_length (0: none)."""
    mla: Optional[LatentSizes] = None
    """Multi-latent attention's sizes (None: grouped-query attention)."""
    mtp_layers: int = 0
    """Multi-token-prediction layers after the decoder (megatron-core's MTP block, model.mtp_num_layers)."""

    @classmethod
    def of(cls, model) -> "Architecture":
        """From a GPTModelProvider (megatron-core has filled in the defaulted sizes), or the ``model:`` fields."""
        experts = getattr(model, "num_moe_experts", None) or 0
        return cls(model.num_layers, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads,
                   model.num_query_groups or model.num_attention_heads, model.kv_channels, model.vocab_size,
                   model.share_embeddings_and_output_weights, model.add_qkv_bias,
                   model.qk_layernorm, experts, (model.moe_ffn_hidden_size or 0) if experts else 0,
                   moe_layer_pattern(model.moe_layer_freq, model.num_layers) if experts else (),
                   model.moe_shared_expert_intermediate_size if experts else None,
                   bool(experts and model.moe_router_enable_expert_bias),
                   model.seq_length if getattr(model, "position_embedding_type", None) == "learned_absolute" else 0,
                   LatentSizes(model.q_lora_rank, model.kv_lora_rank, model.qk_head_dim, model.qk_pos_emb_head_dim,
                               model.v_head_dim) if getattr(model, "multi_latent_attention", False) else None,
                   getattr(model, "mtp_num_layers", None) or 0)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    @property
    def qkv_rows(self) -> tuple[int, int, int]:
        """Rows of q, k and v in Hugging Face's projections."""
        kv = self.num_query_groups * self.kv_channels
        return self.num_attention_heads * self.kv_channels, kv, kv


def moe_layer_pattern(freq, num_layers: int) -> tuple[bool, ...]:
    """Per layer, whether megatron-core's ``moe_layer_freq`` makes it an MoE layer: a list of 0/1, or
    every ``freq``-th layer starting with the first."""
    if isinstance(freq, int):
        return tuple(i % freq == 0 for i in range(num_layers))
    return tuple(bool(v) for v in freq)


@dataclass(frozen=True)
class Pair:
    """One megatron-core parameter and the Hugging Face tensors (name, shape) it is made of; or, in
    a STACKED layout, each expert's parameter (in expert order) and the one tensor holding them all."""

    mcore: Union[str, tuple[str, ...]]
    hf: tuple[tuple[str, tuple[int, ...]], ...]
    layout: Layout = Layout.SAME

    @property
    def mcore_names(self) -> tuple[str, ...]:
        return self.mcore if isinstance(self.mcore, tuple) else (self.mcore,)

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.hf)


def ignorable(name: str, arch: Architecture) -> bool:
    """Hugging Face tensors an import may skip: RoPE caches, and lm_head when it is tied to the embedding."""
    return name.endswith(IGNORED_SUFFIXES) or (arch.tied and name == "lm_head.weight")


def to_mcore(pair: Pair, tensors: list, arch: Architecture) -> list:
    """The megatron-core parameters (in ``pair.mcore_names`` order) made of ``pair``'s Hugging Face
    tensors (in ``pair.hf`` order)."""
    import torch

    if pair.layout in TRANSPOSES:
        return to_mcore(replace(pair, layout=TRANSPOSES[pair.layout]), [t.t() for t in tensors], arch)
    if pair.layout in STACKED:
        (stacked,) = tensors
        experts = [t.t() if t.dim() == 2 and pair.layout is not Layout.EXPERTS else t for t in stacked.unbind(0)]
        if pair.layout is Layout.EXPERTS_GATE_UP:
            experts = [torch.cat([t[0::2], t[1::2]]) for t in experts]
        return [t.contiguous() for t in experts]
    if pair.layout is Layout.SHARED:
        first, *copies = tensors
        for (name, _), copy in zip(pair.hf[1:], copies):
            if not torch.equal(copy, first):
                from bridge_cli.checkpoint.errors import CheckpointError

                raise CheckpointError(f"tensor {name} differs from {pair.hf[0][0]}: megatron-core's multi-token "
                                      "prediction shares the model's embedding and output head, so bridge converts "
                                      "a model whose copies are equal.")
        return [first]
    if pair.layout is Layout.FUSED_QKV:
        (fused,) = tensors
        tensors = fused.split(arch.qkv_rows, dim=0)
    if pair.layout in (Layout.QKV, Layout.FUSED_QKV):
        g, d, rest = arch.num_query_groups, arch.kv_channels, tensors[0].shape[1:]
        q, k, v = tensors
        grouped = (q.reshape(g, arch.heads_per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
        return [torch.cat(grouped, dim=1).reshape(-1, *rest)]
    if pair.layout is Layout.GATE_UP:
        return [torch.cat(tensors, dim=0)]
    return list(tensors)


def to_hf(pair: Pair, tensors: list, arch: Architecture) -> list:
    """``pair``'s Hugging Face tensors (in ``pair.hf`` order) made of its megatron-core ``tensors`` (in
    ``pair.mcore_names`` order), contiguous and owning their memory.

    safetensors refuses tensors that share storage, so the parts of a fused parameter are copies.
    """
    import torch

    if pair.layout in TRANSPOSES:
        return [t.t().contiguous() for t in to_hf(replace(pair, layout=TRANSPOSES[pair.layout]), tensors, arch)]
    if pair.layout in STACKED:
        if pair.layout is Layout.EXPERTS_GATE_UP:  # [gate; up] -> rows gate 0, up 0, gate 1, up 1, ...
            tensors = [torch.stack(t.chunk(2, dim=0), dim=1).reshape(t.shape) for t in tensors]
        if pair.layout is not Layout.EXPERTS:
            tensors = [t.t() if t.dim() == 2 else t for t in tensors]
        return [torch.stack(tensors)]
    (tensor,) = tensors
    if pair.layout in (Layout.QKV, Layout.FUSED_QKV):
        g, d, rest = arch.num_query_groups, arch.kv_channels, tensor.shape[1:]
        parts = tensor.reshape(g, (arch.heads_per_group + 2) * d, *rest).split([arch.heads_per_group * d, d, d], dim=1)
        if pair.layout is Layout.FUSED_QKV:
            return [torch.cat([part.reshape(-1, *rest) for part in parts])]
        return [part.reshape(-1, *rest).clone() for part in parts]
    if pair.layout is Layout.GATE_UP:
        return [part.clone() for part in tensor.chunk(2, dim=0)]
    if pair.layout is Layout.VOCAB:
        return [tensor[: arch.vocab_size].contiguous()]
    if pair.layout is Layout.SHARED:
        return [tensor[: arch.vocab_size].clone() for _ in pair.hf]
    return [tensor.contiguous()]
