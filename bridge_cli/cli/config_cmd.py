"""`bridge config`: check a config without running it."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from bridge_cli.cli.config_loading import (DeviceOption, GpuMemory, Overrides, RecipesDir, WorldSize, check_gpu_memory,
                                           load_config, memory_advice)
from bridge_cli.cli.errors import handles_user_errors

app = typer.Typer(help="Validate configs and read field documentation.", no_args_is_help=True)


@app.command()
@handles_user_errors
def validate(overrides: Overrides = None, recipes_dir: RecipesDir = None, world_size: WorldSize = None,
             device: DeviceOption = None, gpu_memory: GpuMemory = None, debug: bool = False) -> None:
    """Compose and validate quietly, as a run would: exit 0 when valid, 2 with the reason when not. On cuda, a
    layout whose memory estimate is over the GPU's memory by more than the estimate's error is not valid; one
    within that error gets a warning."""
    from bridge_cli.config.errors import ConfigError

    check_gpu_memory(gpu_memory)
    _, container = load_config(overrides, recipes_dir, world_size, device=device)
    advice = memory_advice(container, gpu_memory)
    if advice is not None and advice.verdict == "will not fit":
        raise ConfigError(None, advice.message())
    if advice is not None and advice.message():
        typer.secho(f"warning: {advice.message()}", fg=typer.colors.YELLOW, err=True)


@app.command()
def docs(section: Annotated[Optional[str], typer.Argument(help="e.g. train, model, optimizer")] = None) -> None:
    """Each field of a section (or every section) with the value a run starts from and its one-line description.

    The value is the config groups' (conf/) before any recipe; where that differs from the schema's
    own default (Megatron-Bridge's), the schema default follows it.
    """
    import dataclasses

    from bridge_cli.runtime.mcore_import import import_megatron_core

    import_megatron_core()

    from omegaconf import OmegaConf

    from bridge_cli.config.compose import compose
    from bridge_cli.config.mcore_schema import field_docs, schema_fields
    from bridge_cli.config.schema import DATASETS, PEFT, SECTIONS, mcore_sections

    sections = {**SECTIONS, **{f"dataset ({k})": v for k, v in DATASETS.items()},
                **{f"peft ({k})": v for k, v in PEFT.items()}}
    mcore = mcore_sections()
    composed = OmegaConf.to_container(compose(None, []))
    for name in ([section] if section else [*sections, *mcore]):
        if name in mcore:
            rows = [(f.name, f.default) for f in schema_fields(mcore[name])]
            docs_ = field_docs(mcore[name])
        elif name in sections or f"dataset ({name})" in sections or name in ("peft", "lora"):
            cls = sections.get(name) or sections.get(f"dataset ({name})") or PEFT["lora"]
            rows = [(f.name, f.default if f.default is not dataclasses.MISSING else f.default_factory())
                    for f in dataclasses.fields(cls)]
            docs_ = field_docs(cls)
        else:
            typer.secho(f"error: no section {name!r}. Sections: {', '.join([*sections, *mcore])}.", err=True)
            raise typer.Exit(2)
        typer.echo(f"[{name}]")
        used = composed.get(name) or {}
        for field_name, default in rows:
            value = used.get(field_name, default)
            shown = f"{value!r}" if value == default else f"{value!r}  (schema default {default!r})"
            typer.echo(f"  {field_name} = {shown}\n      {docs_.get(field_name, '')}")
