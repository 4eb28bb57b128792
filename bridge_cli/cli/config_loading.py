"""Composing one run's config from argv, shared by every command that takes a recipe."""

from __future__ import annotations

import functools
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

DEFAULT_RECIPE = "tiny"

Overrides = Annotated[Optional[list[str]], typer.Argument(
    help="recipe=NAME|PATH, then Hydra overrides: key=value, group=option, +key=value.", show_default=False)]
RecipesDir = Annotated[Optional[list[Path]], typer.Option(
    "--recipes-dir", help="Extra folder of recipe YAML files (repeatable; also $BRIDGE_RECIPES_DIR).")]
WorldSize = Annotated[Optional[int], typer.Option(
    "--world-size", help="Process count to validate for (default: $WORLD_SIZE or 1).")]


class Device(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


DeviceOption = Annotated[Optional[Device], typer.Option(
    "--device", help="Device to validate for (default: cuda where a GPU is visible, else cpu); "
                     "checks a GPU run's config from a CPU machine.")]


GpuMemory = Annotated[Optional[float], typer.Option(
    "--gpu-memory", help="GiB per GPU to check the memory estimate against, with --device cuda (default: GPU 0 of "
                         "this machine, else 80).")]


def is_rank_zero() -> bool:
    from bridge_cli.runtime.launch_env import rank

    return rank() == 0


def load_config(overrides: list[str] | None, recipes_dir: list[Path] | None, world_size: int | None = None,
                device: Optional[Device | str] = None, resume: Optional[str] = None,
                hf_load: bool = False):
    """Compose, convert and validate one run's config (the recipe defaults to the tiny one); returns
    (recipe, ConfigContainer) with its derived values. It is composed once (with a Hugging Face folder, only the
    value overrides are applied again, above config.json's) and validated once.

    A ``checkpoint.pretrained_checkpoint`` that is a Hugging Face folder sets the model section from its
    config.json, between the recipe and the command line (:mod:`bridge_cli.convert.hf_training`).
    ``resume='auto'`` points ``checkpoint.load`` at ``checkpoint.save`` when that holds a checkpoint
    and ``load`` is unset, on the composed config, before the ConfigContainer is built.
    ``hf_load`` (evaluation) reads a ``checkpoint.load`` that is a Hugging Face folder as
    ``checkpoint.pretrained_checkpoint``: the weights to score, converted in memory.
    """
    from bridge_cli.runtime.mcore_import import import_megatron_core

    import_megatron_core()
    from bridge_cli.checkpoint.layout import is_hugging_face_folder
    from bridge_cli.config.compose import compose
    from bridge_cli.convert import old_imports
    from bridge_cli.training.config import ConfigContainer

    recipe, rest = DEFAULT_RECIPE, []
    for item in overrides or []:
        if item.startswith("recipe="):
            recipe = item.split("=", 1)[1]
        else:
            rest.append(item)
    composed = compose(recipe, rest, recipes_dir, beneath=functools.partial(_hugging_face_model, hf_load),
                       keep=True)
    ckpt = composed.checkpoint
    if hf_load and is_hugging_face_folder(ckpt.load):
        ckpt.pretrained_checkpoint, ckpt.load = ckpt.load, None
    if is_hugging_face_folder(ckpt.pretrained_checkpoint):
        from bridge_cli.convert import hf_training

        hf_training.check_model(composed.model, ckpt.pretrained_checkpoint)
    lines = []
    if resume is not None:
        from bridge_cli.checkpoint.load import resolve_resume

        load, lines = resolve_resume(ckpt, resume)
        if load is not None:
            ckpt.load = load
    container = ConfigContainer.from_yaml_dict(composed)
    for line in lines if is_rank_zero() else []:
        print(line, flush=True)
    # an import that capped seq_length at a sliding window, from before import-hf mapped windows
    old_imports.check_seq_length(container.checkpoint, container.model.seq_length)
    container.validate(world_size, getattr(device, "value", device))
    return recipe, container


def _hugging_face_model(hf_load: bool, composed) -> list[str]:
    """The overrides of config.json's model fields when the run starts from a Hugging Face folder
    (``checkpoint.pretrained_checkpoint``, or with ``hf_load`` ``checkpoint.load``): compose's layer between the
    recipe and the command line. Without a folder, the family registry is not imported."""
    from bridge_cli.checkpoint.layout import is_hugging_face_folder

    ckpt = composed.checkpoint
    folder = ckpt.load if hf_load and is_hugging_face_folder(ckpt.load) else ckpt.pretrained_checkpoint
    if not is_hugging_face_folder(folder):
        return []
    from bridge_cli.convert import hf_training

    return hf_training.model_overrides(folder)


def print_dry_run(recipe: str, container) -> None:
    from omegaconf import OmegaConf

    from bridge_cli.checkpoint.layout import is_hugging_face_folder
    from bridge_cli.config.compose import PRECEDENCE

    print(OmegaConf.to_yaml(container.to_dict()), end="")
    precedence = PRECEDENCE
    if is_hugging_face_folder(container.checkpoint.pretrained_checkpoint):
        precedence = PRECEDENCE.replace(" < command-line", " < config.json of checkpoint.pretrained_checkpoint "
                                        "(model) < command-line")
    print(f"# recipe: {recipe}\n# precedence: {precedence}")
    print(OmegaConf.to_yaml({"derived": container.derived.as_dict()}), end="")


def check_gpu_memory(gpu_memory: Optional[float]) -> None:
    if gpu_memory is not None and not gpu_memory > 0:
        from bridge_cli.config.errors import ConfigError

        raise ConfigError("--gpu-memory", f"must be a number of GiB above 0, got {gpu_memory}.",
                          "e.g. --gpu-memory 80.")


def memory_advice(container, gpu_memory: Optional[float]):
    """The memory estimate of a validated training config against the GPU (None on the CPU, which it does not
    estimate); see bridge_cli.training.layout_advice."""
    if container.derived.device != "cuda":
        return None
    from bridge_cli.training.layout_advice import advise, gpu_memory as gpu_size

    return advise(container, container.derived.world_size, *gpu_size(gpu_memory))


def print_memory(container, gpu_memory: Optional[float]) -> None:
    """--dry-run's memory block on stdout; a layout that may not or will not fit gets a warning on stderr too
    (a dry run is a question: its exit code stays 0), and one under torch FSDP2 whose distributed-optimizer twin
    fits too a note naming it."""
    advice = memory_advice(container, gpu_memory)
    if advice is None:
        return
    print("\n".join(advice.lines()))
    if advice.message():
        typer.secho(f"warning: {advice.message()}", fg=typer.colors.YELLOW, err=True)
    if advice.hint():
        typer.echo(f"note: {advice.hint()}", err=True)
