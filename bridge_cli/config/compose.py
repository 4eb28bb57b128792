"""Compose one run's config with Hydra: group defaults < recipe < command-line overrides.

Uses Hydra's compose API (no ``@hydra.main``, no change of working directory). The chosen recipe
joins the ``recipe`` config group of ``conf/config.yaml`` through a temporary search-path root
that holds only that file, so a shipped name, a ``--recipes-dir`` entry and a path all compose
the same way. Every Hydra/OmegaConf failure becomes a ConfigError naming the full key or file.
The defaults list's composition is kept per process (about 0.25 s; the value overrides on a copy
of it, 0.05 s), and a launch's whole result across launches (``compose_cache``).
"""

from __future__ import annotations

import functools
import io
import pickle
import re
import tempfile
from pathlib import Path
from typing import Callable

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from bridge_cli.config import recipes, schema
from bridge_cli.config.errors import ConfigError, did_you_mean

PRECEDENCE = "config groups (conf/) < recipe < command-line overrides"


# A recipe is a page of settings: these limits refuse, in milliseconds, a file that would take OmegaConf
# minutes or all memory to copy (a "billion laughs" of nested aliases expands exponentially).
MAX_RECIPE_BYTES = 1 << 20
MAX_RECIPE_NODES = 100_000


def _read_recipe(path: Path, label: str) -> str:
    """The recipe file's text, once it is known to be a page of settings."""
    try:
        if path.stat().st_size > MAX_RECIPE_BYTES:
            raise ConfigError(None, f"{label}: {path.stat().st_size} bytes, more than a recipe may hold "
                              f"({MAX_RECIPE_BYTES}).", "A recipe holds settings, not data; point to data by path.")
        text = path.read_text()
        content = yaml.safe_load(text)
        nodes = _expanded_size(content, {}, set())
        if nodes > MAX_RECIPE_NODES:
            raise ConfigError(None, f"{label}: its anchors and aliases expand to {nodes} values, more than a recipe "
                              f"may hold ({MAX_RECIPE_NODES}).", "Write the settings out instead of nesting aliases.")
        if not content:  # it would train the conf/ defaults' model of zero layers
            raise ConfigError("recipe", f"{label} is empty: it sets no model, data or training settings.",
                              "Start from a shipped recipe: bridge recipes cp tiny my.yaml (bridge recipes list "
                              "shows them).")
        return text
    except RecursionError:
        raise ConfigError(None, f"{label}: nested too deeply to load.", "Flatten the file.") from None
    except ValueError as err:
        raise ConfigError(None, f"{label}: {err}.", "Remove the recursive alias.") from None
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark
        where = f"{label}:{mark.line + 1}" if mark else label
        raise ConfigError(None, f"{where}: malformed YAML: {err.problem}.", "Fix the file and run again.") from None
    except OSError as err:
        raise ConfigError(None, f"{label}: cannot read ({err.strerror}).") from None


def _expanded_size(node, sizes: dict[int, int], open_nodes: set[int]) -> int:
    """How many values ``node`` becomes once every alias is copied out (shared nodes counted once per use,
    computed once per node), stopping early past the limit."""
    if not isinstance(node, (dict, list)):
        return 1
    if id(node) in sizes:
        return sizes[id(node)]
    if id(node) in open_nodes:
        raise ValueError("an alias refers to the node that holds it")
    open_nodes.add(id(node))
    total = 1
    for child in (list(node.keys()) + list(node.values())) if isinstance(node, dict) else node:
        total += _expanded_size(child, sizes, open_nodes)
        if total > MAX_RECIPE_NODES:
            break
    open_nodes.discard(id(node))
    sizes[id(node)] = total
    return total


def _unknown_key(key: str, source: str = "") -> ConfigError:
    """An unknown-key error that names what replaced a renamed key, else suggests the same name in another
    section, else close names."""
    if key in schema.RENAMED:
        return ConfigError(key, f"unknown key{source}: it was replaced.", f"Use {schema.RENAMED[key]}.")
    keys = schema.all_keys()
    leaf = key.rsplit(".", 1)[-1]
    same_leaf = [k for k in keys if k.rsplit(".", 1)[-1] == leaf]
    hint = ("Did you mean " + " or ".join(same_leaf[:3]) + "?") if same_leaf else did_you_mean(key, keys)
    return ConfigError(key, f"unknown key{source}.", hint or "See `bridge pretrain recipe=NAME --dry-run` for every key.")


