"""`bridge convert-ckpt import-hf`: a Hugging Face folder -> a torch_dist checkpoint and a recipe.

Everything that can be checked from config.json and the safetensors headers is checked before
any tensor is read: an unsupported model, a missing tensor or a wrong shape fails in a second,
naming the file or tensor. The weights then go one tensor at a time from the memory-mapped
safetensors into a megatron-core GPTModel built without random initialisation, which is saved
with megatron-core's dist_checkpointing. The output folder is written as ``OUT_DIR.incomplete``
and renamed at the end.

    OUT_DIR/recipe.yaml                        the base recipe with the model section of config.json and its
                                               family (checkpoint.export_hf_model_type, export-hf's default); its
                                               header says whether FP8 weights were dequantized (fp8_blocks.py)
    OUT_DIR/latest_checkpointed_iteration.txt  0
    OUT_DIR/iter_0000000/                      torch_dist shards + run_config.yaml
"""

from __future__ import annotations

import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import yaml

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.convert import families, fp8_blocks, hf_config
from bridge_cli.convert.hf_files import SafetensorsFolder, check_output_free, staged
from bridge_cli.models.attention.config_checks import model_blockers

RECIPE = "recipe.yaml"


@dataclass(frozen=True)
class Imported:
    """What an import wrote, for the summary the CLI prints."""

    out_dir: Path
    checkpoint: Path
    recipe: Path
    model_type: str
    parameters: int
    dtypes: str


def import_hf(hf_dir: Path, out_dir: Path, load_recipe: Callable[[Path, int], Any], base_recipe: str = "tiny",
              tensor_parallel: int = 1, pipeline_parallel: int = 1, seq_length: Optional[int] = None,
              recipes_dirs: Optional[list[Path]] = None) -> Imported:
    """Convert the Hugging Face model in ``hf_dir`` into ``out_dir`` (new or empty).

    The recipe takes its training settings from ``base_recipe`` and its model section from
    config.json; ``tensor_parallel``/``pipeline_parallel`` only go into the recipe, since the
    checkpoint loads under any layout. ``load_recipe(path, world_size)`` composes and validates the
    written recipe as `bridge pretrain` would and returns its ConfigContainer: the command passes
    training's, which this package sits below (docs/architecture.md).
    """
    from bridge_cli.config import recipes
    from bridge_cli.convert.hf_weights import Architecture

    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    check_output_free(out_dir)
    hf = hf_config.read_config(hf_dir)
    family = families.for_import(hf, hf_dir / "config.json")
    weights = SafetensorsFolder(hf_dir)
    fields = family.model_fields(hf, hf_dir / "config.json", seq_length, tensors=weights.shapes)
    arch = Architecture.of(types.SimpleNamespace(**fields))
    todo = family.pairs(arch)
    fp8 = check_tensors(weights, todo, arch, hf, hf_dir, family.model_type)
    base = recipes.find(base_recipe, recipes_dirs)
    with staged(out_dir) as staging:
        recipe = staging / RECIPE
        recipe.write_text(recipe_text(base, fields, hf_dir, out_dir, hf["model_type"], tensor_parallel,
                                      pipeline_parallel, fp8))
        cfg = load_recipe(recipe, tensor_parallel * pipeline_parallel)
        _check_derived_model(cfg, fields)
        parameters, dtypes = _convert(weights, todo, arch, cfg, staging, fp8)
    return Imported(out_dir, out_dir / "iter_0000000", out_dir / RECIPE, family.model_type, parameters, dtypes)


def check_tensors(weights: SafetensorsFolder, todo: list, arch, hf: dict, hf_dir: Path,
                  model_type: str) -> Optional[fp8_blocks.Fp8Blocks]:
    """Every tensor of the pairs ``todo`` is there with its shape, an FP8 one with its block scales (config.json
    ``hf`` saying how to apply them), and nothing else is; returns the FP8 ones (None: none)."""
    from bridge_cli.convert.hf_weights import ignorable

    expected = {name: shape for pair in todo for name, shape in pair.hf}
    missing = [name for name in expected if name not in weights.shapes]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{hf_dir}: tensor {missing[0]} is missing{more}. The download is incomplete, or "
                              "config.json describes another model.")
    for name, shape in expected.items():
        if weights.shapes[name] != shape:
            raise CheckpointError(f"{weights.file_of(name)}: tensor {name} has shape {weights.shapes[name]}; "
                                  f"config.json implies {shape}. The weights and config.json belong to "
                                  "different models.")
    fp8 = fp8_blocks.plan(hf, hf_dir / "config.json", weights, expected)
    scales = set(fp8.scales.values()) if fp8 else set()
    unknown = [name for name in weights.shapes if name not in expected and name not in scales
               and not ignorable(name, arch)]
    if unknown:
        more = f" (and {len(unknown) - 3} more)" if len(unknown) > 3 else ""
        raise CheckpointError(f"{hf_dir}: tensors a {model_type} model does not have: {', '.join(unknown[:3])}{more}. "
                              "Its architecture differs from what config.json says; bridge cannot convert it.")
    return fp8


