"""YAML schemas derived from megatron-core's own config dataclasses, and the way back.

The model, optimizer and ddp sections are megatron-core's ``TransformerConfig`` (through
``GPTModelProvider``), ``OptimizerConfig`` (through ``bridge_cli.runtime.optimizer_config``) and
``DistributedDataParallelConfig``. Their schema is read from the installed megatron-core, so
every field of a type YAML can hold is settable by its megatron-core name, and a field this
megatron-core lacks is an unknown-key error, not a silent drop.
torch dtypes and activation functions are spelled by name in YAML and resolved here.
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import inspect
import re
import textwrap
import types
import typing
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from bridge_cli.config.errors import ConfigError

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

_PRIMITIVES = (bool, int, float, str)


def _activations() -> dict[str, Callable]:
    from megatron.core import activations

    named = {"gelu": F.gelu, "silu": F.silu, "relu": F.relu, "tanh": torch.tanh}
    for name in ("squared_relu", "quick_gelu", "fast_gelu"):
        if hasattr(activations, name):
            named[name] = getattr(activations, name)
    return named


@dataclasses.dataclass(frozen=True)
class _Converter:
    """How one non-YAML field type is spelled in YAML: a name table."""

    names: Callable[[], dict[str, Any]]

    def to_name(self, value: Any) -> Optional[str]:
        if value is None:
            return None
        for name, obj in self.names().items():
            if obj is value:
                return name
        return None

    def from_name(self, key: str, name: Optional[str]) -> Any:
        if name is None:
            return None
        table = self.names()
        if name not in table:
            raise ConfigError(key, f"unknown value {name!r}.", f"Allowed: {', '.join(table)}.")
        return table[name]


_DTYPE = _Converter(lambda: DTYPES)
_ACTIVATION = _Converter(_activations)


@dataclasses.dataclass(frozen=True)
class _ScalarOrList:
    """A field megatron-core types as ``Union[T, List[T]]`` (e.g. ``moe_layer_freq``: every k-th
    layer, or one 0/1 per layer): YAML holds either; OmegaConf cannot type that union, so the
    schema says Any and this checks the value."""

    item: type

    def to_name(self, value: Any) -> Any:
        return list(value) if isinstance(value, (list, tuple)) else value

    def from_name(self, key: str, value: Any) -> Any:
        if value is None:
            return None
        items = value if isinstance(value, list) else [value]
        if not all(self._fits(v) for v in items):
            raise ConfigError(key, f"{value!r} is neither one {self.item.__name__} nor a list of them.",
                              f"Write e.g. {key}=VALUE or {key}=[VALUE,VALUE,...] (one per layer).")
        cast = [self.item(v) for v in items]
        return cast if isinstance(value, list) else cast[0]

    def _fits(self, value: Any) -> bool:
        if isinstance(value, bool):
            return self.item is bool
        if self.item is float:
            return isinstance(value, (int, float))
        return isinstance(value, self.item)


def _unwrap_optional(tp: Any) -> tuple[Any, bool]:
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else typing.Union[rest]), True
    return tp, False


def _scalar_or_list_item(tp: Any) -> Optional[type]:
    """T when ``tp`` is ``Union[T, List[T]]`` with T a YAML primitive, else None."""
    if typing.get_origin(tp) not in (typing.Union, types.UnionType):
        return None
    args = typing.get_args(tp)
    scalars = [a for a in args if a in _PRIMITIVES]
    lists = [typing.get_args(a) for a in args if typing.get_origin(a) in (list, typing.List)]
    if len(args) == 2 and len(scalars) == 1 and lists == [(scalars[0],)]:
        return scalars[0]
    return None


@dataclasses.dataclass(frozen=True)
class SchemaField:
    """One settable field: its YAML type, default, allowed values, and converter if any."""

    name: str
    yaml_type: Any
    default: Any
    choices: Optional[tuple] = None
    converter: Optional[_Converter] = None
    as_tuple: bool = False
    """A YAML list that megatron-core takes as a tuple (e.g. window_size)."""


def _schema_field(f: dataclasses.Field, tp: Any) -> Optional[SchemaField]:
    """Map one megatron-core field to its YAML form, or None when YAML cannot hold it."""
    if not f.init:
        return None
    if f.default is not dataclasses.MISSING:
        default = f.default
    elif f.default_factory is not dataclasses.MISSING:
        default = f.default_factory()
    else:
        default = None
    inner, optional = _unwrap_optional(tp)
    wrap = (lambda t: Optional[t]) if optional or default is None else (lambda t: t)
    if inner in _PRIMITIVES:
        return SchemaField(f.name, wrap(inner), default)
    if typing.get_origin(inner) is typing.Literal:
        values = typing.get_args(inner)
        if all(isinstance(v, str) for v in values):
            return SchemaField(f.name, wrap(str), default, choices=values)
    if inspect.isclass(inner) and issubclass(inner, enum.Enum):
        return SchemaField(f.name, wrap(inner), default)
    if inner is torch.dtype:
        return SchemaField(f.name, Optional[str], _DTYPE.to_name(default), tuple(DTYPES), _DTYPE)
    if f.name == "activation_func":
        return SchemaField(f.name, str, _ACTIVATION.to_name(default), None, _ACTIVATION)
    if typing.get_origin(inner) in (list, typing.List):
        (item,) = typing.get_args(inner) or (None,)
        if item in _PRIMITIVES and (default is None or isinstance(default, list)):
            return SchemaField(f.name, wrap(typing.List[item]), default)
    if typing.get_origin(inner) is tuple:  # e.g. window_size: Tuple[int, int]
        items = set(typing.get_args(inner)) - {Ellipsis}
        if len(items) == 1 and items <= set(_PRIMITIVES):
            return SchemaField(f.name, wrap(typing.List[items.pop()]), None if default is None else list(default),
                               as_tuple=True)
    item = _scalar_or_list_item(inner)
    # Only the fields of this shape that bridge's layer specs build (the MoE layout and losses, the
    # sliding-window pattern); the others (no_rope_freq, linear_attention_freq, ...) stay unknown keys.
    if item is not None and (f.name.startswith("moe_") or f.name == "window_attn_skip_freq"):
        return SchemaField(f.name, Any, default, converter=_ScalarOrList(item))
    return None


@functools.lru_cache(maxsize=None)
def schema_fields(cls: type) -> tuple[SchemaField, ...]:
    """The fields of a megatron-core config dataclass that YAML can set."""
    hints = typing.get_type_hints(cls)
    found = (_schema_field(f, hints[f.name]) for f in dataclasses.fields(cls))
    return tuple(f for f in found if f is not None)


@functools.lru_cache(maxsize=None)
def schema_dataclass(cls: type) -> type:
    """A plain dataclass (OmegaConf structured-config schema) mirroring ``cls``'s YAML fields."""
    specs = []
    for f in schema_fields(cls):
        default = f.default
        if isinstance(default, list):
            value = dataclasses.field(default_factory=functools.partial(list, default))
        else:
            value = dataclasses.field(default=default)
        specs.append((f.name, f.yaml_type, value))
    return dataclasses.make_dataclass(cls.__name__, specs)


