"""The one table of refused fields: fields the schema keeps (Megatron-Bridge's and megatron-core's names, so their
configs load) that bridge does not honour, each with why. Setting one away from its default is a ConfigError naming
its full key, saying why and to leave it at its default; nothing in the schema is accepted and silently ignored.
``tests/unit/test_schema_fields.py`` walks the whole schema and proves that every field is either read by the code or
listed here, and that docs/running.md's list is this table (``python -m bridge_cli.config.unsupported`` prints it).

Refusals that depend on other values (FSDP with what it does not combine with, runtime/fsdp.py; what the device
cannot run, runtime/device_rules.py; the pipeline's communication backend, runtime/launcher_fields.py) are checks in
code, not rows here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from bridge_cli.config.errors import ConfigError


@dataclass(frozen=True)
class Refused:
    """Why a field is refused away from its default."""

    why: str
    """What it would do that bridge does not (its message after the key)."""
    launcher: bool = False
    """A model field that Megatron-LM's launcher, not megatron-core's layers, acts on; checked once the
    comm_overlap section has written its model fields (training/validation.py)."""

    def message(self) -> str:
        return f"{self.why}." if self.launcher else f"is not supported by this version of bridge: {self.why}"


def _launcher(why: str) -> Refused:
    return Refused(why, launcher=True)


REFUSED: dict[str, Refused] = {k: Refused(v) for k, v in {
    "rng.te_rng_tracker": "Transformer Engine's RNG tracker (CUDA graphs) is not supported.",
    "rng.inference_rng_tracker": "the inference RNG tracker is not supported (bridge trains).",
    "rng.data_parallel_random_init": "every data-parallel replica starts from the same weights (DDP broadcasts them).",
    "train.exit_signal_handler_for_dataloader": "dataloader workers do not install the exit signal handler; "
                                                "the main process handles train.exit_signal.",
    "checkpoint.non_persistent_local_ckpt_dir": "only global non-persistent checkpoints are supported.",
    "checkpoint.non_persistent_local_ckpt_algo": "only global non-persistent checkpoints are supported.",
    "checkpoint.replication": "local checkpoint replication is not supported (only global checkpoints are).",
    "checkpoint.replication_jump": "local checkpoint replication is not supported (only global checkpoints are).",
    "checkpoint.replication_factor": "local checkpoint replication is not supported (only global checkpoints are).",
    "checkpoint.use_checkpoint_args": "the run's config always comes from the recipe and command line.",
    "checkpoint.ckpt_convert_format": "use `bridge convert-ckpt` to convert checkpoints.",
    "checkpoint.ckpt_convert_save": "use `bridge convert-ckpt` to convert checkpoints.",
    "dist.local_rank": "each process takes its local rank (its GPU) from its launcher: torchrun's LOCAL_RANK or "
                       "Slurm's SLURM_LOCALID.",
    "dist.lazy_init": "DDP is always initialized by bridge.",
    "dist.use_tp_pp_dp_mapping": "ranks are always ordered tp-cp-ep-dp-pp (megatron-core's default).",
    "dist.use_sharp": "SHARP is not set up by bridge.",
    "dist.external_gpu_device_mapping": "each rank uses the GPU of its LOCAL_RANK.",
    "dist.enable_megatron_core_experimental": "megatron-core's experimental features are not enabled by bridge.",
    "dataset.data_sharding": "data is always sharded across data-parallel ranks.",
    "dataset.multiple_validation_sets": "validation reads one blended validation split.",
    "dataset.full_validation": "validation reads train.eval_iters batches.",
    "dataset.memmap_workers": "bridge tokenizes the JSONL files in one pass, without memmap workers.",
}.items()} | {
    "model.tp_comm_overlap": _launcher("overlaps tensor-parallel communication through Transformer Engine's "
                                       "userbuffers, which bridge does not initialize"),
    "model.tp_comm_bootstrap_backend": _launcher("bootstraps Transformer Engine's userbuffers, which bridge does not "
                                                 "initialize"),
    "model.external_cuda_graph": _launcher("is Megatron-LM's training-loop capture of Transformer Engine CUDA graphs"),
    "model.cuda_graph_impl": _launcher("captures CUDA graphs from Megatron-LM's training loop (its create_cudagraphs "
                                       "calls, or Transformer Engine's graphed callables), which bridge does not run; "
                                       "whole-step graphs measured within 1% of eager on gpt2_124m "
                                       "(docs/performance.md)"),
    "model.use_inference_optimized_layers": _launcher("selects megatron-core's inference layers; bridge trains"),
    "model.overlap_moe_expert_parallel_comm": _launcher("runs megatron-core's combined 1F1B schedule, which needs a "
                                                        "forward step that builds its schedule plan; bridge's forward "
                                                        "step does not"),
    "model.hierarchical_context_parallel_sizes": _launcher("sizes the groups of Transformer Engine's a2a+p2p context "
                                                           "parallelism; bridge's context parallelism all-gathers keys "
                                                           "and values over one group"),
}
"""Full key (or a whole section) -> why it is refused."""


def check_unsupported(cfg: Any, launcher: bool = False) -> None:
    """Raise ConfigError for the first field of REFUSED that ``cfg`` sets away from its default: the launcher's model
    fields with ``launcher``, the others without."""
    for key, refused in REFUSED.items():
        if refused.launcher != launcher:
            continue
        section, _, name = key.partition(".")
        obj = getattr(cfg, section, None)
        if obj is None:
            continue
        for f in dataclasses.fields(obj):
            if name and f.name != name:
                continue
            value, default = getattr(obj, f.name), _default(f)
            if value != default:
                raise ConfigError(f"{section}.{f.name}", refused.message(), f"Leave it at its default ({default!r}).")


def markdown() -> str:
    """The table as docs/running.md lists it."""
    rows = [f"| `{key}` | {refused.why} |" for key, refused in sorted(REFUSED.items())]
    return "\n".join(["| field | why it is refused |", "| --- | --- |", *rows]) + "\n"


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


if __name__ == "__main__":
    print(markdown(), end="")
