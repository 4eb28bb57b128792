"""The comm_overlap section: Megatron-Bridge's CommOverlapConfig, applied onto the model, ddp and optimizer sections.

Every field is a shorthand for megatron-core fields that bridge already reads (COMM_OVERLAP_TARGETS). An unset
field (None) changes nothing. A set field is written onto its targets by the validation pass, so megatron-core,
``--dry-run`` and a checkpoint's run_config.yaml see what the run uses; a target that the model, ddp or optimizer
section already set to another value is a ConfigError naming both keys, whichever of the recipe or the command
line set them. So precedence stays config groups < recipe < command line, and a value never wins over another
without a word. Unlike Megatron-Bridge, an unset field does not turn anything on by itself: Megatron-Bridge, given
the section, also turns on grad-reduce and param-gather overlap with 128 MiB buckets at data-parallel size > 1 (with
the distributed optimizer) and picks overlap_p2p_comm / batch_p2p_comm from the pipeline layout, overwriting the ddp
and model sections; bridge runs what the sections say. A field megatron-core would ignore in the run's layout is
refused with the setting it needs, where Megatron-Bridge drops it (its data-parallel fields without the distributed
optimizer) or warns and turns it off (tensor-parallel overlap).
"""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from typing import Any, Optional

from bridge_cli.config.errors import ConfigError
from bridge_cli.config.fields import one_of


@dataclass
class CommOverlapConfig:
    """Communication overlap (Megatron-Bridge's CommOverlapConfig): each set field goes onto megatron-core's."""

    tp_comm_overlap: Optional[bool] = None
    """Overlap TP communication with GEMMs (model.tp_comm_overlap): Transformer Engine userbuffers, refused."""

    tp_comm_overlap_cfg: Any = None
    """Transformer Engine's userbuffer settings per GEMM; read only with tp_comm_overlap, so refused when set."""

    tp_comm_bootstrap_backend: Optional[str] = one_of(None, "nccl", "mpi", "gloo")
    """Backend bootstrapping the userbuffers (model.tp_comm_bootstrap_backend); anything but nccl is refused."""

    overlap_p2p_comm: Optional[bool] = None
    """Overlap pipeline sends/receives with compute (model.*); interleaved pipeline; true sets batch_p2p_comm false."""

    batch_p2p_comm: Optional[bool] = None
    """Post a pipeline step's sends and receives as one batch_isend_irecv (model.batch_p2p_comm)."""

    overlap_grad_reduce: Optional[bool] = None
    """Overlap the data-parallel grad reduce with the backward (ddp.*); needs the distributed optimizer."""

    overlap_param_gather: Optional[bool] = None
    """Overlap the param all-gather with the forward (ddp.* and optimizer.*); needs the distributed optimizer."""

    overlap_param_gather_with_optimizer_step: Optional[bool] = None
    """Start chunk 0's param all-gather in the optimizer step (optimizer.*); needs overlap_param_gather and VPP."""

    align_param_gather: Optional[bool] = None
    """Launch all pipeline stages' param all-gathers together (ddp.*); needs overlap_param_gather."""

    bucket_size: Optional[int] = None
    """Elements per grad-reduce bucket (ddp.bucket_size); needs overlap_grad_reduce (one bucket without it)."""

    defer_embedding_wgrad_compute: Optional[bool] = None
    """Defer output-layer wgrad GEMMs to the pipeline flush (model.*); needs PP > 1 and gradient_accumulation_fusion."""

    wgrad_deferral_limit: Optional[int] = None
    """Micro-batches whose output-layer wgrad is deferred, 0 for all (model.*); needs defer_embedding_wgrad_compute."""

    data_parallel_size: Optional[int] = None
    """World size / (TP x PP x CP), which Megatron-Bridge fills in; when set, it must equal the run's."""

    overlap_moe_expert_parallel_comm: Optional[bool] = None
    """Overlap expert-parallel all-to-alls across micro-batches (model.*): combined 1F1B schedule, refused."""

    delay_wgrad_compute: Optional[bool] = None
    """Delay wgrads for that overlap (model.* and ddp.*); needs overlap_moe_expert_parallel_comm, so refused."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each value outside its range; empty when the section is consistent."""
        problems = []
        for name, low in (("bucket_size", 1), ("wgrad_deferral_limit", 0), ("data_parallel_size", 1)):
            value = getattr(self, name)
            if value is not None and value < low:
                problems.append((name, f"must be >= {low}, got {value}."))
        return problems


