"""Per-communicator NCCL settings for megatron-core's process groups: ``dist.nccl_communicator_config_path`` and
``dist.high_priority_stream_groups``, which megatron-core applies as it creates each group (``get_nccl_options``).

The YAML file maps a group's name to its settings::

    dp_cp: {max_ctas: 8, is_high_priority_stream: true}
    ep: {is_high_priority_stream: true}

``cga_cluster_size``, ``max_ctas`` and ``min_ctas`` (the CTAs, and so the SMs, NCCL's kernels of that group may take),
``net_name`` (``IB`` or ``socket``) and ``is_high_priority_stream`` (the group's collectives start ahead of compute
queued on normal streams). ``high_priority_stream_groups`` sets the last for each named group. A group megatron-core
does not create under that name would take nothing, silently: the names are checked against the ones the installed
megatron-core passes to ``get_nccl_options`` (``dp_cp`` carries the distributed optimizer's and FSDP's reduce-scatters
and all-gathers, ``tp`` tensor parallelism's, ``pp`` the pipeline's sends, ``ep`` the experts' token exchange), and so
are the settings' names and types. NCCL only: on the CPU both fields are refused (runtime/device_rules.py).
"""

from __future__ import annotations

import functools
import inspect
import re
from pathlib import Path
from typing import Any, Optional

from bridge_cli.config.errors import ConfigError, did_you_mean

SETTINGS: dict[str, type] = {"cga_cluster_size": int, "max_ctas": int, "min_ctas": int, "net_name": str,
                             "is_high_priority_stream": bool}
"""What megatron-core reads from a group's entry, and the type each must have."""
NET_NAMES = ("ib", "socket")
KEY = "dist.nccl_communicator_config_path"
FIX = f"Fix the file, or set {KEY}=null."


@functools.cache
def group_names() -> tuple[str, ...]:
    """The names the installed megatron-core creates its process groups under (``get_nccl_options("name", ...)``)."""
    from megatron.core import parallel_state

    return tuple(sorted(set(re.findall(r"get_nccl_options\(\s*['\"](\w+)['\"]", inspect.getsource(parallel_state)))))


def check_nccl_groups(dist) -> None:
    """Raise ConfigError for a settings file or group name megatron-core would not apply as written."""
    for name in dist.high_priority_stream_groups or ():
        _check_group("dist.high_priority_stream_groups", name)
    if dist.nccl_communicator_config_path is not None:
        read_settings(dist.nccl_communicator_config_path)


def read_settings(path: str) -> dict[str, dict[str, Any]]:
    """The checked contents of a ``dist.nccl_communicator_config_path`` file."""
    import yaml

    file = Path(path)
    if not file.is_file():
        raise ConfigError(KEY, f"{path} is not a file.", f"Point it at a YAML file, or set {KEY}=null.")
    try:
        settings = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(KEY, f"{path} is not YAML ({str(err).splitlines()[0]}).", FIX) from err
    if not isinstance(settings, dict):
        raise ConfigError(KEY, f"{path} holds no mapping of process-group names to NCCL settings.", FIX)
    for group, entry in settings.items():
        _check_group(f"{KEY} ({path})", group)
        if not isinstance(entry, dict):
            raise ConfigError(KEY, f"{path}: {group} maps to {entry!r}, not to settings.", FIX)
        for name, value in entry.items():
            _check_setting(path, group, name, value)
    return settings


def _check_group(key: str, name: Any) -> None:
    if name not in group_names():
        hint = did_you_mean(str(name), group_names()) or f"megatron-core's groups: {', '.join(group_names())}."
        raise ConfigError(key, f"{name!r} names no process group megatron-core creates.", hint)


def _check_setting(path: str, group: str, name: Any, value: Any) -> None:
    expected: Optional[type] = SETTINGS.get(name)
    if expected is None:
        raise ConfigError(KEY, f"{path}: {group}.{name} is no NCCL setting megatron-core applies "
                               f"({', '.join(SETTINGS)}).", did_you_mean(str(name), SETTINGS) or FIX)
    if type(value) is not expected:  # a bool is no count, nor a count a bool
        raise ConfigError(KEY, f"{path}: {group}.{name} is {value!r}, not a{'n' if expected is int else ''} "
                               f"{expected.__name__}.", FIX)
    if expected is int and value < 1:
        raise ConfigError(KEY, f"{path}: {group}.{name} is {value}; it must be at least 1.", FIX)
    if name == "net_name" and value.lower() not in NET_NAMES:
        raise ConfigError(KEY, f"{path}: {group}.net_name is {value!r}; megatron-core takes IB or socket.", FIX)
