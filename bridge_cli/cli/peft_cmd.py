"""`bridge peft`: work with LoRA adapter checkpoints."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from bridge_cli.cli.errors import handles_user_errors

app = typer.Typer(help="Work with LoRA adapter checkpoints (bridge finetune ... peft=lora).", no_args_is_help=True)


@app.command()
@handles_user_errors
def merge(
    adapters: Annotated[Path, typer.Argument(help="The adapter checkpoint folder (a peft=lora run's checkpoint.save).")],
    output: Annotated[Path, typer.Argument(help="New folder for the merged whole-model checkpoint.")],
    overrides: Annotated[Optional[list[str]], typer.Argument(
        help="recipe=NAME|PATH and overrides of the fine-tuning run (the model must match).", show_default=False)] = None,
    base: Annotated[Optional[Path], typer.Option(
        "--base", help="Base model checkpoint (default: the one the adapters were trained on).")] = None,
    recipes_dir: Annotated[Optional[list[Path]], typer.Option("--recipes-dir")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Fold adapters into their base model: `bridge peft merge ADAPTERS OUT recipe=NAME`, W + (alpha/dim) B A."""
    from bridge_cli.cli.config_loading import load_config
    from bridge_cli.training.lora_merge import merge_adapters

    _, container = load_config(overrides, recipes_dir)
    path = merge_adapters(container, str(adapters), str(output), str(base) if base else None)
    typer.echo(f"wrote the merged model to {path}")


@app.command("export-hf")
@handles_user_errors
def export_hf(
    adapters: Annotated[Path, typer.Argument(help="The adapter checkpoint folder (a peft=lora run's save folder).")],
    out_dir: Annotated[Path, typer.Argument(help="New (or empty) folder for adapter_config.json and "
                                                 "adapter_model.safetensors.")],
    ckpt_step: Annotated[Optional[int], typer.Option(help="Iteration to export (default: the latest).")] = None,
    model_type: Annotated[Optional[str], typer.Option(
        help="Family whose module names the adapters take (default: the one export-hf writes the base as).")] = None,
    base_model: Annotated[Optional[str], typer.Option(
        help="Written as base_model_name_or_path: the base model's folder (its export-hf) or Hub name.")] = None,
    debug: Annotated[bool, typer.Option("--debug", help="Show tracebacks.")] = False,
) -> None:
    """Write LoRA adapters as a Hugging Face PEFT folder: `bridge peft export-hf ADAPTERS OUT`."""
    from bridge_cli.runtime.mcore_import import import_megatron_core

    import_megatron_core()
    from bridge_cli.convert.peft_export import export_peft

    done = export_peft(adapters, out_dir, ckpt_step, model_type, base_model)
    typer.echo(f"exported the LoRA adapters of {done.checkpoint} for {done.model_type} to {done.out_dir} "
               f"(on {', '.join(done.target_modules)})\n"
               f"load them: peft.PeftModel.from_pretrained(base, {str(done.out_dir)!r}), base being the "
               "transformers model of the base's export-hf")
