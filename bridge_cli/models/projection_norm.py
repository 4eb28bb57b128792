"""RMSNorm of each token's whole query or key projection, all heads at once:
``model.qk_layernorm_across_heads=true`` (OLMoE's q/k norm).

megatron-core's ``qk_layernorm`` normalises each head on its own (Qwen3); OLMoE normalises the
``heads * head_dim`` values of a token's query projection together, and likewise its keys, with
one weight per value. Under tensor parallelism each rank holds some of the heads, so the sum of
squares is all-reduced over the tensor-parallel group (its gradient too). Every rank holds the
whole weight and uses the part of its heads: megatron-core sums the gradients of parameters named
``q_layernorm``/``k_layernorm`` over the tensor-parallel group (it does so for its per-head norms),
which here adds up each rank's part into the whole gradient, and the checkpoint stores the weight
once, as ``q_layernorm.weight``.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.transformer.spec_utils import ModuleSpec


class ProjectionRMSNorm(torch.nn.Module):
    """The norm of the query (``projection="query"``) or key projection of one attention layer."""

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, projection: str = "query"):
        # ``hidden_size`` is the head size megatron-core's attention passes to its q/k norms.
        super().__init__()
        heads = config.num_attention_heads if projection == "query" else config.num_query_groups
        self.group = parallel_state.get_tensor_model_parallel_group()
        self.tp = config.tensor_model_parallel_size
        self.size = heads * hidden_size
        local, rank = self.size // self.tp, parallel_state.get_tensor_model_parallel_rank()
        self.local = slice(rank * local, (rank + 1) * local)
        """The part of the weight that this rank's heads use."""
        self.eps = eps
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        self.weight = torch.nn.Parameter(torch.ones(self.size, dtype=config.params_dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``[sequence, batch, local heads, head size]``; computed in float32, as transformers does."""
        flat = x.flatten(-2).float()
        squares = flat.pow(2).sum(-1, keepdim=True)
        if self.tp > 1:
            squares = torch.distributed.nn.functional.all_reduce(squares, group=self.group)
        normed = flat * torch.rsqrt(squares / self.size + self.eps)
        return (self.weight[self.local] * normed.to(x.dtype)).view_as(x)


def projection_norm_specs() -> tuple[ModuleSpec, ModuleSpec]:
    """The (query, key) norm specs for an attention layer's ``q_layernorm``/``k_layernorm``."""
    return (ModuleSpec(module=ProjectionRMSNorm, params={"projection": "query"}),
            ModuleSpec(module=ProjectionRMSNorm, params={"projection": "key"}))
