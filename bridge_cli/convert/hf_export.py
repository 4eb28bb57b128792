"""`bridge convert-ckpt export-hf`: a torch_dist checkpoint -> a Hugging Face folder.

The model's shape comes from the checkpoint's run_config.yaml. The weights load, resharded by
megatron-core, into a one-process GPTModel whatever tensor/pipeline layout saved them, one decoder
layer at a time, so that host memory holds about one layer plus one output shard, never the
model; they are written in their stored dtype as ``model.safetensors`` (or shards plus an index above
``--max-shard-size``) next to a ``config.json`` that transformers loads offline. Vocabulary
padding rows are dropped. The folder is written as ``OUT_DIR.incomplete`` and renamed at the end.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from bridge_cli.checkpoint import layout, verify
from bridge_cli.convert import families, old_imports
from bridge_cli.convert.hf_files import check_output_free, parse_size, staged, write_safetensors


@dataclass(frozen=True)
class Exported:
    """What an export wrote, for the summary the CLI prints."""

    checkpoint: Path
    out_dir: Path
    model_type: str
    files: list[Path]


def export_hf(ckpt_dir: Path, out_dir: Path, step: Optional[int] = None, max_shard_size: str = "5GB",
              model_type: Optional[str] = None) -> Exported:
    """Convert the checkpoint under ``ckpt_dir`` (its latest, or iteration ``step``) into ``out_dir`` (new or
    empty), as the family ``model_type``; by default the one its run_config.yaml records
    (``checkpoint.export_hf_model_type``: import-hf records the source's), else the one its model fits."""
    from bridge_cli.config import mcore_schema
    from bridge_cli.convert import mcore_io
    from bridge_cli.convert.hf_weights import Architecture, to_hf
    from bridge_cli.convert.progress import per_tensor
    from bridge_cli.models.provider import GPTModelProvider

    out_dir = Path(out_dir)
    check_output_free(out_dir)
    max_shard_bytes = parse_size(max_shard_size)
    path = layout.require_checkpoint(Path(ckpt_dir), step).path
    model_cfg = mcore_io.model_config(mcore_io.saved_model_values(path))
    saved = verify.saved_config(path)
    # a checkpoint of an import that capped seq_length at the sliding window gets the window back
    values = old_imports.export_values(mcore_schema.to_yaml_values("model", GPTModelProvider, model_cfg), path, saved)
    recorded = ((saved or {}).get("checkpoint") or {}).get("export_hf_model_type")
    family = families.for_export(values, model_type, path, recorded)
    config = family.hf_config(values)
    arch = Architecture.of(model_cfg)

    mcore_io.init_process()
    model = mcore_io.build_model(model_cfg)
    groups = mcore_io.stream_weights(model, model_cfg, path)

    def tensors():
        group: dict = {}
        for pair in per_tensor(family.pairs(arch), "exporting"):
            # the family lists the tensors in the model's order; a pair's parameters are in one layer
            while pair.mcore_names[0] not in group:
                group = next(groups, None)
                if group is None:
                    raise RuntimeError(f"{pair.mcore_names[0]}: not among the model's parameters, or out of "
                                       "their order")
            yield from zip(pair.hf_names, to_hf(pair, [group[name] for name in pair.mcore_names], arch))

    with staged(out_dir) as staging:
        (staging / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        files = write_safetensors(staging, tensors(), max_shard_bytes)
    return Exported(path, out_dir, config["model_type"], [out_dir / f.name for f in files])
