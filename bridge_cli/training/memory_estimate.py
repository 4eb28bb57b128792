"""Memory per GPU of a training run, from its config alone: what ``--dry-run --device cuda`` prints.

The estimate adds, for the pipeline stage that holds the most:

- weights in ``model.params_dtype``, on this rank's share of the layers (split by TP, experts by EP and expert TP);
- gradients in the DDP buffer's dtype (fp32 with ``ddp.grad_reduce_in_fp32``, the buffer that
  ``gradient_accumulation_fusion`` adds into), trainable weights only (LoRA: the adapters);
- optimizer state: fp32 main weights under bf16/fp16, Adam's two moments (SGD's momentum), sharded by the
  distributed optimizer over the data-parallel x context-parallel group, expert weights over the expert
  data-parallel group;
- under FSDP (torch FSDP2, or Megatron-FSDP's sharding strategy) weights, gradients and optimizer state divided by
  the data-parallel x context-parallel size as it shards them, plus the whole layers it gathers at a time (the one
  running and the one prefetched; one layer's gradients in the backward);
- activations: what each layer keeps for its backward per micro-batch (flash attention: no seq^2 scores,
  except the ``local`` spec), sequence parallelism dividing by TP what TP alone replicates, CP dividing the
  sequence, recompute keeping only what its settings keep, times the micro-batches 1F1B holds in flight on
  the stage (PP on the first, more with virtual stages), plus one layer's backward working set;
- the logits of one micro-batch, in the dtype the loss keeps (sharded over TP);
- DPO (``finetune.objective=dpo``): an unpacked pair's two rows in every activation and logit count, and without
  ``peft`` the reference's frozen copy of the weights (under LoRA the reference is the base with its adapters off);
- distillation: the teacher's weights at its own shape (read from ``distill.teacher_checkpoint``), its logits in
  fp32, kept through the model's forward and backward, and the KL's softmaxes (:data:`DISTILL_LOGIT_BYTES`);
- the reference's or teacher's forward pass (no gradients), which runs before the model's on each micro-batch:
  one layer's working set and its logits at a time, with nothing of the model's activations; the peak is the
  larger of that and the model's pass;
- under pipeline parallelism, the reference's or teacher's hidden states that ride with the model's between stages
  (:mod:`bridge_cli.training.frozen_pipeline`): the rows each stage receives and those it sends, at the frozen
  model's width laid out as rows of the model's, held with the model's own for every micro-batch in flight;
- a fixed allowance for what torch's allocator does not count (the CUDA context, NCCL's buffers);
- FP8 (tensor-wise, compiled layers, bridge's FP8 linears): each layer that runs in FP8 keeps
  :data:`FP8_LAYER_ACTIVATIONS` of what it keeps in bf16, a measured ratio.

What it leaves out: other FP8 (estimated as bf16: row-wise and eager layers; eager tensor-wise FP8 under torch
FSDP2 keeps each FP8 layer's whole weight in fp8 for its backward, 1 byte a parameter, more than the fp8 copies of
its inputs save: llama8b about +1.9 GiB, tests/integration/test_fp8_fsdp_cpu.py), activation offloading, router
imbalance under megatron-core's dispatchers (the average is used), allocator fragmentation beyond the allowance.
Measured against the peaks of docs/performance.md in docs/parallelism.md#memory-per-gpu.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Optional

from bridge_cli.models.dispatch_room import room

GIB = 1024 ** 3
CONTEXT_BYTES = 2 * GIB
"""CUDA context, cuBLAS/cuDNN workspaces and caching-allocator slack that max_memory_allocated does not count."""
NCCL_BYTES = 1 * GIB
"""NCCL communicators' buffers, added when the run has more than one GPU."""
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
DISTILL_LOGIT_BYTES = 32
"""Bytes per token per vocabulary entry at distillation's loss, its peak: the teacher's fp32 logits, the model's fp32
logits and the KL's fp32 log-softmaxes and softmaxes of both (measured: 28 bytes on top of the teacher's 4, the
same with and without distill.ce_weight)."""
FP8_LAYER_ACTIVATIONS = 0.68
"""What a compiled layer keeps for its backward in tensor-wise FP8, over what it keeps in bf16. Measured: this one
ratio puts four FP8 peaks about as close as their bf16 runs (docs/parallelism.md#memory-per-gpu): the
1.5B proxy with 14 of its 16 layers in FP8 (48.3 -> 43.1 GiB, one H100), llama8b under FSDP2 with 30 and 32 of 32
(68.5 -> 58.2 and 57.5 GiB) and under the distributed optimizer with 32 (89.6 -> 78.6 GiB, 4 H200s)."""
FROZEN_OUTPUT_BYTES = 8
"""Bytes per entry of a teacher's output as it is made: the bf16 logits, their [b, s] copy and the fp32 copy."""


