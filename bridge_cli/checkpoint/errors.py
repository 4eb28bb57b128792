"""The error users see when a checkpoint cannot be found, read or used."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint problem: the path, what does not match, and what to do. The CLI exits with code 2."""


class SaveFailed(Exception):
    """Writing a checkpoint failed (disk full, read-only, permissions): the folder, the cause, and which
    checkpoint still loads. The CLI exits with code 1."""


class FolderInUse(Exception):
    """Another live run holds the lock of this checkpoint.save folder. The CLI exits with code 2."""
