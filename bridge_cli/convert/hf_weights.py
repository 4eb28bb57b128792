"""Tensor names and layouts: megatron-core GPTModel (one rank) <-> Hugging Face Llama/Mistral/Qwen2.

The megatron-core names are the module names of the ``torch``/``local`` layer spec on one rank;
its sharded state dict stores them under Transformer Engine's keys, so a checkpoint written from
it loads with any spec. Three layouts differ from Hugging Face's:

- ``linear_qkv`` fuses q, k and v, interleaved per query group: for each of the
  ``num_query_groups`` groups, that group's query heads, then its key head, then its value head
  (``heads_per_group * kv_channels``, ``kv_channels``, ``kv_channels`` rows). Its bias (Qwen2)
  follows the same order.
- ``linear_fc1`` is ``[gate; up]``: megatron-core's SwiGLU applies the activation to the first half.
- The embedding and output layer may hold padding rows beyond the vocabulary
  (``make_vocab_size_divisible_by``); export drops them.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)
"""Hugging Face tensors that carry no weights (old Llama checkpoints saved the RoPE frequencies)."""


class Layout(Enum):
    SAME = "same"
    QKV = "qkv"
    GATE_UP = "gate_up"
    VOCAB = "vocab"


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

    @classmethod
    def of(cls, model) -> "Architecture":
        """From a GPTModelProvider (megatron-core has filled in the defaulted sizes)."""
        return cls(model.num_layers, model.hidden_size, model.ffn_hidden_size, model.num_attention_heads,
                   model.num_query_groups or model.num_attention_heads, model.kv_channels, model.vocab_size,
                   model.share_embeddings_and_output_weights, model.add_qkv_bias)

    @property
    def heads_per_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups


@dataclass(frozen=True)
class Pair:
    """One megatron-core parameter and the Hugging Face tensors (name, shape) it is made of."""

    mcore: str
    hf: tuple[tuple[str, tuple[int, ...]], ...]
    layout: Layout = Layout.SAME

    @property
    def hf_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.hf)


def pairs(arch: Architecture) -> list[Pair]:
    """Every parameter of the model, in the order a Hugging Face checkpoint lists them."""
    h, v = arch.hidden_size, arch.vocab_size
    out = [Pair("embedding.word_embeddings.weight", (("model.embed_tokens.weight", (v, h)),), Layout.VOCAB)]
    for i in range(arch.num_layers):
        out += _layer_pairs(arch, i)
    out.append(Pair("decoder.final_layernorm.weight", (("model.norm.weight", (h,)),)))
    if not arch.tied:
        out.append(Pair("output_layer.weight", (("lm_head.weight", (v, h)),), Layout.VOCAB))
    return out


def _layer_pairs(arch: Architecture, i: int) -> list[Pair]:
    h, f = arch.hidden_size, arch.ffn_hidden_size
    q_rows, kv_rows = arch.num_attention_heads * arch.kv_channels, arch.num_query_groups * arch.kv_channels
    m, p = f"decoder.layers.{i}.", f"model.layers.{i}."
    attn = p + "self_attn."
    layer = [
        Pair(m + "input_layernorm.weight", ((p + "input_layernorm.weight", (h,)),)),
        Pair(m + "self_attention.linear_qkv.weight", ((attn + "q_proj.weight", (q_rows, h)),
                                                       (attn + "k_proj.weight", (kv_rows, h)),
                                                       (attn + "v_proj.weight", (kv_rows, h))), Layout.QKV),
    ]
    if arch.qkv_bias:
        layer.append(Pair(m + "self_attention.linear_qkv.bias", ((attn + "q_proj.bias", (q_rows,)),
                                                                 (attn + "k_proj.bias", (kv_rows,)),
                                                                 (attn + "v_proj.bias", (kv_rows,))), Layout.QKV))
    return layer + [
        Pair(m + "self_attention.linear_proj.weight", ((attn + "o_proj.weight", (h, q_rows)),)),
        Pair(m + "pre_mlp_layernorm.weight", ((p + "post_attention_layernorm.weight", (h,)),)),
        Pair(m + "mlp.linear_fc1.weight", ((p + "mlp.gate_proj.weight", (f, h)),
                                           (p + "mlp.up_proj.weight", (f, h))), Layout.GATE_UP),
        Pair(m + "mlp.linear_fc2.weight", ((p + "mlp.down_proj.weight", (h, f)),)),
    ]


def ignorable(name: str, arch: Architecture) -> bool:
    """Hugging Face tensors an import may skip: RoPE caches, and lm_head when it is tied to the embedding."""
    return name.endswith(IGNORED_SUFFIXES) or (arch.tied and name == "lm_head.weight")


def to_mcore(pair: Pair, tensors: list[torch.Tensor], arch: Architecture) -> torch.Tensor:
    """The megatron-core parameter made of ``pair``'s Hugging Face tensors (in ``pair.hf`` order)."""
    if pair.layout is Layout.QKV:
        g, d, rest = arch.num_query_groups, arch.kv_channels, tensors[0].shape[1:]
        q, k, v = tensors
        grouped = (q.reshape(g, arch.heads_per_group * d, *rest), k.reshape(g, d, *rest), v.reshape(g, d, *rest))
        return torch.cat(grouped, dim=1).reshape(-1, *rest)
    if pair.layout is Layout.GATE_UP:
        return torch.cat(tensors, dim=0)
    (tensor,) = tensors
    return tensor


def to_hf(pair: Pair, tensor: torch.Tensor, arch: Architecture) -> list[torch.Tensor]:
    """``pair``'s Hugging Face tensors (in ``pair.hf`` order), contiguous and owning their memory.

    safetensors refuses tensors that share storage, so the parts of a fused parameter are copies.
    """
    if pair.layout is Layout.QKV:
        g, d, rest = arch.num_query_groups, arch.kv_channels, tensor.shape[1:]
        parts = tensor.reshape(g, (arch.heads_per_group + 2) * d, *rest).split([arch.heads_per_group * d, d, d], dim=1)
        return [part.reshape(-1, *rest).clone() for part in parts]
    if pair.layout is Layout.GATE_UP:
        return [part.clone() for part in tensor.chunk(2, dim=0)]
    if pair.layout is Layout.VOCAB:
        return [tensor[: arch.vocab_size].contiguous()]
    return [tensor.contiguous()]
