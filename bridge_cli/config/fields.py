"""Field helpers shared by the config dataclasses.

OmegaConf cannot type-check ``Literal`` fields, so a closed set of string values is declared with
:func:`one_of`; :func:`check_choices` enforces it after composition and names the full key.
"""

from __future__ import annotations

import dataclasses
from typing import Any


def one_of(default: Any, *allowed: Any) -> Any:
    """A dataclass field whose value must be one of ``allowed`` (``default`` is always allowed)."""
    choices = tuple(dict.fromkeys((default, *allowed)))
    return dataclasses.field(default=default, metadata={"choices": choices})


def list_field(*default: Any) -> Any:
    """A list-valued dataclass field with a fresh copy of ``default`` per instance."""
    return dataclasses.field(default_factory=lambda: list(default))


def choices_of(field: dataclasses.Field) -> tuple[Any, ...] | None:
    """The allowed values of a field declared with :func:`one_of`, else None."""
    return field.metadata.get("choices")


def check_section(section: str, obj: Any) -> None:
    """Raise ConfigError for the first value outside its allowed set or failing the section's check()."""
    from bridge_cli.config.errors import ConfigError

    for f in dataclasses.fields(obj):
        allowed = choices_of(f)
        value = getattr(obj, f.name)
        if allowed and value not in allowed:
            raise ConfigError(f"{section}.{f.name}", f"{value!r} is not allowed.",
                              f"Choose one of: {', '.join(map(str, allowed))}.")
    for name, message in getattr(obj, "check", lambda: [])():
        raise ConfigError(f"{section}.{name}", message)
