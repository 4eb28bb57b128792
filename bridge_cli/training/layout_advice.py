"""Whether a run's layout fits the GPU, and which settings would make it fit: what ``--dry-run --device cuda``
and ``bridge config validate`` say before anyone waits for an out-of-memory error.

The verdict allows for the estimate's error (:data:`ACCURACY`, from docs/parallelism.md#memory-per-gpu): a
total below the GPU's memory by more than that fits, one above it by more than that will not fit, and one in
between may not. The settings offered are each re-estimated: only those that bring the total into "fits".
torch FSDP2 comes before recompute and more tensor, pipeline or expert parallelism (docs/parallelism.md#fsdp: the
fastest layout measured for llama8b on 4 80 GB GPUs), with the settings it refuses turned off, and only where the
validation accepts the result. A run under torch FSDP2 that fits gets a note where the distributed optimizer would
fit as well (:data:`GATHER_ONCE`): faster where the GPU holds the whole weights.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Optional

from bridge_cli.config.errors import ConfigError
from bridge_cli.runtime.errors import RuntimeUnavailable
from bridge_cli.runtime.fsdp import TORCH_FSDP2
from bridge_cli.runtime.parallel_layout import world_step
from bridge_cli.training.memory_estimate import (DISTILL_LOGIT_BYTES, GIB, MemoryEstimate, RunShape, estimate,
                                                 fsdp_shards, shape_of, with_changes)

ACCURACY = 0.10
"""How far the estimate may be from the measured peak (the largest deviation in docs/parallelism.md's table)."""

DEFAULT_GPU_GIB = 80.0
"""GPU memory assumed for --device cuda where no GPU is visible and --gpu-memory is not given (an 80 GB H100)."""

RECOMPUTE = {"recompute": "full", "recompute_method": "uniform", "recompute_layers": 1}
RECOMPUTE_KEYS = "model.recompute_granularity=full model.recompute_method=uniform model.recompute_num_layers=1"

GATHER_ONCE = (("dist.use_torch_fsdp2", False), ("optimizer.use_distributed_optimizer", True),
               ("ddp.overlap_grad_reduce", True), ("ddp.overlap_param_gather", True),
               ("model.gradient_accumulation_fusion", True))
"""torch FSDP2's run as the distributed optimizer with its collectives overlapped: the weights whole on each GPU,
gathered and their gradients reduce-scattered once a step, where FSDP2 does both on every micro-batch
(docs/parallelism.md#fsdp: llama8b on 4 H200s, 1.11x FSDP2's tokens/s). Offered where a run under FSDP2 fits and
so would this."""

FSDP2_REPLACES = ("optimizer.use_distributed_optimizer", "ddp.overlap_grad_reduce", "ddp.overlap_param_gather",
                  "model.gradient_accumulation_fusion")
"""Settings torch FSDP2 refuses (runtime/fsdp.py) because it shards, overlaps or accumulates gradients its own
way: its proposal turns off those that are on. What else it refuses (tied embeddings, fp16, pipeline stages,
experts, peft) changes the model or the layout, so FSDP2 is not proposed there."""


@dataclass(frozen=True)
class Advice:
    """An estimate against a GPU's memory, the verdict and the settings that would make the run fit."""

    estimate: MemoryEstimate
    shape: RunShape
    gpu_bytes: float
    gpu_source: str
    verdict: str
    """fits, may not fit, or will not fit."""
    fixes: tuple[str, ...]
    """Each a setting (or settings) with the estimate it gives; together, when no single one is enough."""
    together: bool
    gather_once: Optional[str] = None
    """For a run under torch FSDP2 that fits: the :data:`GATHER_ONCE` settings and their estimate, where they fit
    too; else None."""

    def lines(self) -> list[str]:
        """The YAML block --dry-run prints (GiB), with how each line was counted as comments."""
        e, s = self.estimate, self.shape
        stage = f"pipeline stage {e.stage} of {s.pp}" if s.pp > 1 else "each GPU"
        recompute = {"full": f"full recompute ({s.recompute_method}, {s.recompute_layers})",
                     "selective": f"selective recompute of {', '.join(s.recompute_modules)}"}.get(s.recompute,
                                                                                                  "no recompute")
        flight = e.micro_batches_in_flight
        rows = [
            ("weights", e.weights,
             f"{_count(e.parameters)} parameters in {s.param_dtype}" + _fsdp(s, 0) + _frozen(s, e)),
            ("gradients", e.gradients, f"{s.grad_dtype} buffer" + (", adapters only" if s.lora else "") + _fsdp(s, 1)),
            ("optimizer_state", e.optimizer_state, _optimizer(s)),
            ("activations", e.activations, f"{e.layers} layers x {flight:g} micro-batch{'es' * (flight != 1)} "
                                           f"of {s.micro_batch}{_rows(s)} in flight, {recompute}" + _in_transit(s, e)),
            ("logits", e.logits, _logits(s) if e.logits else "not on this stage"),
            ("cuda_context_and_nccl", e.allowance, "fixed allowance"),
            ("total", e.total, None),
            ("before_first_step", e.setup, "weights, gradient buffer, main weights and the allowance: allocated at "
                                          "set-up; the moments come with the first step"),
            ("gpu", self.gpu_bytes, self.gpu_source),
        ]
        out = [f"memory_per_gpu:  # GiB, estimated for {stage} (docs/parallelism.md#memory-per-gpu)"]
        out += [f"  {name}: {value / GIB:.1f}" + (f"  # {note}" if note else "") for name, value, note in rows]
        return out + [f"  verdict: {self.verdict}"]

    def message(self) -> Optional[str]:
        """The warning (or, from config validate, the error) when the run may not or will not fit; None when it fits."""
        if self.verdict == "fits":
            return None
        total, gpu = self.estimate.total / GIB, self.gpu_bytes / GIB
        head = (f"memory per GPU: the estimate is {total:.1f} GiB, more than the GPU's {gpu:.1f} GiB: this layout "
                "will not fit." if self.verdict == "will not fit" else
                f"memory per GPU: the estimate is {total:.1f} GiB of the GPU's {gpu:.1f} GiB, within the estimate's "
                f"{ACCURACY:.0%} error: this layout may not fit.")
        if not self.fixes:
            return f"{head} No setting bridge tries makes it fit: use more GPUs or a smaller model."
        if self.together:
            return f"{head} No single setting is enough; together these would: {'; '.join(self.fixes)}."
        return f"{head} Any one of these would: {'; '.join(self.fixes)}."

    def hint(self) -> Optional[str]:
        """The note that a faster layout fits too (:attr:`gather_once`); None where there is none."""
        if self.gather_once is None:
            return None
        return (f"memory per GPU: the distributed optimizer would fit too: {self.gather_once}. It gathers the weights "
                f"and reduces their gradients once a step, where torch FSDP2 does both on each of the step's "
                f"{self.shape.num_microbatches} micro-batches (llama8b on 4 H200s: 1.11x the tokens/s, "
                "docs/parallelism.md#fsdp).")


def gpu_memory(flag_gib: Optional[float]) -> tuple[float, str]:
    """(bytes, where the number comes from): ``--gpu-memory``, else this machine's GPU 0, else
    :data:`DEFAULT_GPU_GIB`."""
    if flag_gib is not None:
        return flag_gib * GIB, "--gpu-memory"
    import torch

    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        return float(props.total_memory), f"{props.name}, GPU 0 of this machine"
    return DEFAULT_GPU_GIB * GIB, f"no GPU visible: {DEFAULT_GPU_GIB:g} GiB unless --gpu-memory says otherwise"


def verdict(total: float, gpu_bytes: float) -> str:
    if total <= gpu_bytes * (1 - ACCURACY):
        return "fits"
    return "may not fit" if total <= gpu_bytes * (1 + ACCURACY) else "will not fit"


def advise(cfg, world_size: int, gpu_bytes: float, gpu_source: str = "") -> Advice:
    """The estimate of ``cfg`` (validated) on ``world_size`` GPUs of ``gpu_bytes`` each, and what would make it fit."""
    shape = shape_of(cfg, world_size)
    found = estimate(shape)
    judged = verdict(found.total, gpu_bytes)
    fixes, together, gather_once = (), False, None
    if judged == "fits":
        trial = _gathered_once(cfg, shape)
        if trial and _fits(trial[1], gpu_bytes):
            gather_once = _describe(*trial, world_size)
    else:
        fsdp2 = _torch_fsdp2(cfg, shape)
        fixes = tuple(_describe(label, s, world_size) for label, s in _single_fixes(shape, gpu_bytes, fsdp2))
        if not fixes:
            combined = _combined_fix(shape, gpu_bytes)
            if combined:
                labels, changed = combined
                fixes, together = (_describe(" ".join(labels), changed, world_size),), True
    return Advice(found, shape, gpu_bytes, gpu_source, judged, fixes, together, gather_once)


def _fits(s: RunShape, gpu_bytes: float) -> bool:
    return verdict(estimate(s).total, gpu_bytes) == "fits"


def _single_fixes(s: RunShape, gpu_bytes: float,
                  fsdp2: Optional[tuple[str, RunShape]] = None) -> list[tuple[str, RunShape]]:
    """The smallest change of each kind that fits on its own: the distributed optimizer, a smaller
    micro-batch, torch FSDP2 (``fsdp2``, from :func:`_torch_fsdp2`), full recompute, more tensor, pipeline or
    expert parallelism."""
    kinds = _kinds(s)
    kinds.insert(2, [fsdp2] if fsdp2 else [])
    found = []
    for kind in kinds:
        fitting = next(((label, t) for label, t in kind if _fits(t, gpu_bytes)), None)
        if fitting:
            found.append(fitting)
    return found


def _combined_fix(s: RunShape, gpu_bytes: float) -> Optional[tuple[list[str], RunShape]]:
    """Every cheap change at once (the last candidate of each: distributed optimizer, micro-batch 1, full
    recompute), then more tensor, pipeline and expert parallelism in turn, until it fits."""
    labels = []
    for index in range(6):
        kind = _kinds(s)[index]
        if index >= 3:  # a layout change: the smallest that fits, else the largest and on to the next kind
            if _fits(s, gpu_bytes):
                return labels, s
            fitting = next(((label, t) for label, t in kind if _fits(t, gpu_bytes)), None)
            if fitting:
                return labels + [fitting[0]], fitting[1]
        if kind:
            label, s = kind[-1]
            labels.append(label)
    return (labels, s) if _fits(s, gpu_bytes) else None


def _torch_fsdp2(cfg, s: RunShape) -> Optional[tuple[str, RunShape]]:
    """torch FSDP2 as a proposal for ``cfg`` (validated, shaped as ``s``): FSDP2 on and the :data:`FSDP2_REPLACES`
    settings that are on turned off (:func:`_switched`). None where FSDP (either) is on already or where no
    data-parallel ranks would share the shards."""
    if cfg.dist.use_torch_fsdp2 or cfg.ddp.use_megatron_fsdp or s.dp * s.cp == 1:
        return None
    return _switched(cfg, s, ((TORCH_FSDP2, True), *((key, False) for key in FSDP2_REPLACES)))


def _gathered_once(cfg, s: RunShape) -> Optional[tuple[str, RunShape]]:
    """A torch FSDP2 run of more than one micro-batch a step as :data:`GATHER_ONCE` says (:func:`_switched`); None
    otherwise."""
    if not cfg.dist.use_torch_fsdp2 or s.num_microbatches == 1:
        return None
    return _switched(cfg, s, GATHER_ONCE)


def _switched(cfg, s: RunShape, settings) -> Optional[tuple[str, RunShape]]:
    """``cfg`` with each of ``settings`` (key, value) that differs set: the overrides that change, and the run they
    give, shaped from a copy of ``cfg`` that passed the validation with them; None where the validation refuses it."""
    trial = copy.deepcopy(cfg)
    changed = []
    for key, value in settings:
        section, name = key.split(".")
        if getattr(getattr(trial, section), name) != value:
            setattr(getattr(trial, section), name, value)
            changed.append(f"{key}={str(value).lower()}")
    # conf/ddp/default.yaml: ddp's copy of the switch follows the optimizer's, as it does after the override
    trial.ddp.use_distributed_optimizer = trial.optimizer.use_distributed_optimizer
    try:
        trial.validate(s.world, cfg.derived.device)
    except (ConfigError, RuntimeUnavailable):
        return None
    return " ".join(changed), shape_of(trial, s.world)


def _kinds(s: RunShape) -> list[list[tuple[str, RunShape]]]:
    """Candidate changes of ``s`` by kind, smallest first."""
    expert_dp = s.world // (s.etp * s.ep * s.pp)
    sharding = ([("optimizer.use_distributed_optimizer=true", with_changes(s, distributed=True))]
                if not s.distributed and s.optimizer_instances == 1 and max(s.dp * s.cp, expert_dp) > 1
                and not s.fsdp else [])
    micro = [(f"train.micro_batch_size={mb}", with_changes(s, micro_batch=mb))
             for mb in _halvings(s.micro_batch) if not s.global_batch % (mb * s.dp)]
    recompute = [(RECOMPUTE_KEYS, with_changes(s, **RECOMPUTE))] if s.recompute != "full" else []
    tensor = [_layout(s, f"model.tensor_model_parallel_size={t}", tp=t) for t in _doublings(s.tp, 8)
              if not (s.heads % t or s.groups % t or s.ffn % t) and (not s.experts or s.sp)]
    pipeline = [_layout(s, f"model.pipeline_model_parallel_size={p}", pp=p) for p in _doublings(s.pp, s.layers)
                if not s.layers % (p * s.vpp) and not (s.first_stage_layers or s.last_stage_layers) and not s.fsdp
                and not (s.teacher and dict(s.teacher)["layers"] % (p * s.vpp))]  # each stage holds teacher layers
    expert = [_layout(s, f"model.expert_model_parallel_size={e}", ep=e) for e in _doublings(s.ep, s.experts)
              if not s.experts % e]
    return [sharding, micro, recompute] + [[c for c in kind if c] for kind in (tensor, pipeline, expert)]


def _layout(s: RunShape, label: str, **sizes) -> Optional[tuple[str, RunShape]]:
    """A layout change on the same GPUs when its sizes divide them, else on the fewest that fit it."""
    t = with_changes(s, **sizes)
    step = world_step(t.tp, t.pp, t.cp, t.ep, t.etp)
    world = s.world if s.world % step == 0 else -(-s.world // step) * step
    t = with_changes(t, world=world)
    if t.global_batch % (t.micro_batch * t.dp):
        return None
    return label, t


def _describe(label: str, s: RunShape, world_size: int) -> str:
    """The setting(s), the GPUs they need when that is more than the run has, and the estimate they give."""
    return label + (f" on {s.world} GPUs" if s.world != world_size else "") + f" ({estimate(s).total / GIB:.1f} GiB)"


def _halvings(value: int) -> list[int]:
    return [value // 2 ** k for k in range(1, value.bit_length())]


def _doublings(value: int, limit: int) -> list[int]:
    return [value * 2 ** k for k in range(1, 16) if value * 2 ** k <= limit]


def _optimizer(s: RunShape) -> str:
    kind = ("Adam: main weights and 2 moments" if s.optimizer == "adam" else
            "SGD: main weights and momentum" if s.momentum else "SGD: main weights")
    if s.param_bytes == 4:
        kind = kind.replace("main weights and ", "").replace(": main weights", ": nothing")
    if s.fsdp:
        return kind + (_fsdp(s, 2) or ", whole on each GPU")
    shard = s.dp * s.cp // s.optimizer_instances
    if not s.distributed or (shard == 1 and not s.experts):
        return f"{kind}, whole on each GPU"
    experts = f", the experts' over {s.world // (s.etp * s.ep * s.pp)}" if s.experts else ""
    ranks = "data-parallel x context-parallel ranks" if s.cp > 1 else f"data-parallel rank{'s' * (shard != 1)}"
    return f"{kind}, the distributed optimizer's share of {shard} {ranks}{experts}"


def _fsdp(s: RunShape, part: int) -> str:
    """How FSDP shards weights (0), gradients (1) or optimizer state (2): a note, or "" where it keeps them whole."""
    shard = fsdp_shards(s)[part]
    if shard == 1:
        return ""
    name = "torch FSDP2" if s.fsdp == "torch_fsdp2" else f"Megatron-FSDP {s.fsdp}"
    gathered = ("" if part == 2 else ", plus the layer gathered and the next prefetched" if part == 0 else
                ", plus one layer's whole in the backward")
    return f", {name}'s share of {shard:g} ranks{gathered}"


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def _frozen(s: RunShape, e: MemoryEstimate) -> str:
    if s.reference_copy:
        return f", and the DPO reference's frozen copy ({_count(e.frozen_parameters)})"
    if s.objective != "distill":
        return ""
    if s.teacher is None:
        return ", the teacher not counted: distill.teacher_checkpoint is unset"
    teacher = dict(s.teacher)
    return f", and the teacher's {_count(e.frozen_parameters)} ({teacher['layers']} layers, hidden {teacher['hidden']})"


def _in_transit(s: RunShape, e: MemoryEstimate) -> str:
    if not e.frozen_rows_held:
        return ""
    frozen = "the reference's" if s.objective == "dpo" else "the teacher's"
    return f", and {frozen} rows between pipeline stages ({e.frozen_rows_held / GIB:.1f})"


def _rows(s: RunShape) -> str:
    return f" pair{'s' * (s.micro_batch != 1)} ({s.row_batch} rows)" if s.rows > 1 else ""


def _logits(s: RunShape) -> str:
    entries = f"{s.seq * s.row_batch // s.cp} tokens x {s.padded_vocab // s.tp} entries"
    if s.objective == "distill":
        return (f"{entries}: the teacher's and the model's fp32 logits and the KL's softmaxes, "
                f"{DISTILL_LOGIT_BYTES} bytes an entry")
    return {"chunked": f"fp32 logits of {min(s.loss_chunk, s.seq * s.micro_batch // s.cp)} tokens at a time "
                       "(fused linear cross entropy)",
            "triton": f"{entries} in {s.act_dtype} (Triton cross entropy, gradient in place)",
            "half": f"{entries}, logits and their gradient in {s.act_dtype}",
            "fp32": f"{entries}: fp32 softmax and {s.act_dtype} logits"}[s.loss]
