"""`bridge convert-ckpt`: Hugging Face <-> megatron-core torch_dist checkpoints (torch loads inside)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from bridge_cli.cli.errors import handles_user_errors

app = typer.Typer(help="Convert checkpoints between Hugging Face and megatron-core torch_dist.",
                  no_args_is_help=True)

Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks.")]


@app.command("import-hf")
@handles_user_errors
def import_hf(
    hf_dir: Annotated[Path, typer.Argument(help="Hugging Face model folder: config.json and *.safetensors.")],
    out_dir: Annotated[Path, typer.Argument(help="New (or empty) folder for the checkpoint and its recipe.yaml.")],
    recipe: Annotated[str, typer.Option(help="Recipe whose training settings recipe.yaml starts from.")] = "tiny",
    tp: Annotated[int, typer.Option("--tp", min=1, help="Tensor-parallel size written into recipe.yaml.")] = 1,
    pp: Annotated[int, typer.Option("--pp", min=1, help="Pipeline-parallel size written into recipe.yaml.")] = 1,
    seq_length: Annotated[Optional[int], typer.Option(
        min=1, help="model.seq_length (default: max_position_embeddings, at most 4096).")] = None,
    recipes_dir: Annotated[Optional[list[Path]], typer.Option(
        "--recipes-dir", help="Extra folder of recipe YAML files (repeatable; also $BRIDGE_RECIPES_DIR).")] = None,
    debug: Debug = False,
) -> None:
    """Convert a Hugging Face model (see `families`) into a torch_dist checkpoint that bridge trains from."""
    from bridge_cli.runtime.mcore_import import import_megatron_core

    import_megatron_core()
    from bridge_cli.convert.hf_import import import_hf as run_import

    done = run_import(hf_dir, out_dir, _validated_recipe, recipe, tp, pp, seq_length, recipes_dir)
    typer.echo(f"imported {done.model_type} from {hf_dir}: {done.parameters:,} parameters ({done.dtypes})\n"
               f"  checkpoint {done.checkpoint} (torch_dist; loads under any tensor/pipeline-parallel layout)\n"
               f"  recipe     {done.recipe}\n"
               f"train from it: bridge pretrain recipe={done.recipe}")


def _validated_recipe(recipe: Path, world_size: int):
    """import-hf's written recipe, composed and validated as `bridge pretrain` would, for the device it
    trains on (a GPU recipe's import runs on a CPU node too)."""
    from bridge_cli.config.compose import compose
    from bridge_cli.runtime.device_rules import needs_cuda
    from bridge_cli.training.config import ConfigContainer

    cfg = ConfigContainer.from_yaml_dict(compose(str(recipe), []))
    cfg.validate(_fitting_world(cfg.model, world_size), "cuda" if needs_cuda(cfg) else None)
    return cfg


def _fitting_world(model, world_size: int) -> int:
    """The fewest ranks, a multiple of ``world_size``, that the recipe's layout fits: an expert-parallel recipe
    (mixtral_8x7b at EP=8) is checked at a world its experts divide, as it will train, not at TP x PP."""
    import math

    from bridge_cli.runtime.parallel_layout import model_world_step

    return math.lcm(world_size, model_world_step(model))


@app.command("export-hf")
@handles_user_errors
def export_hf(
    ckpt_dir: Annotated[Path, typer.Argument(help="A checkpoint.save folder (or one iter_* folder in it).")],
    out_dir: Annotated[Path, typer.Argument(help="New (or empty) folder for config.json and *.safetensors.")],
    ckpt_step: Annotated[Optional[int], typer.Option(help="Iteration to export (default: the latest).")] = None,
    max_shard_size: Annotated[str, typer.Option(help="Largest safetensors file before sharding, e.g. 5GB.")] = "5GB",
    model_type: Annotated[Optional[str], typer.Option(
        help="Family to write (see `families`; default: qwen3 with q/k norms, qwen2 with q/k/v biases, phi3 with "
             "partial RoPE, else llama; with experts mixtral, qwen3_moe or olmoe).")] = None,
    debug: Debug = False,
) -> None:
    """Convert a bridge / Megatron torch_dist checkpoint into a folder transformers loads."""
    from bridge_cli.runtime.mcore_import import import_megatron_core

    import_megatron_core()
    from bridge_cli.convert.hf_export import export_hf as run_export

    done = run_export(ckpt_dir, out_dir, ckpt_step, max_shard_size, model_type)
    typer.echo(f"exported {done.checkpoint} as {done.model_type} to {done.out_dir} "
               f"({', '.join(f.name for f in done.files)} + config.json)\n"
               f"load it: transformers.AutoModelForCausalLM.from_pretrained({str(done.out_dir)!r})")


@app.command("families")
def families() -> None:
    """List the Hugging Face families import-hf and export-hf convert, with their limits, and the model types
    refused with why (one line each)."""
    from bridge_cli.convert.families import listing

    typer.echo("\n".join(listing()))
