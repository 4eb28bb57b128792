"""MoE experts as grouped GEMMs without Transformer Engine: ``model.moe_grouped_gemm=true`` on the
``local`` and ``torch`` specs.

megatron-core's own experts without Transformer Engine are ``SequentialMLP``: one MLP module per
expert, run in a Python loop. :class:`GroupedGemmExperts` keeps every local expert's weights in one
``[experts, out, in]`` tensor per projection and runs each projection for all experts at once:
``torch._grouped_mm`` on CUDA in bf16 (Hopper and newer), else a loop of GEMMs over the experts
(the CPU, fp32, older GPUs and torch), which is what ``SequentialMLP`` computes. With
``model.gradient_accumulation_fusion``, the grouped weight gradients are added into ``main_grad`` by
one Triton kernel (``grouped_wgrad``) instead of being written in bf16 and added afterwards.

Checkpoints: the sharded state dict is the one ``SequentialMLP`` and ``TEGroupedMLP`` write (they
are interchangeable by design in megatron-core 0.16 to 0.19): ``<layer>.mlp.experts.linear_fc1.weight``
and ``...linear_fc2.weight``, global shape ``[num_experts, out, in]`` with the expert axis split over
expert-parallel ranks, the output (fc1) or input (fc2) axis over expert-tensor-parallel ranks, and
a gated fc1's two halves stored as separately sharded pieces (megatron-core's SwiGLU layout). So a
``torch_dist`` checkpoint moves between this module, ``SequentialMLP``, ``TEGroupedMLP`` and
Megatron-LM, at any EP/ETP size.
"""

from __future__ import annotations

from typing import Optional

import torch
from megatron.core.dist_checkpointing.mapping import ShardedTensor, ShardedTensorFactory
from megatron.core.transformer.module import MegatronModule

from bridge_cli.models import expert_activation, grouped_wgrad


_EXTRA_STATE = "extra_state_of_expert_"
"""Local key prefix of the per-expert ``_extra_state`` objects read back from a checkpoint (dropped)."""