COMM_OVERLAP_TARGETS: dict[str, tuple[str, ...]] = {
    "tp_comm_overlap": ("model.tp_comm_overlap",),
    "tp_comm_bootstrap_backend": ("model.tp_comm_bootstrap_backend",),
    "overlap_p2p_comm": ("model.overlap_p2p_comm",),
    "batch_p2p_comm": ("model.batch_p2p_comm",),
    "overlap_grad_reduce": ("ddp.overlap_grad_reduce",),
    "overlap_param_gather": ("ddp.overlap_param_gather", "optimizer.overlap_param_gather"),
    "overlap_param_gather_with_optimizer_step": ("optimizer.overlap_param_gather_with_optimizer_step",),
    "align_param_gather": ("ddp.align_param_gather",),
    "bucket_size": ("ddp.bucket_size",),
    "defer_embedding_wgrad_compute": ("model.defer_embedding_wgrad_compute",),
    "wgrad_deferral_limit": ("model.wgrad_deferral_limit",),
    "overlap_moe_expert_parallel_comm": ("model.overlap_moe_expert_parallel_comm",),
    "delay_wgrad_compute": ("model.delay_wgrad_compute", "ddp.delay_wgrad_compute"),
}
"""comm_overlap field -> the megatron-core fields it sets, as Megatron-Bridge's setup() sets them. tp_comm_overlap_cfg
and data_parallel_size have no target: the first is only read with tp_comm_overlap, the second is derived."""

DATA_PARALLEL_FIELDS = ("overlap_grad_reduce", "overlap_param_gather", "overlap_param_gather_with_optimizer_step",
                        "align_param_gather", "bucket_size", "delay_wgrad_compute")
"""Fields Megatron-Bridge applies to the ddp and optimizer sections only with the distributed optimizer."""

USERBUFFERS = ("tp_comm_overlap", "tp_comm_overlap_cfg", "tp_comm_bootstrap_backend")
"""Fields of Transformer Engine's tensor-parallel overlap."""

COMBINED_1F1B = ("runs megatron-core's combined 1F1B schedule, whose forward step must return GPTModel's schedule "
                 "plan (return_schedule_plan=True); bridge's forward step returns the model's output")


def apply_comm_overlap(cfg, data_parallel_size: int) -> dict[str, Any]:
    """Write ``cfg.comm_overlap``'s set fields onto ``cfg.model``, ``cfg.ddp`` and ``cfg.optimizer`` (idempotent:
    a second pass finds them equal); return {target key: value} for --dry-run's derived block. Raise ConfigError for a
    field refused here, contradicting its target, or that megatron-core would ignore in this layout."""
    overlap = cfg.comm_overlap
    if overlap is None:
        return {}
    _refuse_userbuffers(overlap)
    for name in ("overlap_moe_expert_parallel_comm", "delay_wgrad_compute"):
        if getattr(overlap, name):
            raise ConfigError(f"comm_overlap.{name}", f"{COMBINED_1F1B}.",
                              f"Set comm_overlap.{name}=false or leave it unset.")
    if overlap.data_parallel_size is not None and overlap.data_parallel_size != data_parallel_size:
        raise ConfigError("comm_overlap.data_parallel_size", f"{overlap.data_parallel_size} differs from this run's "
                          f"data-parallel size ({data_parallel_size}: world size / (TP x PP x CP)).",
                          "Leave it unset; bridge derives it.")
    values = {name: getattr(overlap, name) for name in COMM_OVERLAP_TARGETS}
    if overlap.overlap_p2p_comm and overlap.batch_p2p_comm is None:
        values["batch_p2p_comm"] = False  # megatron-core's interleaved schedule refuses both at once
    values = {name: value for name, value in values.items() if value is not None}
    _refuse_without_distributed_optimizer(cfg, values)
    applied = {}
    for name, value in values.items():
        for target in COMM_OVERLAP_TARGETS[name]:
            _apply(cfg, name, target, value)
            applied[target] = value
    _refuse_ignored_in_layout(cfg, values)
    return applied


def _te_importable() -> bool:
    return importlib.util.find_spec("transformer_engine") is not None