@dataclass(frozen=True)
class RunShape:
    """What the estimate reads from a config, flat, so that a layout change is a ``dataclasses.replace``."""

    layers: int
    hidden: int
    ffn: int
    heads: int
    groups: int
    head_dim: int
    vocab: int
    vocab_divisor: int
    seq: int
    micro_batch: int
    global_batch: int
    world: int
    gated: bool
    biases: bool
    layernorm: bool
    qk_norm: bool
    learned_positions: bool
    tied: bool
    mla: Optional[tuple[Optional[int], int, int, int, int]]
    experts: int
    topk: int
    expert_ffn: int
    shared_ffn: int
    moe_pattern: tuple[bool, ...]
    device_dispatch: bool
    capacity_factor: Optional[float]
    """model.moe_expert_capacity_factor where pairs past it are dropped (not padded), else None."""
    tp: int
    pp: int
    vpp: int
    cp: int
    ep: int
    etp: int
    sp: bool
    first_stage_layers: Optional[int]
    last_stage_layers: Optional[int]
    param_dtype: str
    act_dtype: str
    grad_dtype: str
    optimizer: str
    momentum: bool
    distributed: bool
    optimizer_instances: int
    main_bytes: int
    moment_bytes: tuple[int, ...]
    offload_fraction: float
    recompute: Optional[str]
    recompute_method: Optional[str]
    recompute_layers: int
    recompute_modules: tuple[str, ...]
    distribute_saved: bool
    flash: bool
    torch_sdpa: bool
    attention_dropout: bool
    hidden_dropout: bool
    loss: str
    loss_chunk: int
    lora: Optional[tuple[int, tuple[str, ...]]]
    mtp: int
    fsdp: Optional[str] = None
    """torch_fsdp2, a Megatron-FSDP sharding strategy (no_shard, optim, optim_grads, optim_grads_params), or None."""
    objective: str = "sft"
    """finetune.objective: sft, dpo or distill."""
    rows: int = 1
    """Rows of seq tokens one sample runs: 2 for DPO's unpacked pair (chosen and rejected)."""
    reference_copy: bool = False
    """DPO without peft: the reference is a frozen copy of the weights."""
    teacher: Optional[tuple[tuple[str, Any], ...]] = None
    """Distillation: the teacher's shape fields (:func:`model_dims`), run in the model's layout; None when unknown."""
    fp8_layers: tuple[bool, ...] = ()
    """Per layer, whether it keeps :data:`FP8_LAYER_ACTIVATIONS` of its bf16 activations (empty: none does)."""

    @property
    def param_bytes(self) -> int:
        return BYTES[self.param_dtype]

    @property
    def act_bytes(self) -> int:
        return BYTES[self.act_dtype]

    @property
    def grad_bytes(self) -> int:
        return BYTES[self.grad_dtype]

    @property
    def dp(self) -> int:
        return self.world // (self.tp * self.pp * self.cp)

    @property
    def row_batch(self) -> int:
        """Rows of seq tokens a micro-batch runs."""
        return self.micro_batch * self.rows

    @property
    def num_microbatches(self) -> int:
        return max(1, self.global_batch // (self.micro_batch * self.dp))

    @property
    def padded_vocab(self) -> int:
        step = self.vocab_divisor * self.tp
        return -(-self.vocab // step) * step


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes per GPU on the pipeline stage that holds the most, and how they were counted."""

    weights: float
    gradients: float
    optimizer_state: float
    main_weights: float
    """The part of optimizer_state the optimizer allocates when it is built (the moments come at the first step)."""
    activations: float
    logits: float
    allowance: float
    stage: int
    parameters: float
    """Parameters on this rank (all of them, trainable or not)."""
    micro_batches_in_flight: float
    layers: int
    """Transformer layers on this rank."""
    frozen_parameters: float = 0.0
    """Parameters of DPO's frozen reference copy or of the distillation teacher on this rank (in weights)."""
    frozen_rows_held: float = 0.0
    """Bytes of the reference's or teacher's rows passed between pipeline stages and held on this rank (in
    activations)."""

    @property
    def total(self) -> float:
        return self.weights + self.gradients + self.optimizer_state + self.activations + self.logits + self.allowance

    @property
    def setup(self) -> float:
        """What is allocated before the first step: weights, gradient buffer, main weights, allowance."""
        return self.weights + self.gradients + self.main_weights + self.allowance


def estimate_memory(cfg, world_size: int) -> MemoryEstimate:
    """The memory per GPU of ``cfg`` (a validated ConfigContainer) trained on ``world_size`` GPUs."""
    return estimate(shape_of(cfg, world_size))


def shape_of(cfg, world_size: int) -> RunShape:
    """The numbers of ``cfg`` the estimate reads, for ``world_size`` GPUs."""
    import torch

    from bridge_cli.models.specs import default_spec_name

    m, opt, train = cfg.model, cfg.optimizer, cfg.train
    derived = cfg.derived
    tp, pp, cp = m.tensor_model_parallel_size, m.pipeline_model_parallel_size, m.context_parallel_size
    dp = world_size // (tp * pp * cp)
    name = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}

    def size(dtype) -> int:
        return BYTES[name.get(dtype, "fp32")]

    spec = m.spec or default_spec_name()
    precision_aware = opt.use_precision_aware_optimizer
    if m.fused_linear_cross_entropy:
        loss = "chunked"
    elif m.cross_entropy_loss_fusion and m.cross_entropy_fusion_impl == "triton":
        loss = "triton"
    else:
        loss = "half" if m.fp16_lm_cross_entropy and not m.cross_entropy_loss_fusion else "fp32"
    lora = cfg.peft
    fsdp = ("torch_fsdp2" if cfg.dist.use_torch_fsdp2 else
            cfg.ddp.data_parallel_sharding_strategy if cfg.ddp.use_megatron_fsdp else None)
    return RunShape(
        **model_dims(m),
        vocab=derived.vocab_size if derived else m.vocab_size, vocab_divisor=m.make_vocab_size_divisible_by,
        seq=m.seq_length, micro_batch=train.micro_batch_size,
        global_batch=(derived.global_batch_size if derived else train.global_batch_size) or train.micro_batch_size * dp,
        world=world_size, tp=tp, pp=pp, vpp=m.virtual_pipeline_model_parallel_size or 1, cp=cp,
        ep=m.expert_model_parallel_size,
        etp=m.expert_tensor_parallel_size or tp, sp=m.sequence_parallel,
        first_stage_layers=m.num_layers_in_first_pipeline_stage, last_stage_layers=m.num_layers_in_last_pipeline_stage,
        param_dtype=name.get(m.params_dtype, "fp32"), act_dtype="bf16" if m.bf16 else "fp16" if m.fp16 else "fp32",
        # FSDP2 keeps no DDP buffer: its gradients are the weights' dtype
        grad_dtype=("fp32" if cfg.ddp.grad_reduce_in_fp32 and fsdp != "torch_fsdp2" else
                    name.get(m.params_dtype, "fp32")),
        optimizer=opt.optimizer, momentum=bool(opt.sgd_momentum), distributed=opt.use_distributed_optimizer,
        optimizer_instances=cfg.ddp.num_distributed_optimizer_instances,
        main_bytes=((2 if m.bf16 and opt.store_param_remainders else size(opt.main_params_dtype))
                    if precision_aware else 4),
        moment_bytes=(size(opt.exp_avg_dtype), size(opt.exp_avg_sq_dtype)) if precision_aware else (4, 4),
        offload_fraction=opt.optimizer_offload_fraction if opt.optimizer_cpu_offload else 0.0,
        recompute=m.recompute_granularity, recompute_method=m.recompute_method,
        recompute_layers=m.recompute_num_layers or 1, recompute_modules=tuple(m.recompute_modules or ("core_attn",)),
        distribute_saved=m.distribute_saved_activations, flash=spec != "local", torch_sdpa=spec == "torch",
        attention_dropout=m.attention_dropout > 0, hidden_dropout=m.hidden_dropout > 0,
        loss=loss, loss_chunk=m.linear_cross_entropy_chunk,
        lora=(lora.dim, tuple(lora.target_modules)) if lora is not None else None, mtp=m.mtp_num_layers or 0,
        fsdp=fsdp, fp8_layers=_fp8_layers(m, spec), **_objective(cfg),
    )


def _fp8_layers(m, spec: str) -> tuple[bool, ...]:
    """Which layers :data:`FP8_LAYER_ACTIVATIONS` applies to: with tensor-wise FP8 on bridge's FP8 linears (``torch``
    and ``local`` specs), compiled, the layers that megatron-core's ``is_first_last_bf16_layer`` does not keep in
    bf16 (megatron-core refuses FP8 with experts where Transformer Engine is missing, so every layer here is dense).
    The validation that ``m`` passed has imported megatron-core already."""
    if not (m.fp8 and m.fp8_recipe == "tensorwise" and m.compile_layers and spec in ("torch", "local")):
        return ()
    from megatron.core.fp8_utils import is_first_last_bf16_layer

    return tuple(not is_first_last_bf16_layer(m, i) for i in range(m.num_layers))


def model_dims(m) -> dict[str, Any]:
    """The RunShape fields of a model's shape (a ``model`` section or GPTModelProvider): the model's or a teacher's."""
    from bridge_cli.models.moe_checks import device_dispatch_blocker

    freq = m.moe_layer_freq
    pattern = (tuple(bool(f) for f in freq) if isinstance(freq, list)
               else tuple(i % freq == 0 for i in range(m.num_layers)))
    return dict(
        layers=m.num_layers, hidden=m.hidden_size, ffn=m.ffn_hidden_size or 4 * m.hidden_size,
        heads=m.num_attention_heads, groups=m.num_query_groups or m.num_attention_heads,
        head_dim=m.kv_channels or m.hidden_size // m.num_attention_heads,
        gated=m.gated_linear_unit, biases=m.add_bias_linear, layernorm=m.normalization == "LayerNorm",
        qk_norm=m.qk_layernorm, learned_positions=m.position_embedding_type == "learned_absolute",
        tied=m.share_embeddings_and_output_weights,
        mla=((m.q_lora_rank, m.kv_lora_rank, m.qk_head_dim, m.qk_pos_emb_head_dim, m.v_head_dim)
             if m.multi_latent_attention else None),
        experts=m.num_moe_experts or 0, topk=m.moe_router_topk, expert_ffn=m.moe_ffn_hidden_size or m.ffn_hidden_size,
        shared_ffn=m.moe_shared_expert_intermediate_size or 0,
        moe_pattern=pattern if m.num_moe_experts else (False,) * m.num_layers,
        device_dispatch=bool(m.num_moe_experts) and device_dispatch_blocker(m) is None,
        capacity_factor=None if m.moe_pad_expert_input_to_capacity else m.moe_expert_capacity_factor)


def _objective(cfg) -> dict[str, Any]:
    """What DPO and distillation add: DPO's rows and reference copy, the teacher's shape (read from
    ``distill.teacher_checkpoint``, whose errors name it; unset, the teacher is not counted)."""
    from bridge_cli.data.preference import rows_per_sample

    objective = cfg.finetune.objective
    teacher = None
    if objective == "distill" and cfg.distill.teacher_checkpoint is not None:
        from bridge_cli.training.distill_step import check_teacher, teacher_config

        teacher = tuple(model_dims(teacher_config(cfg, check_teacher(cfg))).items())
    return dict(objective=objective, rows=rows_per_sample(cfg), teacher=teacher,
                reference_copy=objective == "dpo" and cfg.peft is None)


def estimate(s: RunShape) -> MemoryEstimate:
    """The estimate of the stage that holds the most (ties: the first)."""
    stages = [0] if s.pp == 1 else [0, s.pp - 1]
    return max((_stage(s, r) for r in stages), key=lambda e: e.total)


# --- weights -------------------------------------------------------------------------------------------


def _norm(s: RunShape) -> int:
    return 2 * s.hidden if s.layernorm else s.hidden


def _attention_params(s: RunShape) -> float:
    h = s.hidden
    if s.mla:
        q_lora, kv_lora, qk, pos, v = s.mla
        up = s.heads * (qk + pos) / s.tp
        q = h * up if q_lora is None else h * q_lora + q_lora + q_lora * up  # down-projection and its norm whole
        kv = h * (kv_lora + pos) + kv_lora + kv_lora * s.heads * (qk + v) / s.tp
        return q + kv + s.heads * v * h / s.tp + _norm(s)
    qkv = (s.heads + 2 * s.groups) * s.head_dim
    weights = (h * qkv + s.heads * s.head_dim * h) / s.tp
    biases = (qkv / s.tp + h) if s.biases else 0
    return weights + biases + _norm(s) + (2 * s.head_dim if s.qk_norm else 0)


def _mlp_params(s: RunShape, ffn: int, split: int) -> float:
    up = ffn * (2 if s.gated else 1)
    return (s.hidden * up + ffn * s.hidden) / split + ((up / split + s.hidden) if s.biases else 0)


def _layer_params(s: RunShape, moe: bool) -> tuple[float, float]:
    """(dense, expert) parameters of one layer on this rank."""
    dense = _attention_params(s) + _norm(s)
    if not moe:
        return dense + _mlp_params(s, s.ffn, s.tp), 0.0
    dense += s.experts * s.hidden + (_mlp_params(s, s.shared_ffn, s.tp) if s.shared_ffn else 0)
    return dense, s.experts / s.ep * _mlp_params(s, s.expert_ffn, s.etp)


def _lora_params(s: RunShape, layers: int) -> float:
    dim, targets = s.lora
    h, q = s.hidden, s.heads * s.head_dim
    sizes = {"linear_qkv": (h, q + 2 * s.groups * s.head_dim), "linear_proj": (q, h),
             "linear_fc1": (h, s.ffn * (2 if s.gated else 1)), "linear_fc2": (s.ffn, h)}
    return layers * sum(dim * (i + o) for i, o in (sizes[t] for t in targets))


# --- activations ---------------------------------------------------------------------------------------


def _layer_parts(s: RunShape, moe: bool) -> dict[str, float]:
    """Bytes one layer keeps for its backward, per micro-batch, by what recompute can drop."""
    a, h = s.act_bytes, s.hidden
    tokens = s.seq * s.row_batch / s.cp
    full = tokens / (s.tp if s.sp else 1)  # what TP without SP replicates
    shard = tokens / s.tp
    parts = {"norm_in": 2 * a * h * full, "norm_out": 2 * a * h * full}
    if s.mla:
        q_lora, kv_lora, qk, pos, v = s.mla
        parts["qkv"] = a * s.heads * (2 * (qk + pos) + v) * shard + 2 * a * ((q_lora or 0) + kv_lora + pos) * full
        out = s.heads * v
    else:
        # under CP each rank gathers the whole row's keys and values
        parts["qkv"] = a * s.head_dim * (s.heads + 2 * s.groups * s.cp) * shard
        out = s.heads * s.head_dim
    if s.qk_norm:
        parts["qk_norm"] = a * s.head_dim * (s.heads + s.groups) * shard
    parts["attn_out"] = a * out * shard
    if s.torch_sdpa and s.row_batch > 1:
        # SDPA keeps its output as [b, s, heads, d] for its backward; the projection gets an [s, b, ...] copy
        parts["core_attn"] = a * out * shard
    if not s.flash:  # megatron-core's unfused attention keeps the seq x seq probabilities (and dropout mask)
        parts["core_attn"] = parts.get("core_attn", 0) + s.heads * s.seq * (a + s.attention_dropout) * shard
    if s.hidden_dropout:
        parts["dropout"] = 2 * h * full
    if not moe:
        parts["mlp"] = a * s.ffn * (3 if s.gated else 2) * shard
        return parts
    parts["router"] = 12 * s.experts * full  # fp32 logits, probabilities and scores
    local = s.experts // s.ep
    rows = (room(int(full), s.etp * s.ep, local, s.experts, s.topk, s.capacity_factor) if s.device_dispatch
            else full * s.etp * s.topk)
    ffn = s.expert_ffn / s.etp
    parts["moe_rows"] = a * (h + ffn * (2 if s.gated else 1)) * rows
    parts["moe_act"] = a * ffn * rows
    if s.shared_ffn:
        parts["shared_experts"] = a * s.shared_ffn * (3 if s.gated else 2) * shard
    return parts


SELECTIVE = {"core_attn": ("core_attn",), "layernorm": ("norm_out",), "mlp": ("mlp",),
             "moe": ("moe_rows", "moe_act", "router"), "moe_act": ("moe_act",), "shared_experts": ("shared_experts",)}
"""model.recompute_modules -> the parts each drops (mla_up_proj is not modelled)."""


def _saved(s: RunShape, moe: bool) -> float:
    parts = _layer_parts(s, moe)
    if s.recompute == "selective":
        for module in s.recompute_modules:
            for part in SELECTIVE.get(module, ()):
                parts.pop(part, None)
    return sum(parts.values())


def _layer_input(s: RunShape) -> float:
    """A recomputed layer's (or chunk's) kept input."""
    split = s.tp if s.sp or s.distribute_saved else 1
    return s.act_bytes * s.hidden * s.seq * s.row_batch / s.cp / split


def _stage_layers(s: RunShape, rank: int) -> list[int]:
    """Layer indices on pipeline rank ``rank`` (every virtual stage of it)."""
    if s.pp == 1:
        return list(range(s.layers))
    if s.vpp > 1 or not (s.first_stage_layers or s.last_stage_layers):
        chunk = s.layers // (s.pp * s.vpp)
        return [i for k in range(rank, s.pp * s.vpp, s.pp) for i in range(k * chunk, (k + 1) * chunk)]
    first, last = s.first_stage_layers, s.last_stage_layers
    middle_stages = s.pp - (first is not None) - (last is not None)
    middle = (s.layers - (first or 0) - (last or 0)) // middle_stages if middle_stages else 0
    sizes = [first if first is not None else middle] + [middle] * (s.pp - 2) + [last if last is not None else middle]
    start = sum(sizes[:rank])
    return list(range(start, start + sizes[rank]))


def _in_flight(s: RunShape, rank: int) -> float:
    """Micro-batches whose activations 1F1B holds at once on ``rank`` (in units of the stage's layers)."""
    m = s.num_microbatches
    if s.pp == 1:
        return 1.0
    if s.vpp == 1:
        return float(min(s.pp - rank, m))
    warmup = (s.pp - rank - 1) * 2 + (s.vpp - 1) * s.pp  # megatron-core's interleaved schedule
    return min(warmup + 1, s.vpp * m) / s.vpp


def _activations(s: RunShape, layers: list[int], in_flight: float) -> tuple[float, float]:
    """(what the stage's layers keep for the micro-batches in flight, what a layer's backward adds on top:
    its gradients, and the layers recompute rebuilds)."""
    if not layers:
        return 0.0, 0.0
    saved = [_saved(s, s.moe_pattern[i]) * (FP8_LAYER_ACTIVATIONS if s.fp8_layers and s.fp8_layers[i] else 1.0)
             for i in layers]
    full = max(sum(_layer_parts(s, s.moe_pattern[i]).values()) for i in layers)
    if s.recompute == "full" and s.recompute_method == "block":
        per_chunk = math.ceil(len(layers) / s.vpp)
        kept = [(_layer_input(s) if j % per_chunk < s.recompute_layers else b) for j, b in enumerate(saved)]
        return sum(kept) * in_flight, 2 * full
    if s.recompute == "full":  # uniform: each group of recompute_num_layers keeps its input, one is rebuilt at a time
        groups = math.ceil(len(layers) / s.recompute_layers)
        return groups * _layer_input(s) * in_flight, full * (min(s.recompute_layers, len(layers)) + 1)
    return sum(saved) * in_flight, full


def _logits(s: RunShape) -> float:
    tokens = s.seq * s.row_batch / s.cp
    vocab = s.padded_vocab / s.tp
    if s.objective == "distill":  # the model returns its logits to the KL, whatever the loss fusion
        return DISTILL_LOGIT_BYTES * tokens * vocab
    if s.loss == "chunked":
        return 4 * min(s.loss_chunk, tokens) * vocab
    per_entry = {"triton": s.act_bytes, "half": 2 * s.act_bytes, "fp32": 4 + s.act_bytes}[s.loss]
    return per_entry * tokens * vocab


# --- one stage -----------------------------------------------------------------------------------------


def _stage(s: RunShape, rank: int) -> MemoryEstimate:
    layers = _stage_layers(s, rank)
    first, last = rank == 0, rank == s.pp - 1
    dense = expert = 0.0
    for i in layers:
        d, e = _layer_params(s, s.moe_pattern[i])
        dense, expert = dense + d, expert + e
    embedding = s.padded_vocab / s.tp * s.hidden
    if first:
        dense += embedding + (s.seq * s.hidden if s.learned_positions else 0)
    if last:
        dense += _norm(s) + (embedding if not s.tied or not first else 0)
        for _ in range(s.mtp):
            d, e = _layer_params(s, s.moe_pattern[-1])
            dense, expert = dense + d + 2 * s.hidden * s.hidden / s.tp + 3 * _norm(s), expert + e
    params = dense + expert
    if s.lora:
        trainable_dense, trainable_expert = _lora_params(s, len(layers)) / s.tp, 0.0
    else:
        trainable_dense, trainable_expert = dense, expert
    shard_dense = shard_expert = 1
    if s.distributed:
        shard_dense = s.dp * s.cp / s.optimizer_instances
        shard_expert = s.world / (s.etp * s.ep * s.pp) / s.optimizer_instances
    weight_shard, grad_shard, optimizer_shard = fsdp_shards(s)
    if s.fsdp:
        shard_dense = shard_expert = optimizer_shard
    trainable = trainable_dense / shard_dense + trainable_expert / shard_expert
    main = s.main_bytes * trainable if s.param_bytes < 4 else 0.0
    moments = sum(s.moment_bytes) if s.optimizer == "adam" else (4 if s.momentum else 0)
    kept = 1 - s.offload_fraction

    saved, backward = _activations(s, layers, _in_flight(s, rank))
    logits = 0.0
    if last:  # the final norm's input and output, each MTP layer's, and the logits while the loss runs
        head = 2 * s.act_bytes * s.hidden * s.seq * s.row_batch / s.cp / (s.tp if s.sp else 1)
        saved += head + s.mtp * (sum(_layer_parts(s, s.moe_pattern[-1]).values()) + head)
        logits = _logits(s) * (1 + s.mtp)
    # the logits are spent before the layers' backward starts: the peak holds the larger of the two
    activations = saved + max(0.0, backward - logits)
    # a sharded layer is gathered whole while it runs, the next one prefetched; its gradients reduce-scattered
    unit = max((sum(_layer_params(s, s.moe_pattern[i])) for i in layers), default=0.0)
    gathered = 2 * unit if weight_shard > 1 else 0.0
    gathered_grads = unit if grad_shard > 1 else 0.0
    weights = s.param_bytes * (params / weight_shard + gathered)
    frozen_params, frozen_weights, frozen_pass = _frozen_model(s, rank, layers, params, weights)
    # the reference's or teacher's forward runs before the model's, holding none of the model's activations
    activations = max(activations, frozen_pass - logits)
    in_transit = _frozen_in_transit(s, rank)  # held through both passes
    return MemoryEstimate(
        weights=weights + frozen_weights,
        gradients=s.grad_bytes * ((trainable_dense + trainable_expert) / grad_shard + gathered_grads),
        optimizer_state=(main + moments * trainable) * kept, main_weights=main * kept,
        activations=activations + in_transit, logits=logits,
        allowance=CONTEXT_BYTES + (NCCL_BYTES if s.world > 1 else 0), stage=rank, parameters=params,
        micro_batches_in_flight=_in_flight(s, rank), layers=len(layers), frozen_parameters=frozen_params,
        frozen_rows_held=in_transit)


def _frozen_model(s: RunShape, rank: int, layers: list[int], params: float,
                  weights: float) -> tuple[float, float, float]:
    """(parameters, weight bytes, peak bytes of its forward pass) of DPO's reference or the distillation teacher:
    the pass holds one layer's working set at a time (no gradients) and its output."""
    if s.objective == "dpo":  # the reference scores the policy's rows through the same loss path
        working = max((sum(_layer_parts(s, s.moe_pattern[i]).values()) for i in layers), default=0.0)
        forward = working + _logits(s)
        return (params, weights, forward) if s.reference_copy else (0.0, 0.0, forward)
    if s.teacher is None:
        return 0.0, 0.0, 0.0
    t = with_changes(s, **dict(s.teacher), objective="sft", rows=1, teacher=None, lora=None, fsdp=None, mtp=0)
    working = max(sum(_layer_parts(t, t.moe_pattern[i]).values()) for i in range(t.layers))
    entries = t.seq * t.micro_batch / t.cp * t.padded_vocab / t.tp
    teacher = _stage(t, rank)
    return teacher.parameters, teacher.weights, working + FROZEN_OUTPUT_BYTES * entries


def _frozen_in_transit(s: RunShape, rank: int) -> float:
    """Bytes of the reference's or teacher's hidden states that ``rank`` holds for the pipeline: each (virtual) stage
    receives the frozen model's rows behind the trained model's (but the first) and sends its own on (but the last),
    ``frozen_rows`` rows of the model's width for the frozen model's, and megatron-core's schedules keep a stage's
    input and output tensors until that micro-batch's backward."""
    if s.pp == 1 or s.objective == "sft" or (s.objective == "distill" and s.teacher is None):
        return 0.0
    from bridge_cli.training.frozen_pipeline import frozen_rows

    frozen_hidden = dict(s.teacher)["hidden"] if s.objective == "distill" else s.hidden
    rows = frozen_rows(s.row_batch, frozen_hidden, s.hidden)
    stages = s.pp * s.vpp
    ends = sum((k > 0) + (k < stages - 1) for k in range(rank, stages, s.pp))  # over the rank's virtual stages
    tensor = rows * s.seq / s.cp / (s.tp if s.sp else 1) * s.hidden * s.act_bytes
    return ends * _in_flight(s, rank) * tensor


def fsdp_shards(s: RunShape) -> tuple[float, float, float]:
    """What FSDP divides weights, gradients and optimizer state by (1: each rank holds them whole)."""
    n = s.dp * s.cp
    return {None: (1, 1, 1), "no_shard": (1, 1, 1), "optim": (1, 1, n), "optim_grads": (1, n, n),
            "optim_grads_params": (n, n, n), "torch_fsdp2": (n, n, n)}[s.fsdp]


def with_changes(s: RunShape, **changes) -> RunShape:
    """``s`` with fields replaced (a layout the advisor tries)."""
    return dataclasses.replace(s, **changes)
