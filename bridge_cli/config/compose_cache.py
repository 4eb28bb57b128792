"""A launch's composed config, kept for the next launch of the same recipe and overrides.

Composing costs a launch 0.5-0.8 s on a 2-core CPU (Hydra's defaults list, and OmegaConf building the schema of
megatron-core's config classes that Hydra checks it against); reading the kept result back costs about 0.05 s,
and Hydra is then not imported. An entry is found by a key of everything the composition reads: the recipe's
name and text, the overrides as written, every file of conf/, the size and modification time of every module of
bridge_cli and of the modules that define megatron-core's config classes (the schema is read from them), and the
versions of Python, megatron-core, Hydra, OmegaConf and PyYAML. An edited recipe, conf/ file or schema is a new
key, so an entry is never stale. No entry is kept or read where the result would depend on more than that: a
value that calls a resolver (``${oc.env:...}`` reads the environment of the launch) or an override of Hydra's
own settings (``hydra.searchpath`` adds folders). Entries are JSON, data and never code, in
``$XDG_CACHE_HOME/bridge/config`` next to the compile cache; the newest 64 are kept. ``BRIDGE_CONFIG_CACHE=off``
composes every launch afresh and keeps nothing.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from bridge_cli.config import recipes, schema

FORMAT = 1
"""Bumped when an entry's layout changes."""

KEEP = 64
"""Entries kept; the least recently used go first."""

ENV = "BRIDGE_CONFIG_CACHE"
"""``off`` (or ``0``, ``false``, ``no``): compose every launch afresh and keep nothing."""

_RESOLVER = re.compile(r"\$\{\s*[\w.\-]+\s*:")
"""``${name:...}``: a resolver call (oc.env, oc.decode, hydra:...), whose value may differ from launch to launch."""


def folder() -> Path:
    from bridge_cli.runtime.compile_cache import cache_root

    return cache_root() / "config"


