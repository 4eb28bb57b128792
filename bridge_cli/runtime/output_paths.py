"""Output folders are checked before any work: a run must not train for hours and then fail to save."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Optional

from bridge_cli.config.errors import ConfigError


def check_output_folders(folders: Iterable[tuple[str, Optional[str]]]) -> None:
    """Each (key, path) that is set must be a folder, or creatable as one, that this process can write."""
    for key, path in folders:
        if path is None:
            continue
        target = Path(path).expanduser()
        if target.exists() and not target.is_dir():
            raise ConfigError(key, f"{path} is a file, not a folder.", "Point it at a folder (it is created if missing).")
        existing = target
        while not existing.exists():
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(key, f"{path} cannot be created: {existing} is a file.", "Choose another folder.")
        if os.statvfs(existing).f_flag & os.ST_RDONLY:
            raise ConfigError(key, f"{path} is on a read-only file system ({existing}).",
                              "Choose a folder on a writable file system.")
        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(key, f"{path} is not writable ({existing} does not allow this user to write).",
                              "Choose a folder you can write, or fix its permissions.")


def check_output_file(key: str, path: Optional[str]) -> None:
    """A file to write (if set): not a folder, in a folder that exists or can be created, writable."""
    if path is None:
        return
    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError(key, f"{path} is a folder, not a file.", "Give the path of a file to write.")
    check_output_folders([(key, str(target.parent))])