def _reject_unknown_keys(cfg: DictConfig) -> None:
    """Hydra's '+key=value' bypasses the schema's struct flag; catch what it added."""
    import dataclasses

    for section in cfg:
        node = cfg[section]
        if section not in schema.root_fields():
            raise _unknown_key(str(section))
        node_type = OmegaConf.get_type(node) if isinstance(node, DictConfig) else None
        if node_type is not None and dataclasses.is_dataclass(node_type):
            known = {f.name for f in dataclasses.fields(node_type)}
            for key in node:
                if key not in known:
                    raise _unknown_key(f"{section}.{key}")


def _from_omegaconf(err: OmegaConfBaseException, source: str) -> ConfigError:
    key = getattr(err, "full_key", None) or None
    if isinstance(err, (ConfigAttributeError, ConfigKeyError)) and key:
        return _unknown_key(key, source)
    if isinstance(err, ValidationError) and key:
        message = str(err).splitlines()[0].rstrip(".")
        return ConfigError(key, f"{message}{source}.")
    return ConfigError(key, str(err).splitlines()[0] + source)


def _translate(err: Exception, recipe: recipes.Recipe | None) -> ConfigError:
    """Hydra's exception (and the OmegaConf error beneath it) as one ConfigError."""
    from hydra.errors import MissingConfigException, OverrideParseException

    text = str(err)
    if isinstance(err, OverrideParseException):
        return ConfigError(None, f"cannot parse override {err.override!r}.",
                           "Write overrides as key=value, e.g. train.train_iters=100.")
    if isinstance(err, MissingConfigException):
        group = re.search(r"Could not find '([^/']+)/([^']*)'", text)
        options = re.findall(r"^\t(\S+)$", text, flags=re.M)
        if group:
            name, option = group.groups()
            hint = did_you_mean(option, options) or (f"Options: {', '.join(options)}." if options else None)
            return ConfigError(name, f"no config group option {option!r}.", hint)
        return ConfigError(None, text.splitlines()[0])
    ambiguous = re.search(r"Ambiguous value for argument '([^=']+)=([^']*)'", text)
    if ambiguous:
        key, value = ambiguous.groups()
        return ConfigError(key, f"{value} reads as a list of runs (a Hydra sweep).",
                           f"Quote a value that contains commas: \"{key}='{value}'\".")
    appended = re.search(r"An item is already at '([^']+)'", text)
    if appended:
        key = appended.group(1)
        return ConfigError(key, "already exists in the schema, so '+' cannot add it.", f"Drop the '+': {key}=VALUE.")
    source = ""
    if recipe is not None and "recipe/" in text and "override" not in text.split("\n")[0].lower():
        source = f" in recipe {recipe.path}"
    cause = err
    while cause is not None and not isinstance(cause, OmegaConfBaseException):
        cause = cause.__cause__ or cause.__context__
    if cause is None:
        return ConfigError(None, text.splitlines()[0])
    return _from_omegaconf(cause, source)


GLOBAL_PACKAGE = "# @package _global_"


def _staged_text(recipe: recipes.Recipe, text: str) -> str:
    """The recipe's ``text`` as Hydra gets it, a global config: a user's file needs no header line."""
    header = re.search(r"^#\s*@package\s+(\S+)", text, flags=re.M)
    if header is None:
        return f"{GLOBAL_PACKAGE}\n{text}"
    if header.group(1) != "_global_":
        raise ConfigError("recipe", f"{recipe.path} declares '# @package {header.group(1)}', so its keys would not "
                          "land at the top level.", f"Delete that line (or write '{GLOBAL_PACKAGE}').")
    return text