def recipe_text(base, fields: dict, hf_dir: Path, out_dir: Path, model_type: str, tensor_parallel: int,
                pipeline_parallel: int, fp8: Optional[fp8_blocks.Fp8Blocks] = None) -> str:
    """The base recipe with config.json's model section, starting from the imported weights (``fp8``: those
    dequantized from FP8 blocks, which the header records)."""
    recipe = yaml.safe_load(base.path.read_text()) or {}
    model = {**(recipe.get("model") or {}), **fields}
    if tensor_parallel > 1:
        model["tensor_model_parallel_size"] = tensor_parallel
        if model.get("num_moe_experts"):  # megatron-core's MoE layer trains under TP only so
            model["sequence_parallel"] = True
    if pipeline_parallel > 1:
        model["pipeline_model_parallel_size"] = pipeline_parallel
    header = (f"# @package _global_\n# {model_type} imported from {hf_dir.resolve()} by `bridge convert-ckpt "
              f"import-hf`; training settings from recipe {base.name}.\n")
    if fp8:  # the checkpoint holds model.params_dtype weights; export-hf writes them unquantized
        header += f"# weights: {fp8.note()}, into model.params_dtype.\n"
    blockers = model_blockers(types.SimpleNamespace(**model)) if model.get("fused_single_qkv_rope") else []
    if blockers:  # a speed option of the base recipe that this family's attention cannot take
        model["fused_single_qkv_rope"] = False
        header += f"# model.fused_single_qkv_rope of {base.name} is off here: {'; '.join(blockers)}.\n"
    recipe["model"] = model
    # the family goes with the checkpoints trained from here, so that export-hf writes the one the user started from
    recipe["checkpoint"] = {**(recipe.get("checkpoint") or {}), "pretrained_checkpoint": str(out_dir.resolve()),
                            "export_hf_model_type": model_type}
    return header + yaml.safe_dump(recipe, sort_keys=False)


def _check_derived_model(cfg, fields: dict) -> None:
    """Validation derives some model fields (a tokenizer sets the vocabulary size); one that no longer
    matches config.json is refused rather than converted into another shape."""
    from bridge_cli.config.errors import ConfigError

    model = cfg.run_record()["model"]
    for key, value in fields.items():
        if model[key] != value:
            raise ConfigError(f"model.{key}", f"the recipe makes it {model[key]}; config.json says {value}.",
                              "Import with another --recipe (its tokenizer may set the vocabulary size).")


def _convert(weights: SafetensorsFolder, todo: list, arch, cfg, staging: Path,
             fp8: Optional[fp8_blocks.Fp8Blocks]) -> tuple[int, str]:
    """Copy every tensor (``fp8``'s dequantized as read) into a fresh model and save it; returns (parameter count,
    'from -> to' dtypes)."""
    import torch

    from bridge_cli.convert import mcore_io
    from bridge_cli.convert.hf_weights import to_mcore
    from bridge_cli.convert.progress import per_tensor

    mcore_io.init_process()
    model = mcore_io.build_model(mcore_io.model_config(cfg.run_record()["model"]))
    params = mcore_io.weights(model)
    differ = set(params) ^ {name for pair in todo for name in pair.mcore_names}
    if differ:  # megatron-core's layer spec names its modules differently from hf_weights: a bug
        raise RuntimeError(f"megatron-core parameters and the Hugging Face mapping differ: {sorted(differ)}")
    source_dtypes, dtype = set(), cfg.model.params_dtype
    with torch.no_grad():
        for pair in per_tensor(todo, "importing"):
            parts = []
            for name in pair.hf_names:
                part = weights.tensor(name)
                source_dtypes.add(str(part.dtype).removeprefix("torch."))
                # in the model's dtype at once: to_mcore rearranges (fused projections, copies), it does no arithmetic
                parts.append(fp8.dequantized(weights, name, part, dtype) if fp8 else part)
            for name, value in zip(pair.mcore_names, to_mcore(pair, parts, arch), strict=True):
                param = params[name]
                if value.shape != param.shape:  # copy_ would broadcast; the mapping and the model disagree
                    raise RuntimeError(f"{name}: converted to {tuple(value.shape)}, the model has "
                                       f"{tuple(param.shape)}")
                param.copy_(value)
    mcore_io.save_weights(model, cfg, staging)
    target = str(dtype).removeprefix("torch.")
    dtypes = f"{'/'.join(sorted(source_dtypes))} -> {target}"
    return sum(p.numel() for p in params.values()), dtypes + (f"; {fp8.note()}" if fp8 else "")
