"""Where recipes and config groups live, and how a recipe name or path is found.

Shipped recipes are looked up last, after ``--recipes-dir`` folders and ``$BRIDGE_RECIPES_DIR``
(a colon-separated list), so a user's folder can shadow a shipped name.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from bridge_cli.config.errors import ConfigError, did_you_mean

_PACKAGE = Path(__file__).resolve().parent.parent
RECIPES_ENV = "BRIDGE_RECIPES_DIR"


def _data_dir(name: str) -> Path:
    """``name`` inside an installed wheel (bridge_cli/_data/NAME), else the checkout's top level."""
    for candidate in (_PACKAGE / "_data" / name, _PACKAGE.parent / name):
        if candidate.is_dir():
            return candidate
    raise FileNotFoundError(f"bridge is installed without its {name}/ folder (looked in {_PACKAGE})")


def conf_dir() -> Path:
    return _data_dir("conf")


def shipped_recipes_dir() -> Path:
    return _data_dir("recipes")


def search_dirs(extra: list[Path] | None = None) -> list[Path]:
    """Recipe folders in lookup order: --recipes-dir, $BRIDGE_RECIPES_DIR, shipped."""
    env = [Path(p) for p in os.environ.get(RECIPES_ENV, "").split(os.pathsep) if p]
    return [*(extra or []), *env, shipped_recipes_dir()]


@dataclass(frozen=True)
class Recipe:
    name: str
    path: Path

    @property
    def description(self) -> str:
        """The recipe file's first comment line."""
        for line in self.path.read_text().splitlines():
            if line.startswith("#") and not line.startswith("# @package"):
                return line.lstrip("# ").strip()
        return ""


def available(extra: list[Path] | None = None) -> dict[str, Recipe]:
    """Every recipe by name; an earlier folder shadows a later one."""
    found: dict[str, Recipe] = {}
    for folder in reversed(search_dirs(extra)):
        for path in sorted(folder.glob("*.yaml")):
            found[path.stem] = Recipe(path.stem, path)
    return dict(sorted(found.items()))


def find(name_or_path: str, extra: list[Path] | None = None) -> Recipe:
    """The recipe a user named: a shipped or user recipe name, or a path to a YAML file."""
    looks_like_path = os.sep in name_or_path or name_or_path.endswith((".yaml", ".yml"))
    if looks_like_path:
        path = Path(name_or_path).expanduser()
        if not path.is_file():
            raise ConfigError("recipe", f"no recipe file at {path}.", "Check the path, or give a recipe name (bridge recipes list).")
        return Recipe(path.stem, path.resolve())
    for folder in (extra or []):
        if not folder.is_dir():
            raise ConfigError("--recipes-dir", f"{folder} is not a folder.")
    recipes = available(extra)
    if name_or_path not in recipes:
        hint = did_you_mean(name_or_path, recipes) or f"Known recipes: {', '.join(recipes)}."
        raise ConfigError("recipe", f"no recipe named {name_or_path!r}.", hint)
    return recipes[name_or_path]
