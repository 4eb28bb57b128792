"""Training from and to Hugging Face folders: ``checkpoint.pretrained_checkpoint=HF_DIR`` and
``checkpoint.export_hf_dir=OUT``.

Starting from a folder takes two steps, at the two times a run needs them:

1. **Config** (:func:`model_overrides`, :func:`check_model`, before validation): config.json's
   model fields, mapped by the family's own mapping (the one ``import-hf`` uses), go between the
   recipe and the command line. The precedence is therefore

       config groups (conf/) < recipe < config.json of the Hugging Face folder < command line

   except that a command-line value of a field that fixes the weights' shapes or the model's
   arithmetic (:data:`SHAPE_FIELDS` and the family's fixed fields, e.g. ``model.hidden_size``) must
   equal config.json's: a different one is a ConfigError naming both. Fields that leave the weights
   meaningful (``seq_length`` up to what the model supports, dropouts, ``init_method_std``, the
   RoPE base, vocabulary padding) are the command line's to change.

2. **Load** (:func:`converted_for_loading`): the folder is converted by ``bridge convert-ckpt
   import-hf`` into a temporary torch_dist checkpoint, which the normal loading path then reads.
   This was chosen over copying each rank's slice of every tensor in memory because megatron-core's
   loader already reshards a torch_dist checkpoint to any tensor/pipeline/expert layout (with its
   vocabulary padding and the per-rank split of fused gate/up weights), and the import is the tested,
   streaming conversion: nothing about sharding is written twice. The import runs as a child process
   (a world of one: a conversion cannot share this run's process groups) on the first process of each
   node, into that node's temporary folder, which is deleted once every rank has loaded it.

Ending in a folder (:func:`export_checkpoint`): once the final checkpoint is saved (or each one, with
``checkpoint.export_hf_each_save``), rank 0 runs ``bridge convert-ckpt export-hf`` on it, in a child
process for the same reason, while the other ranks wait.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

from bridge_cli.checkpoint import layout
from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.config.errors import ConfigError
from bridge_cli.convert import fp8_blocks, hf_config

SHAPE_FIELDS = ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                "kv_channels", "vocab_size", "share_embeddings_and_output_weights")
"""Model fields that set the weights' shapes; with the family's fixed fields, the command line cannot change them."""

MOE_FIELDS = ("num_moe_experts", "moe_ffn_hidden_size", "moe_layer_freq", "moe_shared_expert_intermediate_size",
              "moe_router_topk", "moe_router_pre_softmax", "moe_router_topk_scaling_factor", "moe_router_num_groups",
              "moe_router_group_topk")
"""Those of a mixture-of-experts model (its experts' shapes and its routing), which config.json sets per model."""

WINDOW_FIELDS = ("window_size", "window_attn_skip_freq")
"""A sliding-window model's windows (which layers, how far back), which config.json sets per model."""

_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
               "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
"""torchrun's variables, which the conversion's child process must not see (it is a world of one)."""


is_hf_folder = layout.is_hugging_face_folder
"""Whether a path is a Hugging Face model folder; the checkpoint layer's test, so a command asks it without importing
the families."""


def model_fields(hf_dir: str) -> tuple[Any, dict[str, Any]]:
    """(family, the ``model:`` fields of ``hf_dir``'s config.json), as import-hf maps them; quantization settings
    that import-hf would refuse are refused here, before the run starts."""
    from bridge_cli.convert import families  # the ~50 family modules: only for a run from a Hugging Face folder
    from bridge_cli.convert.hf_files import tensor_names

    hf = hf_config.read_config(Path(hf_dir))
    where = Path(hf_dir) / "config.json"
    family = families.for_import(hf, where)
    fields = family.model_fields(hf, where, tensors=tensor_names(Path(hf_dir)))
    fp8_blocks.check_config(hf, where)
    return family, fields


def model_overrides(hf_dir: str) -> list[str]:
    """Hydra overrides setting config.json's model fields and family (to go between the recipe and the command
    line): the run's checkpoints export as the folder's family, as those of its import do."""
    family, fields = model_fields(hf_dir)
    return [*(f"model.{key}={json.dumps(value)}" for key, value in fields.items()),
            f"checkpoint.export_hf_model_type={family.model_type}"]


def check_model(model: Mapping[str, Any], hf_dir: str) -> None:
    """Refuse a composed ``model:`` section whose shape differs from config.json's (only the command line,
    applied after config.json, can make it differ), and a seq_length longer than the model supports."""
    family, fields = model_fields(hf_dir)
    where = Path(hf_dir) / "config.json"
    fixed = [*SHAPE_FIELDS, *(key for key in fields if key in family.fixed or key in (*MOE_FIELDS, *WINDOW_FIELDS))]
    for key in fixed:
        if model.get(key) != fields[key]:
            raise ConfigError(f"model.{key}", f"the command line sets {model.get(key)!r}; {where} says {fields[key]!r}, "
                              "and the pretrained weights have that shape.",
                              f"Drop model.{key} from the command line (the Hugging Face folder sets it).")
    hf = family.completed(hf_config.read_config(Path(hf_dir)))
    try:
        hf_config.seq_length(hf, where, model["seq_length"], family.longest(hf, where))
    except ConfigError as err:
        raise ConfigError("model.seq_length", err.message, "Set model.seq_length to that length or less.") from None


@contextmanager
def converted_for_loading(ckpt_cfg, local_rank: int, base_needed: bool = False) -> Iterator[Optional[str]]:
    """The folder to load ``checkpoint.pretrained_checkpoint`` from for the duration of the block: a
    temporary torch_dist conversion when it is a Hugging Face folder that this run loads, else None.

    A run resuming from ``checkpoint.load`` needs no conversion, unless its adapters (``base_needed``,
    LoRA) load onto the pretrained weights. Call on every rank (``local_rank``: its index on its node)
    once the process group exists; it synchronises them.
    """
    import torch.distributed as dist

    hf_dir = ckpt_cfg.pretrained_checkpoint
    resuming = ckpt_cfg.load is not None and layout.find_checkpoint(Path(ckpt_cfg.load)).path is not None
    if not is_hf_folder(hf_dir) or (resuming and not base_needed):
        yield None
        return
    name = [f"bridge-hf-import-{uuid.uuid4().hex[:16]}"]
    if dist.is_initialized():
        dist.broadcast_object_list(name, src=0)  # one name for the launch; each node converts into its own
    out = Path(tempfile.gettempdir()) / name[0]
    failed = _import(hf_dir, out) if local_rank == 0 else 0
    status = [failed]
    if dist.is_initialized():
        status = [None] * dist.get_world_size()
        dist.all_gather_object(status, failed)
    try:
        if any(status):
            raise CheckpointError(f"checkpoint.pretrained_checkpoint={hf_dir}: converting the Hugging Face folder "
                                  "failed (the error is printed above).")
        yield str(out)
    finally:
        if dist.is_initialized():
            dist.barrier()
        if local_rank == 0:
            shutil.rmtree(out, ignore_errors=True)


def _import(hf_dir: str, out: Path) -> int:
    """Run ``bridge convert-ckpt import-hf HF_DIR OUT`` in a world of one on the CPU; its exit code."""
    quantized = fp8_blocks.KEY in hf_config.read_config(Path(hf_dir))
    print(f"checkpoint: converting the Hugging Face folder {hf_dir} for this run (bridge convert-ckpt import-hf"
          f"{'; its FP8 weights dequantized from their 128x128 block scales' if quantized else ''})", flush=True)
    return _convert_in_child("import-hf", str(hf_dir), str(out), quiet=True)


def export_checkpoint(ckpt_cfg, step: int) -> None:
    """Write iteration ``step`` of ``checkpoint.save`` as a Hugging Face folder: ``checkpoint.export_hf_dir``, or
    its ``iter_<step>`` subfolder with ``export_hf_each_save`` (replacing an export of the same iteration,
    as the save replaced its checkpoint). Rank 0 converts; every rank calls and waits."""
    import torch.distributed as dist

    out = Path(ckpt_cfg.export_hf_dir)
    if ckpt_cfg.export_hf_each_save:
        out = out / layout.iter_name(step)
    failed = 0
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"checkpoint: exporting iteration {step} to the Hugging Face folder {out}", flush=True)
        if ckpt_cfg.export_hf_each_save:
            shutil.rmtree(out, ignore_errors=True)
        model_type = ["--model-type", ckpt_cfg.export_hf_model_type] if ckpt_cfg.export_hf_model_type else []
        failed = _convert_in_child("export-hf", ckpt_cfg.save, str(out), "--ckpt-step", str(step), *model_type)
    status = [failed]
    if dist.is_initialized():
        status = [None] * dist.get_world_size()
        dist.all_gather_object(status, failed)
    if any(status):
        raise CheckpointError(f"checkpoint.export_hf_dir={ckpt_cfg.export_hf_dir}: the export failed (the error is "
                              f"printed above); the checkpoint is saved, export it with bridge convert-ckpt export-hf "
                              f"{ckpt_cfg.save} OUT_DIR.")


def _convert_in_child(command: str, *args: str, quiet: bool = False) -> int:
    """Run ``bridge convert-ckpt COMMAND ARGS`` in a world of one on the CPU; its exit code."""
    env = {key: value for key, value in os.environ.items()
           if key not in _LAUNCH_ENV and not key.startswith(("TORCHELASTIC_", "SLURM_"))}
    env["CUDA_VISIBLE_DEVICES"] = ""  # a conversion runs on the CPU and must not take GPU memory
    return subprocess.run([sys.executable, "-m", "bridge_cli", "convert-ckpt", command, *args], env=env,
                          stdout=subprocess.DEVNULL if quiet else None).returncode
