"""Multi-latent attention (DeepSeek-V2/V3, Kimi K2, Moonlight) on the ``torch`` spec, without Transformer Engine.

It is megatron-core's own ``MLASelfAttention``, built from its local layer spec (``ColumnParallelLinear``
projections, torch RMSNorms for the latent norms ``q_layernorm``/``kv_layernorm``, the row-parallel
``linear_proj``) with the torch spec's core attention
(:class:`~bridge_cli.models.attention.core.TorchAttention`), which reads the key and value head sizes from its
inputs: ``qk_head_dim + qk_pos_emb_head_dim`` against ``v_head_dim``. What megatron-core leaves to
Transformer Engine, or gets wrong without it, is fixed here, in one place:

- :func:`allow_without_transformer_engine`: megatron-core (0.16 to 0.19) imports Transformer Engine's
  ``TELinear`` into ``multi_latent_attention`` and, when Transformer Engine is absent, gets a placeholder
  (a ``MagicMock``) with ``HAVE_TE`` still true, so building the attention fails at
  ``isinstance(self.linear_proj, TELinear)``. That check only concerns Transformer Engine's FP8 linears;
  where ``TELinear`` is not a class, this turns it off.
- :class:`TorchMLASelfAttention`: rows of several documents (:class:`~bridge_cli.models.attention.masks.
  DocumentParams`). megatron-core's MLA reads any ``packed_seq_params`` as THD and squeezes the batch axis
  of its latents, which breaks ``[s, b]`` rows; here the projections see no packed parameters (the core
  attention still gets them, and masks each document), and the RoPE table is gathered at each token's
  position in its document, as :class:`~bridge_cli.models.gpt_model.GPTModel` does for the other layers.
- :meth:`TorchMLASelfAttention._resolve_qk_norm_config`: megatron-core 0.19 no longer builds the projections and
  latent norms the spec names but asks its ``QKNormConfigResolver``, which with ``qk_layernorm`` and
  ``q_lora_rank`` null wants ``linear_q_proj`` to be a fused norm+linear: Transformer Engine's
  ``TELayerNormColumnParallelLinear`` (a norm on the query's input that DeepSeek-V2-Lite and Moonlight do not have),
  a placeholder without Transformer Engine, and on the local backend a ``RuntimeError``. The torch spec builds what
  its spec names, as 0.16 to 0.18 do: no query norm without a query latent (:func:`use_torch_mla` makes the spec's
  ``q_layernorm`` an ``IdentityOp`` there), ``linear_q_proj`` a ``ColumnParallelLinear``. The checkpoint keys and
  the numbers are those of every supported version.
- :data:`TE_KEYS`: the checkpoint keys of Transformer Engine's MLA layer (its up projections hold the latent
  norms as ``layer_norm_weight``, a dense MLP's ``linear_fc1`` the pre-MLP norm), so a checkpoint written
  on the torch spec loads in a Transformer Engine run (Megatron-LM's too) and back.

The down projections are column-parallel as in megatron-core's local spec: under tensor parallelism each
rank computes part of the latents and they are all-gathered, so ``q_lora_rank`` and
``kv_lora_rank + qk_pos_emb_head_dim`` must be multiples of the tensor-parallel size (refused otherwise).
megatron-core gathers the key/value latent with ``gather_from_tensor_model_parallel_region``, whose backward
keeps this rank's columns of this rank's gradient; but the RoPE key shared by all heads gets from each rank the
gradient of that rank's heads only, so the columns of the RoPE key learnt from part of the heads (the losses
drifted from one process's by 1e-4 from the second step at TP=2). :class:`TorchMLASelfAttention` gathers the
latent itself, right after ``linear_kv_down_proj``, with a backward that sums the RoPE key's gradient over the
tensor-parallel ranks (under sequence parallelism megatron-core's own gather of the RoPE key sums it, and the
latent is scattered back to this rank's tokens, as Transformer Engine's duplicated projection leaves it).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

from bridge_cli.models.attention.masks import DocumentParams
from bridge_cli.runtime.errors import RuntimeUnavailable

TE_KEYS = {
    "self_attention.q_layernorm.": "self_attention.linear_q_up_proj.layer_norm_",
    "self_attention.kv_layernorm.": "self_attention.linear_kv_up_proj.layer_norm_",
}
"""Module prefix -> Transformer Engine's checkpoint prefix, in every MLA layer."""
TE_DENSE_MLP_KEYS = {"pre_mlp_layernorm.": "mlp.linear_fc1.layer_norm_"}
"""The same in a dense MLP layer (Transformer Engine fuses the norm into ``linear_fc1``; MoE layers keep it)."""


def allow_without_transformer_engine() -> None:
    """Turn off megatron-core's Transformer Engine check in MLA where ``TELinear`` is a placeholder, not a class."""
    from megatron.core.transformer import multi_latent_attention

    if not isinstance(multi_latent_attention.TELinear, type):
        multi_latent_attention.HAVE_TE = False


