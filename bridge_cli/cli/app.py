"""The `bridge` command: argv -> composed config -> the library call. Thin by design.

Only typer is imported at start-up; torch and megatron-core load inside the commands that need
them, so `bridge --help` and `bridge recipes list` answer at once.
"""

from __future__ import annotations

import gc
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from bridge_cli.cli import config_cmd, peft_cmd, recipes_cmd
from bridge_cli.cli import preprocess_cmd
from bridge_cli.cli.config_loading import (DeviceOption, GpuMemory, Overrides, RecipesDir, WorldSize, check_gpu_memory,
                                           is_rank_zero, load_config, print_dry_run, print_memory)
from bridge_cli.cli.convert_cmd import app as convert_app
from bridge_cli.cli.errors import handles_user_errors

app = typer.Typer(
    name="bridge",
    help="Train GPT/Llama-style models on megatron-core from YAML recipes.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)
app.add_typer(recipes_cmd.app, name="recipes")
app.add_typer(config_cmd.app, name="config")
app.add_typer(peft_cmd.app, name="peft")
app.command("preprocess-data")(preprocess_cmd.preprocess_data)

DryRun = Annotated[bool, typer.Option("--dry-run", help="Print the resolved config and derived values, then stop.")]
Debug = Annotated[bool, typer.Option("--debug", help="Show tracebacks and every rank's output.")]


class ResumeMode(str, Enum):
    auto = "auto"
    never = "never"


Resume = Annotated[ResumeMode, typer.Option(
    "--resume", help="auto: with checkpoint.save set and checkpoint.load unset, resume from the newest "
                     "checkpoint in checkpoint.save if there is one. never: only checkpoint.load is loaded.")]


@app.command()
@handles_user_errors
def pretrain(overrides: Overrides = None, recipes_dir: RecipesDir = None, dry_run: DryRun = False,
             world_size: WorldSize = None, device: DeviceOption = None, gpu_memory: GpuMemory = None,
             resume: Resume = ResumeMode.auto, debug: Debug = False) -> None:
    """Pretrain a model: `bridge pretrain recipe=tiny train.train_iters=50`."""
    _train("pretrain", overrides, recipes_dir, dry_run, world_size, device, gpu_memory, resume)


@app.command()
@handles_user_errors
def finetune(overrides: Overrides = None, recipes_dir: RecipesDir = None, dry_run: DryRun = False,
             world_size: WorldSize = None, device: DeviceOption = None, gpu_memory: GpuMemory = None,
             resume: Resume = ResumeMode.auto, debug: Debug = False) -> None:
    """Fine-tune from a pretrained checkpoint: `bridge finetune recipe=tiny checkpoint.pretrained_checkpoint=DIR
    dataset=finetune dataset.dataset_root=DATA` (add peft=lora for LoRA)."""
    _train("finetune", overrides, recipes_dir, dry_run, world_size, device, gpu_memory, resume)


def _train(entry: str, overrides, recipes_dir, dry_run: bool, world_size, device, gpu_memory,
           resume: ResumeMode) -> None:
    """pretrain and finetune: compose and validate, stop at --dry-run, apply --resume, then call
    bridge_cli.training's entry point of that name with the GPT forward step."""
    import importlib

    _check_dry_run_options(dry_run, device, gpu_memory)
    recipe, container = load_config(overrides, recipes_dir, world_size, device=device,
                                    resume=None if dry_run else resume.value)
    if dry_run:
        _check_inputs(container, entry, device, resume.value)
        if is_rank_zero():
            print_dry_run(recipe, container)
            print_memory(container, gpu_memory)
        return
    from bridge_cli.training.gpt_step import forward_step

    run = getattr(importlib.import_module(f"bridge_cli.training.{entry}"), entry)
    run(container, forward_step)


@app.command("eval")
@handles_user_errors
def evaluate(overrides: Overrides = None, recipes_dir: RecipesDir = None, dry_run: DryRun = False,
             world_size: WorldSize = None, device: DeviceOption = None,
             output: Annotated[Optional[Path], typer.Option("--output", "-o", help="Also write the results as JSON.")] = None,
             debug: Debug = False) -> None:
    """Validation and test loss and perplexity of a checkpoint: `bridge eval recipe=tiny checkpoint.load=DIR` (DIR:
    a checkpoint, or a Hugging Face model folder)."""
    from bridge_cli.runtime.output_paths import check_output_file

    _check_dry_run_options(dry_run, device)
    check_output_file("--output", output)
    recipe, container = load_config(overrides, recipes_dir, world_size, device=device,
                                    hf_load=True)
    if dry_run:
        _check_inputs(container, "eval", device)
        if is_rank_zero():
            print_dry_run(recipe, container)
        return
    from bridge_cli.cli.eval_cmd import print_report
    from bridge_cli.training.eval import evaluate_checkpoint
    from bridge_cli.training.gpt_step import forward_step

    report = evaluate_checkpoint(container, forward_step)
    if report is not None:
        print_report(report, output)


def _check_inputs(container, command: str, device, resume: str = "never") -> None:
    """--dry-run refuses the inputs (checkpoints, data) the run would refuse. With --device it checks a config for
    another machine, where those files live: it leaves them out."""
    if device is None:
        from bridge_cli.training.run_inputs import check_run_inputs

        check_run_inputs(container, command, resume)


def _check_dry_run_options(dry_run: bool, device, gpu_memory=None) -> None:
    from bridge_cli.config.errors import ConfigError

    if device is not None and not dry_run:
        raise ConfigError("--device", "only applies with --dry-run: a run uses the device it finds.",
                          "Add --dry-run, or drop --device.")
    if gpu_memory is not None and not dry_run:
        raise ConfigError("--gpu-memory", "only applies with --dry-run: a run uses the GPU it finds.",
                          "Add --dry-run, or drop --gpu-memory.")
    check_gpu_memory(gpu_memory)


app.add_typer(convert_app, name="convert-ckpt")


@app.command()
@handles_user_errors
def plot(log_dir: Annotated[Path, typer.Argument(help="A run's logger.tensorboard_dir.")],
         output: Annotated[Optional[Path], typer.Option("--output", "-o", help="PNG path (default LOG_DIR/training.png).")] = None,
         debug: Debug = False) -> None:
    """Plot loss, learning rate and throughput against iteration as a PNG."""
    from bridge_cli.logging.plot import plot_run

    typer.echo(f"wrote {plot_run(log_dir, output or log_dir / 'training.png')}")


def main() -> None:
    try:
        app()
    finally:
        # Shutdown would otherwise garbage-collect the whole torch / megatron-core object graph,
        # about 2 s after the last step on the CPU machine; every file is already closed by now.
        gc.freeze()