class GroupedGemmExperts(MegatronModule):
    """All local experts of one MoE layer: ``fc2(act(fc1(x)) * prob)`` per token, bias-free."""

    def __init__(self, num_local_experts: int, config, submodules=None, pg_collection=None,
                 name: Optional[str] = None):
        # megatron-core 0.19 passes the module's name; ``submodules`` is SequentialMLP's, unused here.
        super().__init__(config=config)
        self.num_local_experts = num_local_experts
        self.ep_group, self.tp_group, self.dp_group = pg_collection.ep, pg_collection.expt_tp, pg_collection.expt_dp
        tp = self.tp_group.size()
        ffn = config.moe_ffn_hidden_size // tp
        self.gated = config.gated_linear_unit
        self.counted_activation = False
        """Whether the activation stops at the count of real rows (expert_activation.swiglu_probs): set where bridge's
        token dispatcher fills a buffer longer than its count (moe_dispatch.use_device_token_dispatch)."""
        device = "cpu" if config.use_cpu_initialization or not torch.cuda.is_available() else torch.cuda.current_device()
        fc1_out = 2 * ffn if self.gated else ffn
        self.weight1 = torch.nn.Parameter(torch.empty(num_local_experts, fc1_out, config.hidden_size,
                                                      dtype=config.params_dtype, device=device))
        self.weight2 = torch.nn.Parameter(torch.empty(num_local_experts, config.hidden_size, ffn,
                                                      dtype=config.params_dtype, device=device))
        # As megatron-core marks expert linears: reduced over the expert data-parallel group when
        # EP > 1 (allreduce=False), and tensor-parallel at any expert-TP size, so every rank's experts
        # count once in the grad norm (not only those of attention-TP rank 0).
        expert_parallel = config.expert_model_parallel_size > 1
        for weight, axis in ((self.weight1, 1), (self.weight2, 2)):
            weight.allreduce = not expert_parallel
            weight.tensor_model_parallel = True
            weight.partition_dim = axis
            weight.partition_stride = 1
        if config.perform_initialization:
            self._initialize()

    @torch.no_grad()
    def _initialize(self) -> None:
        if self.config.use_cpu_initialization:
            self._initialize_from_full_weights()
            return
        from megatron.core.tensor_parallel import get_cuda_rng_tracker
        from megatron.core.tensor_parallel.random import get_expert_parallel_rng_tracker_name

        with get_cuda_rng_tracker().fork(get_expert_parallel_rng_tracker_name()):
            for expert in range(self.num_local_experts):
                self.config.init_method(self.weight1[expert])
                self.config.output_layer_init_method(self.weight2[expert])

    def _initialize_from_full_weights(self) -> None:
        """megatron-core's CPU initialization, expert by expert as SequentialMLP draws it: each rank
        draws every expert's full fc1 then fc2 from torch's generator and keeps its own slice, so
        any EP and expert-TP size (and SequentialMLP) starts from the same model."""
        tp, tp_rank = self.tp_group.size(), self.tp_group.rank()
        first = self.ep_group.rank() * self.num_local_experts
        ffn = self.weight2.shape[2]
        for expert in range(self.ep_group.size() * self.num_local_experts):
            fc1 = torch.empty(self.weight1.shape[1] * tp, self.weight1.shape[2])
            self.config.init_method(fc1)
            fc2 = torch.empty(self.weight2.shape[1], ffn * tp)
            self.config.output_layer_init_method(fc2)
            local = expert - first
            if 0 <= local < self.num_local_experts:
                # A gated fc1 is [gate; up]: each TP rank keeps its slice of both (stride 2).
                self.weight1[local].copy_(torch.cat(torch.split(fc1, ffn)[tp_rank::tp]))
                self.weight2[local].copy_(torch.split(fc2, ffn, dim=1)[tp_rank])

    def forward(self, hidden: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor):
        """``hidden``: tokens sorted by local expert, ``tokens_per_expert[i]`` rows each."""
        if self.config.moe_apply_probs_on_input:
            hidden = (probs.unsqueeze(-1) * hidden).to(hidden.dtype)
            probs = torch.ones_like(probs)
        intermediate = self.project("linear_fc1", hidden, tokens_per_expert)
        if self.counted_activation:
            intermediate = expert_activation.swiglu_probs(intermediate, probs, tokens_per_expert.sum())
        else:
            intermediate = self._activation(intermediate)
            intermediate = (intermediate * probs.unsqueeze(-1)).to(hidden.dtype)
        return self.project("linear_fc2", intermediate, tokens_per_expert), None

    def project(self, linear: str, x: torch.Tensor, tokens_per_expert: torch.Tensor) -> torch.Tensor:
        """One projection (``linear_fc1`` or ``linear_fc2``) of every local expert over its tokens."""
        weight = self.weight1 if linear == "linear_fc1" else self.weight2
        return grouped_linear(x, weight, tokens_per_expert, self.config.gradient_accumulation_fusion)

    def _activation(self, x: torch.Tensor) -> torch.Tensor:
        """megatron-core's MLP activation without bias fusion (the same numbers)."""
        cfg = self.config
        if not self.gated:
            return cfg.activation_func(x)
        x_glu, x_linear = torch.chunk(x, 2, dim=-1)
        if cfg.activation_func_clamp_value is not None:
            x_glu = x_glu.clamp(min=None, max=cfg.activation_func_clamp_value)
            x_linear = x_linear.clamp(min=-cfg.activation_func_clamp_value, max=cfg.activation_func_clamp_value)
        return cfg.activation_func(x_glu) * (x_linear + cfg.glu_linear_offset)

    def backward_dw(self) -> None:
        """Weight gradients are not deferred here; megatron-core's overlap schedule calls this."""

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: Optional[dict] = None):
        """SequentialMLP's checkpoint keys and global shapes (see the module docstring)."""
        if (metadata or {}).get("singleton_local_shards", False):
            raise NotImplementedError("singleton_local_shards checkpoints are not written by bridge")
        prepend = len(sharded_offsets)
        ep_rank, ep_size = self.ep_group.rank(), self.ep_group.size()
        tp_rank, tp_size = self.tp_group.rank(), self.tp_group.size()
        replica_id = (0, 0, self.dp_group.rank())
        expert_axis = (prepend, ep_rank, ep_size)

        def sharded(key: str, tensor: torch.Tensor, tp_axis: int, tp_offset: int, tp_fragments: int) -> ShardedTensor:
            return ShardedTensor.from_rank_offsets(
                key, tensor, *sharded_offsets, expert_axis, (prepend + tp_axis, tp_offset, tp_fragments),
                replica_id=replica_id, prepend_axis_num=prepend)

        # megatron-core's MoE layer hands its experts the prefix "<layer>.mlp.experts."; SequentialMLP
        # and TEGroupedMLP both key their weights one "experts." deeper.
        fc1_key, fc2_key = f"{prefix}experts.linear_fc1.weight", f"{prefix}experts.linear_fc2.weight"
        fc2 = sharded(fc2_key, self.weight2, 2, tp_rank, tp_size)
        if not self.gated:
            fc1 = sharded(fc1_key, self.weight1, 1, tp_rank, tp_size)
        else:
            # The gate and up halves are sharded separately, so the global tensor is
            # [gate of every TP rank, up of every TP rank]: the same at any TP size.
            def build(key, tensor, replica, flattened_range):
                gate, up = torch.chunk(tensor, 2, dim=1)
                return [sharded(key, gate, 1, tp_rank, 2 * tp_size), sharded(key, up, 1, tp_rank + tp_size, 2 * tp_size)]

            def merge(pieces):
                return torch.cat(pieces, dim=1)

            fc1 = ShardedTensorFactory(fc1_key, self.weight1, build, merge, replica_id)
        state = {f"{prefix}linear_fc1.weight": fc1, f"{prefix}linear_fc2.weight": fc2}
        state.update(self._empty_extra_states(prefix, sharded_offsets))
        return state

    def _empty_extra_states(self, prefix: str, sharded_offsets: tuple) -> dict:
        """SequentialMLP's linears each write an (empty) ``_extra_state`` object per expert, and
        expect to read one back: write them, so its loads of these checkpoints find them."""
        from megatron.core.transformer.utils import make_sharded_object_for_checkpoint

        first = self.ep_group.rank() * self.num_local_experts
        total = self.ep_group.size() * self.num_local_experts
        replica_id = (0, self.tp_group.rank(), self.dp_group.rank())
        objects = {}
        for local in range(self.num_local_experts):
            offsets = (*sharded_offsets, (len(sharded_offsets), first + local, total))
            for linear in ("linear_fc1", "linear_fc2"):
                objects[f"{prefix}{_EXTRA_STATE}{local}.{linear}"] = make_sharded_object_for_checkpoint(
                    None, f"{prefix}experts.{linear}._extra_state", offsets, replica_id)
        return objects

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Accept the sharded state dict's names (``linear_fc1.weight``) as well as the module's own."""
        for sharded_name, own_name in (("linear_fc1.weight", "weight1"), ("linear_fc2.weight", "weight2")):
            if prefix + sharded_name in state_dict:
                state_dict[prefix + own_name] = state_dict.pop(prefix + sharded_name)
        for key in [k for k in state_dict if k.startswith(prefix + _EXTRA_STATE)]:
            del state_dict[key]
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor, tokens_per_expert: torch.Tensor,
                   into_main_grad: bool = False) -> torch.Tensor:
    """Rows of ``x`` grouped by expert (``tokens_per_expert[e]`` rows for expert e) times each
    expert's ``weight[e].T``: one grouped GEMM where the device has it, else a loop of GEMMs. Rows
    past the last expert's are not computed (zero in the loop; unwritten by the grouped GEMM).
    ``into_main_grad``: the weight's gradient is added into its ``main_grad`` by the weight-gradient
    GEMM (``model.gradient_accumulation_fusion``) where :func:`flag_main_grad_weights` flagged the
    weight for it (a weight wrapped for data-parallel training)."""
    offsets = torch.cumsum(tokens_per_expert.to(device=x.device), dim=0, dtype=torch.int32)
    if into_main_grad and getattr(weight, "grad_added_to_main_grad", False) and hasattr(weight, "main_grad"):
        return _GroupedLinearIntoMainGrad.apply(x, weight, offsets, weight.main_grad)
    return _grouped_matmul(x, weight, offsets)


def flag_main_grad_weights(module: torch.nn.Module) -> set:
    """Flag the expert weights of every :class:`GroupedGemmExperts` in ``module`` whose config sets
    ``gradient_accumulation_fusion`` and that the data-parallel wrapper gave a ``main_grad``: their
    gradients are then added into it by :func:`grouped_linear`, and the wrapper skips the placeholder
    gradient. Flagged once here rather than in each backward (a Python attribute that a compiled backward
    cannot set); returns the flagged weights, which the caller keeps out of the wrapper's per-step reset."""
    flagged = set()
    for experts in module.modules():
        if not isinstance(experts, GroupedGemmExperts) or not experts.config.gradient_accumulation_fusion:
            continue
        for weight in (experts.weight1, experts.weight2):
            if weight.requires_grad and hasattr(weight, "main_grad"):
                weight.grad_added_to_main_grad = True
                flagged.add(weight)
    return flagged