def check_config(config, spec: str) -> None:
    """Refuse what the torch spec's MLA does not do, naming the field."""
    if spec == "local":
        raise RuntimeUnavailable("model.multi_latent_attention=true needs model.spec=torch (or te): the local spec's "
                                 "core attention takes one head size for keys and values, MLA has two.")
    if config.fp8:
        raise RuntimeUnavailable(f"model.fp8={config.fp8} with model.multi_latent_attention=true is not supported by "
                                 "the torch spec (its FP8 linears do not cover MLA's projections); use model.spec=te "
                                 "or set model.fp8=null.")
    if getattr(config, "cache_mla_latents", False):
        raise RuntimeUnavailable("model.cache_mla_latents=true (inference with absorbed latents) is not supported by "
                                 "the torch spec; set it to false.")
    if getattr(config, "mla_down_proj_fusion", False):  # megatron-core 0.19's field
        raise RuntimeUnavailable("model.mla_down_proj_fusion=true (one fused q/kv down projection) is not supported "
                                 "by the torch spec, whose local layer spec ignores it; set it to false or "
                                 "model.spec=te.")
    if getattr(config, "apply_rope_fusion", False):
        raise RuntimeUnavailable("model.apply_rope_fusion=true with model.multi_latent_attention=true needs "
                                 "Transformer Engine's fused MLA RoPE kernels; set model.apply_rope_fusion=false "
                                 "or model.spec=te.")
    tp = config.tensor_model_parallel_size
    latents = {"model.kv_lora_rank + model.qk_pos_emb_head_dim": config.kv_lora_rank + config.qk_pos_emb_head_dim}
    if config.q_lora_rank is not None:
        latents["model.q_lora_rank"] = config.q_lora_rank
    for name, size in latents.items():
        if size % tp:
            raise RuntimeUnavailable(f"{name} = {size} is not a multiple of model.tensor_model_parallel_size={tp}: "
                                     "the torch spec splits MLA's down projections over the tensor-parallel ranks. "
                                     "Use a tensor-parallel size that divides it, or model.spec=te.")


def use_torch_mla(layers: list, dense_layers: list, q_lora_rank: Optional[int]) -> None:
    """Make the MLA layer specs of megatron-core's local spec build :class:`TorchMLASelfAttention` and write
    Transformer Engine's checkpoint keys (``dense_layers``: those whose MLP is dense); with ``q_lora_rank`` null
    the query has no latent, so the spec has no query norm."""
    from megatron.core.transformer.identity_op import IdentityOp

    for layer in layers:
        layer.submodules.self_attention.module = TorchMLASelfAttention
        if q_lora_rank is None:
            layer.submodules.self_attention.submodules.q_layernorm = IdentityOp
        keys = {**TE_KEYS, **(TE_DENSE_MLP_KEYS if any(layer is d for d in dense_layers) else {})}
        layer.submodules.sharded_state_dict_keys_map = {**layer.submodules.sharded_state_dict_keys_map, **keys}


class TorchMLASelfAttention(MLASelfAttention):
    """megatron-core's ``MLASelfAttention`` that takes rows of several documents (see the module's doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rotary_pos_emb = DocumentRotary(self.rotary_pos_emb)
        if self.tp_group is not None and self.tp_group.size() > 1:
            self.linear_kv_down_proj.register_forward_hook(self._whole_kv_latent)

    def _resolve_qk_norm_config(self, submodules) -> dict:
        """The projections and latent norms the spec names, unchanged (megatron-core 0.19 calls this; see the
        module's doc)."""
        names = ("linear_q_proj", "linear_q_up_proj", "linear_kv_up_proj", "q_layernorm", "kv_layernorm")
        return {name: getattr(submodules, name) for name in names}

    def _whole_kv_latent(self, module, args, output):
        """``linear_kv_down_proj``'s output with every rank's columns (see the module's doc)."""
        from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                            scatter_to_sequence_parallel_region)

        columns, bias = output
        if self.config.sequence_parallel:
            whole = gather_from_tensor_model_parallel_region(columns, group=self.tp_group)
            return scatter_to_sequence_parallel_region(whole, group=self.tp_group), bias
        return _GatherLatent.apply(columns, self.tp_group, self.config.qk_pos_emb_head_dim), bias

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, **kwargs):
        if not isinstance(packed_seq_params, DocumentParams):
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids,
                                                       packed_seq_params, inference_context=inference_context,
                                                       **kwargs)
        self.rotary_pos_emb.positions = packed_seq_params.rope_positions
        try:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids, None,
                                                       inference_context=inference_context, **kwargs)
        finally:
            self.rotary_pos_emb.positions = None


class DocumentRotary(torch.nn.Module):
    """MLA's RoPE table (megatron-core's ``RotaryEmbedding`` or ``YarnRotaryEmbedding``), gathered at each token's
    position in its document while ``positions`` (``[b, s]``, this rank's tokens) is set: ``[s, b, 1, d]``."""

    def __init__(self, rotary: torch.nn.Module):
        super().__init__()
        self.rotary = rotary
        self.positions = None

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.rotary.get_rotary_seq_len(*args, **kwargs)

    def forward(self, seq_len: int, packed_seq: bool = False):
        out = self.rotary(seq_len, packed_seq=packed_seq)
        if self.positions is None:
            return out
        # the whole row's table (under context parallelism ``out`` is this rank's part of it)
        table = self.rotary.get_emb(seq_len)
        table = table[0] if isinstance(table, tuple) else table  # YaRN's comes with its cos/sin scale
        emb = table[:, 0][self.positions.t()]
        return (emb, out[1]) if isinstance(out, tuple) else emb


class _GatherLatent(torch.autograd.Function):
    """All-gather the key/value latent's columns over ``group``; the backward sums the last ``rope`` columns' gradient
    (the RoPE key's, which each rank has for its own heads only) over the group and keeps this rank's columns."""

    @staticmethod
    def forward(ctx, columns: torch.Tensor, group, rope: int) -> torch.Tensor:
        ctx.group, ctx.rope = group, rope
        parts = [torch.empty_like(columns) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, columns.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.clone()
        rope = grad[..., -ctx.rope:].contiguous()
        dist.all_reduce(rope, group=ctx.group)
        grad[..., -ctx.rope:] = rope
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=-1)[rank].contiguous(), None, None