def _refuse_userbuffers(overlap: CommOverlapConfig) -> None:
    from bridge_cli.config.unsupported import REFUSED

    why = REFUSED["model.tp_comm_overlap"].why
    if not _te_importable():
        why += "; and transformer_engine does not import here"
    if overlap.tp_comm_overlap:
        raise ConfigError("comm_overlap.tp_comm_overlap", f"{why}.", "Leave it unset (or false).")
    refused = f"is read only with comm_overlap.tp_comm_overlap=true, which is refused (it {why})."
    if overlap.tp_comm_overlap_cfg is not None:
        raise ConfigError("comm_overlap.tp_comm_overlap_cfg", refused, "Leave it unset (null).")
    if overlap.tp_comm_bootstrap_backend not in (None, "nccl"):
        raise ConfigError("comm_overlap.tp_comm_bootstrap_backend", refused, "Leave it unset (or nccl).")


def _refuse_without_distributed_optimizer(cfg, values: dict[str, Any]) -> None:
    if cfg.ddp.use_distributed_optimizer:
        return
    for name in DATA_PARALLEL_FIELDS:
        if name in values and any(_get(cfg, target) != values[name] for target in COMM_OVERLAP_TARGETS[name]):
            direct = COMM_OVERLAP_TARGETS[name][0]
            raise ConfigError(f"comm_overlap.{name}", "applies only with the distributed optimizer, as in "
                              "Megatron-Bridge (which ignores it without one).",
                              f"Set optimizer.use_distributed_optimizer=true, or set {direct} instead.")


def _apply(cfg, name: str, target: str, value: Any) -> None:
    current, default = _get(cfg, target), _default(cfg, target)
    if current == value:
        return
    if current != default:
        raise ConfigError(f"comm_overlap.{name}", f"{_yaml(value)} contradicts {target}={_yaml(current)}.",
                          f"Set one of them: comm_overlap.{name} writes {target}.")
    section, _, field = target.partition(".")
    setattr(getattr(cfg, section), field, value)


def _refuse_ignored_in_layout(cfg, values: dict[str, Any]) -> None:
    """A field set on that megatron-core would not act on with this model and ddp: refused, naming what it needs."""
    m, ddp = cfg.model, cfg.ddp
    pp, vpp = m.pipeline_model_parallel_size, m.virtual_pipeline_model_parallel_size
    interleaved = "model.pipeline_model_parallel_size > 1 and model.virtual_pipeline_model_parallel_size"
    needs = (
        ("overlap_p2p_comm", pp > 1 and vpp is not None, "is read only by the interleaved pipeline schedule",
         interleaved),
        ("overlap_p2p_comm", not m.batch_p2p_comm, "cannot run with batch_p2p_comm (megatron-core refuses both)",
         "comm_overlap.batch_p2p_comm=false"),
        ("overlap_param_gather_with_optimizer_step", ddp.overlap_param_gather and pp > 1 and vpp is not None,
         "is read only with overlapped param gathers in the interleaved pipeline schedule",
         f"comm_overlap.overlap_param_gather=true, {interleaved}"),
        ("align_param_gather", ddp.overlap_param_gather, "is read only with overlapped param gathers",
         "comm_overlap.overlap_param_gather=true"),
        ("bucket_size", ddp.overlap_grad_reduce, "is dropped by megatron-core without overlapped grad reduces",
         "comm_overlap.overlap_grad_reduce=true"),
        ("defer_embedding_wgrad_compute", pp > 1 and m.gradient_accumulation_fusion,
         "defers into the pipeline flush through the fused wgrad GEMM (megatron-core refuses it otherwise)",
         "model.pipeline_model_parallel_size > 1 and model.gradient_accumulation_fusion=true"),
        ("wgrad_deferral_limit", m.defer_embedding_wgrad_compute, "is read only with deferred output-layer wgrads",
         "comm_overlap.defer_embedding_wgrad_compute=true"),
    )
    for name, met, why, setting in needs:
        if _turns_on(cfg, name, values) and not met:
            raise ConfigError(f"comm_overlap.{name}", f"{why}.", f"It needs {setting}; or leave it unset.")


def _turns_on(cfg, name: str, values: dict[str, Any]) -> bool:
    """Whether ``name`` is set to something other than its first target's megatron-core default (true, a size)."""
    return name in values and values[name] != _default(cfg, COMM_OVERLAP_TARGETS[name][0])


def _yaml(value: Any) -> str:
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else repr(value)


def _get(cfg, target: str) -> Any:
    section, _, field = target.partition(".")
    return getattr(getattr(cfg, section), field)


def _default(cfg, target: str) -> Any:
    section, _, field = target.partition(".")
    f = next(f for f in dataclasses.fields(getattr(cfg, section)) if f.name == field)
    return f.default_factory() if f.default is dataclasses.MISSING else f.default
