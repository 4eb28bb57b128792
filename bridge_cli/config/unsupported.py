"""Fields the schema keeps (Megatron-Bridge's names, so its configs load) that bridge does not honour yet.

Setting one to anything but its default is a ConfigError naming it and saying why; nothing in the
schema is accepted and silently ignored. ``tests/unit/test_schema_fields.py`` walks the whole schema
and proves that every field is either read by the code or listed here.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from bridge_cli.config.errors import ConfigError

UNSUPPORTED: dict[str, str] = {
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
    "dist.nccl_communicator_config_path": "per-communicator NCCL settings are not passed to megatron-core yet.",
    "dist.use_tp_pp_dp_mapping": "ranks are always ordered tp-cp-ep-dp-pp (megatron-core's default).",
    "dist.use_gloo_process_groups": "megatron-core's optional gloo groups are not created.",
    "dist.use_sharp": "SHARP is not set up by bridge.",
    "dist.high_priority_stream_groups": "stream priorities are not passed to megatron-core yet.",
    "dist.external_gpu_device_mapping": "each rank uses the GPU of its LOCAL_RANK.",
    "dist.enable_megatron_core_experimental": "megatron-core's experimental features are not enabled by bridge.",
    "dataset.data_sharding": "data is always sharded across data-parallel ranks.",
    "dataset.multiple_validation_sets": "validation reads one blended validation split.",
    "dataset.full_validation": "validation reads train.eval_iters batches.",
    "dataset.memmap_workers": "bridge tokenizes the JSONL files in one pass, without memmap workers.",
}
"""Full key (or a whole section) -> why it is not supported."""


def check_unsupported(cfg: Any) -> None:
    """Raise ConfigError for the first field of UNSUPPORTED that ``cfg`` sets away from its default."""
    for key, why in UNSUPPORTED.items():
        section, _, name = key.partition(".")
        obj = getattr(cfg, section, None)
        if obj is None:
            continue
        for f in dataclasses.fields(obj):
            if name and f.name != name:
                continue
            value, default = getattr(obj, f.name), _default(f)
            if value != default:
                raise ConfigError(f"{section}.{f.name}", f"is not supported by this version of bridge: {why}",
                                  f"Leave it at its default ({default!r}).")


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None
