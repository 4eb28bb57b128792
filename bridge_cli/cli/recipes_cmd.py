"""`bridge recipes`: list, show and copy recipes (no torch import)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Annotated, Optional

import typer

from bridge_cli.cli.errors import handles_user_errors

app = typer.Typer(help="List, show and copy recipes.", no_args_is_help=True)

RecipesDir = Annotated[Optional[list[Path]], typer.Option(
    "--recipes-dir", help="Extra folder of recipe YAML files (repeatable; also $BRIDGE_RECIPES_DIR).")]


@app.command("list")
def list_recipes(recipes_dir: RecipesDir = None) -> None:
    """Every recipe with its one-line description."""
    from bridge_cli.config import recipes

    found = recipes.available(recipes_dir)
    width = max(map(len, found), default=0)
    for name, recipe in found.items():
        typer.echo(f"{name:<{width}}  {recipe.description}")


@app.command()
@handles_user_errors
def show(name: str, recipes_dir: RecipesDir = None, debug: bool = False) -> None:
    """Print a recipe's YAML."""
    from bridge_cli.config import recipes

    typer.echo(recipes.find(name, recipes_dir).path.read_text(), nl=False)


@app.command()
@handles_user_errors
def cp(name: str, dest: Path, recipes_dir: RecipesDir = None, force: bool = False, debug: bool = False) -> None:
    """Copy a recipe to DEST to edit it; then `bridge pretrain recipe=DEST`."""
    from bridge_cli.config import recipes
    from bridge_cli.config.errors import ConfigError

    source = recipes.find(name, recipes_dir).path
    target = dest / source.name if dest.is_dir() else dest
    if target.exists() and not force:
        raise ConfigError(None, f"{target} already exists.", "Pass --force to overwrite it.")
    shutil.copyfile(source, target)
    typer.echo(f"copied {name} to {target}; run it with: bridge pretrain recipe={target}")