class _GroupedLinearIntoMainGrad(torch.autograd.Function):
    """:func:`_grouped_matmul` whose weight gradient :func:`grouped_wgrad.accumulate_op` adds into
    ``main_grad`` (the Triton kernel on CUDA), in a form ``torch.compile`` keeps in the layer's graph:
    ``main_grad`` comes in as an input the backward's custom op mutates, and the weight's own gradient is an
    unused placeholder, which the data-parallel wrapper skips (the flag :func:`flag_main_grad_weights` set)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor, main_grad: torch.Tensor):
        ctx.save_for_backward(x, weight, offsets)
        ctx.main_grad = main_grad  # not saved: torch's version check would trip on the in-place add
        return _grouped_matmul(x, weight, offsets)

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        x, weight, offsets = ctx.saved_tensors
        grad_output = grad_output.contiguous()
        grad_x = _grouped_matmul(grad_output, weight.transpose(1, 2), offsets) if ctx.needs_input_grad[0] else None
        grouped_wgrad.accumulate_op(grad_output, x, offsets, ctx.main_grad)
        return grad_x, torch.empty_like(weight), None, None


def _grouped_matmul(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's rows of ``x`` (up to ``offsets[e]``, cumulative) times its ``weight[e].T``:
    ``torch._grouped_mm`` where :func:`_grouped_mm_supported`, else one GEMM per expert (rows past the
    last expert's zero)."""
    if _grouped_mm_supported(x, weight):
        return _grouped_mm(x, weight, offsets)
    ends = offsets.tolist()
    counts = [end - start for start, end in zip([0, *ends[:-1]], ends)]
    pieces = torch.split(x, [*counts, x.shape[0] - sum(counts)])  # rows past the counts: the dispatcher's unused tail
    tail = pieces[-1].new_zeros(pieces[-1].shape[0], weight.shape[1])
    return torch.cat([*(piece @ weight[e].t() for e, piece in enumerate(pieces[:-1])), tail], dim=0)


def _grouped_mm(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's rows of ``x`` (up to ``offsets[e]``, cumulative) times its ``weight[e].T``, one grouped GEMM."""
    return torch._grouped_mm(x, weight.transpose(1, 2), offs=offsets)


def _grouped_mm_supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """torch._grouped_mm's bf16 kernels: CUDA, compute capability 9.0 or newer, torch >= 2.8, rows of
    16-byte multiples (a LoRA rank of 4 is not)."""
    if not (x.is_cuda and x.dtype == torch.bfloat16 and hasattr(torch, "_grouped_mm")):
        return False
    if any(size % 8 for size in weight.shape[1:]):
        return False
    return torch.cuda.get_device_capability(x.device)[0] >= 9
