"""Routed experts with biases (``model.add_bias_linear``, GPT-OSS) that train right on the local and torch specs.

megatron-core (0.16) computes biased experts at expert TP 1 only, and its ``RowParallelLinear`` as an
expert's ``linear_fc2`` mishandles that one-rank group twice:

- it reduces its output over the group, through a custom autograd Function that returns its input as
  a view; the expert MLP then adds the bias, weighted by each token's routing probability, in place
  (``output += output_bias * per_token_scale``), which autograd refuses: the first backward fails
  unless the experts are expert-parallel (then megatron-core skips that reduction, the token
  dispatcher communicating instead);
- it marks its bias ``sequence_parallel`` under sequence parallelism (``ColumnParallelLinear`` unmarks
  itself on a one-rank group, ``RowParallelLinear`` does not), so the gradients are all-reduced over
  the attention's tensor-parallel group on top of the experts' own reduction: at TP > 1 the bias
  learns from a sum counted twice;
- it leaves its bias unmarked as tensor-parallel, so the grad norm counts it on attention-TP rank 0
  only, although each rank holds its own experts.

:class:`ExpertRowParallelLinear` skips the identity reduction, as for expert-parallel experts, and
marks its bias as the experts' weights are: the same forward numbers, and gradients and grad norm
equal to one process's (tested at TP 2 x EP 2).
"""

from __future__ import annotations

from megatron.core.tensor_parallel.layers import RowParallelLinear, set_tensor_model_parallel_attributes


class ExpertRowParallelLinear(RowParallelLinear):
    """megatron-core's RowParallelLinear, as an expert's linear_fc2 on a one-rank expert TP group."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.is_expert and self.tp_group.size() == 1:
            self.explicit_expert_comm = True
            self.sequence_parallel = False  # nothing to shard over one rank
            if self.bias is not None:
                self.bias.sequence_parallel = False
                # each rank's experts are its own: count their biases in the grad norm on every rank, as the
                # weights are (megatron-core counts unmarked parameters on attention-TP rank 0 only)
                set_tensor_model_parallel_attributes(self.bias, True, 0, 1)
