"""Checks run before loading, so a bad checkpoint fails with its path and the mismatch named.

Every rank runs them on the same files and reaches the same verdict, so a broken checkpoint
stops all ranks alike instead of leaving some waiting in a collective.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from bridge_cli.checkpoint import safe_pickle
from bridge_cli.checkpoint.errors import CheckpointError

# Model fields that fix the shapes of the weights; named when a checkpoint's shapes differ.
ARCHITECTURE = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "vocab_size", "make_vocab_size_divisible_by", "gated_linear_unit",
                "share_embeddings_and_output_weights", "position_embedding_type", "normalization",
                "add_bias_linear", "add_qkv_bias", "qk_layernorm", "num_moe_experts", "spec")


def check_files(path: Path) -> None:
    """``path`` is a complete torch_dist checkpoint: its metadata parses, no shard is missing or short, and
    none of its pickles names a class a checkpoint does not hold (see :mod:`~bridge_cli.checkpoint.safe_pickle`).

    Every reader of a checkpoint folder calls this first."""
    missing = [name for name in ("metadata.json", ".metadata") if not (path / name).is_file()]
    if missing:
        hint = (" It looks like a Megatron-LM checkpoint in the legacy `torch` format; bridge reads torch_dist "
                "(Megatron-LM --ckpt-format torch_dist)." if any(path.glob("mp_rank_*")) else "")
        raise CheckpointError(f"{path} is not a complete torch_dist checkpoint: {', '.join(missing)} "
                              f"missing.{hint}")
    try:
        backend = json.loads((path / "metadata.json").read_text()).get("sharded_backend")
    except (ValueError, AttributeError) as err:
        raise CheckpointError(f"{path / 'metadata.json'} is not valid checkpoint metadata ({err}).") from err
    if backend != "torch_dist":
        raise CheckpointError(f"{path} is a {backend!r} checkpoint; bridge reads torch_dist checkpoints.")
    metadata = safe_pickle.read_metadata(path)
    # megatron-core 0.16 writes the non-tensor state to common.pt; 0.19 stores it among the shards
    in_shards = any(key.startswith("common_state") for key in metadata.state_dict_metadata)
    if not (path / "common.pt").is_file() and not in_shards:
        raise CheckpointError(f"{path} is not a complete torch_dist checkpoint: common.pt missing.")
    storage = metadata.storage_data
    needed: dict[str, int] = {}
    for info in storage.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, size in sorted(needed.items()):
        shard = path / name
        if not shard.is_file():
            raise CheckpointError(f"{shard}: shard missing; the checkpoint is incomplete. "
                                  "Load an earlier one with checkpoint.ckpt_step=N.")
        if shard.stat().st_size < size:
            raise CheckpointError(f"{shard}: truncated shard ({shard.stat().st_size} bytes, the metadata "
                                  f"says {size}); the checkpoint is damaged. Load an earlier one with "
                                  "checkpoint.ckpt_step=N.")
    safe_pickle.check_objects(path, metadata)


def saved_config(path: Path) -> Optional[dict[str, Any]]:
    """The run_config.yaml saved next to the shards (None for checkpoints written by other tools)."""
    file = path / "run_config.yaml"
    if not file.is_file():
        return None
    import yaml

    # libyaml's parser where PyYAML has it: the pure-Python one takes 90 ms for a run's 900-line config
    return yaml.load(file.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


def check_model_matches(path: Path, model_template: dict, checkpoint_tensors: dict, model_cfg,
                        saved: Optional[dict]) -> None:
    """Every model tensor exists in the checkpoint with the same global shape; else name what differs."""
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    problems = []
    for tensor in nested_values(model_template):
        if not isinstance(tensor, ShardedTensor):
            continue
        stored = checkpoint_tensors.get(tensor.key)
        if stored is None:
            if not tensor.allow_shape_mismatch:
                problems.append(f"{tensor.key} is not in the checkpoint")
        elif tuple(stored.global_shape) != tuple(tensor.global_shape) and not tensor.allow_shape_mismatch:
            problems.append(f"{tensor.key} has shape {tuple(stored.global_shape)} in the checkpoint and "
                            f"{tuple(tensor.global_shape)} in this model")
    if not problems:
        return
    differences = _config_differences(saved.get("model", {}), model_cfg) if saved else []
    because = (f" The checkpoint was saved with {', '.join(differences)}." if differences else "")
    more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
    raise CheckpointError(f"{path} does not match this model: {'; '.join(problems[:3])}{more}.{because} "
                          "Use the model settings of the checkpoint (its run_config.yaml) or another checkpoint.")


def _config_differences(saved_model: dict, model_cfg) -> list[str]:
    out = []
    for key in ARCHITECTURE:
        if key in saved_model and hasattr(model_cfg, key):
            ours = getattr(model_cfg, key)
            if saved_model[key] != ours and not (key == "spec" and None in (saved_model[key], ours)):
                out.append(f"model.{key}={saved_model[key]} (this run: {ours})")
    return out