def check_choices(section: str, cls: type, values: dict) -> None:
    """Raise ConfigError for a value outside a field's allowed set (megatron-core Literals)."""
    for f in schema_fields(cls):
        value = values.get(f.name)
        if f.choices and value is not None and value not in f.choices:
            raise ConfigError(f"{section}.{f.name}", f"{value!r} is not allowed.",
                              f"Choose one of: {', '.join(map(str, f.choices))}.")


def build(section: str, cls: type, values: dict) -> Any:
    """Instantiate the megatron-core config ``cls`` from YAML ``values`` (names resolved).

    megatron-core validates in ``__post_init__`` with asserts and ValueErrors; those become a
    ConfigError naming the section.
    """
    from bridge_cli.config.ranges import check_values

    check_choices(section, cls, values)
    check_values(section, values)
    _check_kernel_packages(section, values)
    kwargs = dict(values)
    for f in schema_fields(cls):
        if f.converter is not None and f.name in kwargs:
            kwargs[f.name] = f.converter.from_name(f"{section}.{f.name}", kwargs[f.name])
        elif f.as_tuple and kwargs.get(f.name) is not None:
            kwargs[f.name] = tuple(kwargs[f.name])
    try:
        return cls(**kwargs)
    except ImportError as err:  # e.g. model.moe_permute_fusion=true without Transformer Engine
        raise ConfigError(section, f"an option of this {cls.__name__} needs a package that does not import "
                          f"here ({err}).", "Turn off the fused-kernel option you set, or install the package.") from err
    except (AssertionError, ValueError, TypeError) as err:
        named = fields_named_in(str(err), cls)
        key = f"{section}.{named[0]}" if named else section
        hint = f"Check {', '.join(f'{section}.{n}' for n in named)}." if named else None
        raise ConfigError(key, f"megatron-core rejected this {cls.__name__}: {err or 'assertion failed'}", hint) from err


KERNEL_PACKAGES = {"moe_router_fusion": "transformer_engine", "moe_permute_fusion": "transformer_engine"}
"""Fused-kernel switches and the package their kernel comes from. megatron-core refuses them while
building its config without naming the switch (an ImportError in 0.16, a ValueError in 0.19)."""


def _check_kernel_packages(section: str, values: dict) -> None:
    import importlib.util

    for field, package in KERNEL_PACKAGES.items():
        if values.get(field) and importlib.util.find_spec(package) is None:
            raise ConfigError(f"{section}.{field}", f"is a Transformer Engine kernel, and {package} does not import "
                              "here.", f"Set {section}.{field}=false.")


def fields_named_in(message: str, cls: type) -> list[str]:
    """The YAML fields of ``cls`` that ``message`` mentions (as ``name`` or ``--name-with-dashes``),
    in the order it mentions them."""
    text = message.replace("-", "_")
    found = []
    for f in schema_fields(cls):
        match = re.search(rf"(?<![A-Za-z0-9_]){re.escape(f.name)}(?![A-Za-z0-9_])", text)
        if match is None:
            match = re.search(rf"__{re.escape(f.name)}(?![A-Za-z0-9_])", text)
        if match is not None:
            found.append((match.start(), f.name))
    return [name for _, name in sorted(found)]


def to_yaml_values(section: str, cls: type, obj: Any) -> dict:
    """The YAML-settable fields of a megatron-core config object, names for dtypes and functions."""
    out = {}
    for f in schema_fields(cls):
        value = getattr(obj, f.name)
        out[f.name] = f.converter.to_name(value) if f.converter else list(value) if isinstance(value, tuple) else value
    return out


@functools.lru_cache(maxsize=None)
def field_docs(cls: type) -> dict[str, str]:
    """First line of each field's attribute docstring, read from the source of ``cls`` and its bases."""
    docs: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError):
            continue
        body = tree.body[0].body
        for node, nxt in zip(body, body[1:]):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant)
                    and isinstance(nxt.value.value, str)):
                docs[node.target.id] = " ".join(nxt.value.value.strip().split("\n")[0].split())
    return docs