def key(recipe_name: Optional[str], recipe_text: Optional[str], overrides: list[str]) -> Optional[str]:
    """The entry's name for this composition, or None where its result must not be kept."""
    if os.environ.get(ENV, "on").strip().lower() in ("off", "0", "false", "no"):
        return None
    conf = recipes.conf_dir()
    conf_files = sorted(p for p in conf.rglob("*") if p.is_file())
    texts = [recipe_text or "", *overrides]
    digest = hashlib.sha256()
    for path in conf_files:
        data = path.read_bytes()
        texts.append(data.decode(errors="replace"))
        digest.update(f"{path.relative_to(conf)}\0{len(data)}\0".encode() + data)
    if any(_RESOLVER.search(text) for text in texts):
        return None
    if any(o.lstrip("+~").startswith("hydra") for o in overrides):
        return None
    digest.update(json.dumps([FORMAT, recipe_name, recipe_text, overrides, _versions()]).encode())
    for path in _schema_modules():
        stat = path.stat()
        digest.update(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    return digest.hexdigest()[:32]


def _versions() -> list[str]:
    from importlib.metadata import version

    import omegaconf
    import yaml

    return [sys.version, version("megatron-core"), version("hydra-core"), omegaconf.__version__, yaml.__version__]


def _schema_modules() -> list[Path]:
    """bridge_cli's modules, and those that define megatron-core's config classes and their bases."""
    package = Path(schema.__file__).resolve().parent.parent
    paths = set(package.rglob("*.py"))
    for cls in schema.mcore_sections().values():
        for klass in cls.__mro__:
            module = sys.modules.get(klass.__module__)
            if getattr(module, "__file__", None):
                paths.add(Path(module.__file__))
    return sorted(paths)


def load(name: str) -> Optional[DictConfig]:
    """The kept config of key ``name``, or None."""
    path = folder() / f"{name}.json"
    try:
        entry = json.loads(path.read_text())
        os.utime(path)  # most recently used: kept longest
    except (OSError, ValueError):
        return None
    if not isinstance(entry, dict) or entry.get("format") != FORMAT:
        return None
    try:
        return _rebuild(entry)
    except (KeyError, TypeError, ValueError, AttributeError, OmegaConfBaseException):  # an entry edited by hand
        return None


def store(name: str, cfg: DictConfig) -> None:
    """Keep ``cfg`` as key ``name``'s entry where it reads back the same; a folder that cannot be written keeps
    nothing."""
    entry = _entry(cfg)
    if entry is None:
        return
    text = json.dumps(entry)
    if not _same(_rebuild(json.loads(text)), cfg):
        return
    target = folder()
    try:
        target.mkdir(parents=True, exist_ok=True)
        partial = target / f".{name}.{os.getpid()}.tmp"
        partial.write_text(text)
        os.replace(partial, target / f"{name}.json")  # whole entries only, for ranks that read while one writes
        _prune(target)
    except OSError:
        return


def _prune(target: Path) -> None:
    entries = sorted(target.glob("*.json"), key=lambda p: p.stat().st_mtime_ns)
    for path in entries[:-KEEP]:
        path.unlink(missing_ok=True)


def _schemas() -> dict[str, type]:
    """Every schema class of bridge's own sections, by a name that says which."""
    return {**{f"section:{n}": c for n, c in schema.SECTIONS.items()},
            **{f"dataset:{n}": c for n, c in schema.DATASETS.items()},
            **{f"peft:{n}": c for n, c in schema.PEFT.items()}}


def _entry(cfg: DictConfig) -> Optional[dict[str, Any]]:
    by_class = {cls: name for name, cls in _schemas().items()}
    mcore = schema.mcore_sections()
    types: dict[str, Optional[str]] = {}
    for section in cfg:
        node = cfg[section]
        if not isinstance(node, DictConfig):
            types[section] = None
        elif section in mcore:
            types[section] = "mcore"
        elif OmegaConf.get_type(node) in by_class:
            types[section] = by_class[OmegaConf.get_type(node)]
        else:
            return None  # a section of no known schema: not kept
    return {"format": FORMAT, "types": types,
            "values": OmegaConf.to_container(cfg, resolve=True, enum_to_str=True)}


def _rebuild(entry: dict[str, Any]) -> DictConfig:
    """The composed config again: bridge's sections typed by their schema (enums and nested dataclasses as
    composed), megatron-core's as the plain values their schema gives (enums by member)."""
    schemas, mcore = _schemas(), schema.mcore_sections()
    nodes = {}
    for section, value in entry["values"].items():
        kind = entry["types"].get(section)
        if kind == "mcore":
            nodes[section] = _with_enums(mcore[section], value)
        elif kind is not None:
            nodes[section] = OmegaConf.merge(OmegaConf.structured(schemas[kind]), value)
        else:
            nodes[section] = value
    cfg = OmegaConf.create(nodes)
    OmegaConf.set_struct(cfg, True)
    return cfg


def _with_enums(cls: type, values: dict) -> dict:
    from bridge_cli.config.mcore_schema import _unwrap_optional, schema_fields

    out = dict(values)
    for field in schema_fields(cls):
        enum_type = _unwrap_optional(field.yaml_type)[0]
        if isinstance(enum_type, type) and issubclass(enum_type, enum.Enum) and out.get(field.name) is not None:
            out[field.name] = enum_type[out[field.name]]
    return out


def _same(rebuilt: DictConfig, cfg: DictConfig) -> bool:
    """Same values, and each of bridge's sections of the same schema."""
    if OmegaConf.to_container(rebuilt, resolve=True) != OmegaConf.to_container(cfg, resolve=True):
        return False
    mcore = schema.mcore_sections()
    return all(OmegaConf.get_type(rebuilt[s]) is OmegaConf.get_type(cfg[s]) for s in cfg
               if isinstance(cfg[s], DictConfig) and s not in mcore and dataclasses.is_dataclass(OmegaConf.get_type(cfg[s])))