def compose(recipe_name: str | None, overrides: list[str], recipes_dirs: list[Path] | None = None,
            beneath: Callable[[DictConfig], list[str]] | None = None, keep: bool = False) -> DictConfig:
    """The composed, schema-checked and resolved config of one run.

    Hydra composes the defaults list (the group options, the recipe) and applies the value overrides
    (``section.key=value``) after it, with the same function; the first part is kept per recipe text
    and group overrides, so a process that composes again (the Python API, the tests) pays only the second.

    ``beneath`` is a layer of value overrides between the recipe and ``overrides`` that depends on the
    composed config (a Hugging Face folder's config.json, :mod:`bridge_cli.cli.config_loading`): it is given the
    config of the recipe and ``overrides`` and returns the layer's overrides, under which ``overrides`` are
    applied again to the defaults; the recipe is read and the defaults list composed once either way.

    ``keep`` (a launch of the CLI) reads the result from, and writes it to, the cache of composed configs
    (:mod:`bridge_cli.config.compose_cache`) where the result depends on nothing but the recipe, conf/, the
    overrides and the schema; with ``beneath``'s layer it is composed.
    """
    from bridge_cli.config import compose_cache

    recipe = recipes.find(recipe_name, recipes_dirs) if recipe_name else None
    name, text = None, None
    if recipe is not None:
        name, text = recipe.name, _staged_text(recipe, _read_recipe(recipe.path, str(recipe.path)))
    cache_key = compose_cache.key(name, text, overrides) if keep else None
    cfg = compose_cache.load(cache_key) if cache_key else None
    if cfg is None:
        defaults, values = _defaults_and_values(recipe, name, text, overrides)
        cfg = _with_values(defaults, values, recipe, overrides)
        if cache_key:
            compose_cache.store(cache_key, cfg)
    layer = beneath(cfg) if beneath is not None else []
    if layer:
        defaults, values = _defaults_and_values(recipe, name, text, overrides)
        cfg = _with_values(defaults, [*_split(layer)[1], *values], recipe, [*layer, *overrides])
    return cfg


def _defaults_and_values(recipe: recipes.Recipe | None, name: str | None, text: str | None,
                         overrides: list[str]) -> tuple[_Frozen, list]:
    """Hydra's composition of the defaults list (kept per process) and the parsed value overrides."""
    from hydra.errors import HydraException

    schema.register()
    try:
        groups, values = _split(overrides)
        return _compose_defaults(name, text, groups), values
    except (HydraException, OmegaConfBaseException) as err:
        raise _translate(err, recipe) from err


def _with_values(defaults: _Frozen, values: list, recipe: recipes.Recipe | None, overrides: list[str]) -> DictConfig:
    """A copy of the composed ``defaults`` with the parsed value overrides applied, checked for unknown keys, resolved."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl  # Hydra 1.3 (pinned): what its compose calls
    from hydra.errors import HydraException

    try:
        cfg = defaults.thaw()
        ConfigLoaderImpl._apply_overrides_to_config(values, cfg)
    except (HydraException, OmegaConfBaseException) as err:
        raise _translate(err, recipe) from err
    _reject_unknown_keys(cfg)
    try:
        OmegaConf.resolve(cfg)
    except OmegaConfBaseException as err:
        raise _interpolation_error(cfg, err, recipe, overrides) from err
    return cfg


def _split(overrides: list[str]) -> tuple[tuple[str, ...], list]:
    """The overrides that shape the defaults list (group options, Hydra's own keys: no dot, or
    ``hydra...``), as written, and the parsed value overrides, checked as Hydra checks them first."""
    from hydra._internal.config_loader_impl import ConfigLoaderImpl
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.types import RunMode

    parsed = OverridesParser.create().parse_overrides(overrides)
    ConfigLoaderImpl.validate_sweep_overrides_legal(parsed, RunMode.RUN, from_shell=False)
    groups, values = [], []
    for override in parsed:
        is_value = override.package is None and "." in override.key_or_group and not override.is_hydra_override()
        (values if is_value else groups).append(override)
    return tuple(_group_line(o) for o in groups), values


def _group_line(override) -> str:
    """The override as Hydra takes it; ``GROUP=null`` (``peft=null``: no adapters) is Hydra's ``~GROUP``, which
    Hydra spells differently and would otherwise stop with a traceback."""
    plain = override.package is None and not override.is_hydra_override() and not override.is_delete()
    if plain and not override.is_add() and override.value() is None:
        return f"~{override.key_or_group}"
    return override.input_line


class _Frozen:
    """A composed config kept as pickled bytes (57-61 KB): no caller can edit the kept one, and each gets its own
    copy from :meth:`thaw` in 3-4 ms, where copy.deepcopy took 23-113 ms in the same process (``tiny``, ``deepseek_v3``,
    2 busy cores). Classes are kept by reference, not by name: the schema's root class is made at run time."""

    def __init__(self, cfg: DictConfig):
        buffer, self._classes = io.BytesIO(), []
        index: dict[int, int] = {}
        pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)

        def persistent_id(obj):
            if not isinstance(obj, type):
                return None
            if id(obj) not in index:
                index[id(obj)] = len(self._classes)
                self._classes.append(obj)
            return index[id(obj)]

        pickler.persistent_id = persistent_id
        pickler.dump(cfg)
        self._bytes = buffer.getvalue()

    def thaw(self) -> DictConfig:
        unpickler = pickle.Unpickler(io.BytesIO(self._bytes))
        unpickler.persistent_load = self._classes.__getitem__
        return unpickler.load()


