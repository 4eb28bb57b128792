"""``model.gradient_accumulation_fusion`` for the word embedding: its gradient rows added straight into ``main_grad``.

megatron-core fuses the weight-gradient accumulation of its linears only. The word embedding's backward writes a
dense bf16 gradient of the whole table (zeroed, then the looked-up rows scattered in), which the data-parallel
wrapper then adds into the fp32 ``main_grad``: two passes over vocabulary x hidden values per micro-batch for a
few thousand rows (128K x 2048 for the 1.5B proxy: 2.2 ms of adds a step on one H100, docs/performance.md).
:class:`MainGradEmbedding` adds the rows of the micro-batch into ``main_grad`` in its backward (``index_add_``: on one
H100 0.34 ms for a 16K-token micro-batch of mock or Zipf-distributed tokens, where the dense gradient and its add take
1.6; ``index_put_`` with accumulation, sorted by row, took 2.3 on the Zipf tokens, whose frequent rows it adds one token
at a time) and hands autograd megatron-core's placeholder gradient, as its fused linears do. On CUDA the order in which
a repeated row's tokens are added varies from run to run, as in cuDNN's attention backward.

It takes the unsplit table only (one tensor-parallel rank), where megatron-core's forward is the plain lookup;
a table split over tensor-parallel ranks or scattered over the sequence, a weight shared with the output layer on
the same pipeline stage (whose placeholder gradient megatron-core zeroes and adds), or a weight without ``main_grad``
(before the data-parallel wrap, frozen) take megatron-core's forward as it is.
"""

from __future__ import annotations

import torch
from megatron.core.tensor_parallel import VocabParallelEmbedding


class MainGradEmbedding(VocabParallelEmbedding):
    """megatron-core's VocabParallelEmbedding whose lookup, where it can, adds its gradient into ``main_grad``."""

    def forward(self, input_: torch.Tensor) -> torch.Tensor:
        weight = self.weight
        if (self.tp_group.size() > 1 or self.reduce_scatter_embeddings or getattr(self, "gtp_remat_size", 1) > 1
                or not torch.is_grad_enabled() or not weight.requires_grad or not hasattr(weight, "main_grad")
                or getattr(weight, "zero_out_wgrad", False)):
            return super().forward(input_)
        return _LookupIntoMainGrad.apply(weight, input_)


def use_main_grad_embedding(embedding: VocabParallelEmbedding) -> None:
    """Make a built ``VocabParallelEmbedding`` a :class:`MainGradEmbedding` (same state, same checkpoint keys)."""
    if type(embedding) is VocabParallelEmbedding:
        embedding.__class__ = MainGradEmbedding


class _LookupIntoMainGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weight: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(indices)
        ctx.weight = weight
        return torch.nn.functional.embedding(indices, weight)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (indices,) = ctx.saved_tensors
        weight = ctx.weight
        main_grad = weight.main_grad
        main_grad.index_add_(0, indices.reshape(-1), grad_output.reshape(-1, main_grad.shape[-1]).to(main_grad.dtype))
        weight.grad_added_to_main_grad = True
        # megatron-core's placeholder: its data-parallel hook skips the add for a weight whose gradient is in main_grad
        return torch.empty(weight.shape, dtype=weight.dtype, device=weight.device), None