# Every distinct composition of a process (a fast-tier worker makes up to 41), at about 60 KB each (15 MB at most):
# 16 made the fast tier compose again some 14 it had evicted, 0.2 s each.
@functools.lru_cache(maxsize=256)
def _compose_defaults(recipe_name: str | None, recipe_text: str | None, groups: tuple[str, ...]) -> _Frozen:
    """Hydra's composition of the defaults list; the recipe joins the ``recipe`` group from a temporary
    search-path root that holds only its text. Kept frozen: callers thaw their own copy."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    with tempfile.TemporaryDirectory(prefix="bridge-recipe-") as root:
        hydra_overrides = list(groups)
        if recipe_name is not None:
            (Path(root) / "recipe").mkdir()
            (Path(root) / "recipe" / f"{recipe_name}.yaml").write_text(recipe_text)
            hydra_overrides = [f"hydra.searchpath=[file://{root}]", f"recipe={recipe_name}", *groups]
        with initialize_config_dir(config_dir=str(recipes.conf_dir()), version_base=None):
            return _Frozen(hydra_compose("config", overrides=hydra_overrides))


def _interpolation_error(cfg: DictConfig, err: OmegaConfBaseException, recipe: recipes.Recipe | None,
                         overrides: list[str]) -> ConfigError:
    """OmegaConf.resolve does not say which key failed: find the first value that does not resolve, and
    where it was written (the command line, else the recipe, else conf/)."""
    key = _unresolvable_key(cfg)
    if key is None:
        return _from_omegaconf(err, "")
    from_command_line = any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides)
    source = (" (set on the command line)" if from_command_line
              else f" (set in recipe {recipe.path})" if recipe is not None else "")
    cause = str(err).splitlines()[0].replace("KeyError raised while resolving interpolation: ", "")
    raw = _raw_value(cfg, key)
    hint = ("Set the variable, or give a default: ${oc.env:NAME,DEFAULT}." if "oc.env" in raw
            else "Refer to a key that exists, as ${section.key}.")
    return ConfigError(key, f"cannot resolve {raw}{source}: {cause}.", hint)


def _unresolvable_key(node, prefix: str = "") -> str | None:
    for name in node:
        key = f"{prefix}{name}"
        if OmegaConf.is_interpolation(node, name):
            try:
                node[name]
            except OmegaConfBaseException:
                return key
        elif isinstance(node[name], DictConfig):
            found = _unresolvable_key(node[name], key + ".")
            if found:
                return found
    return None


def _raw_value(cfg: DictConfig, key: str) -> str:
    parent, _, leaf = key.rpartition(".")
    node = OmegaConf.select(cfg, parent) if parent else cfg
    return str(node._get_node(leaf)._value())
