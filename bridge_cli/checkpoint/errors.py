"""The error users see when a checkpoint cannot be found, read or used."""

from __future__ import annotations


class CheckpointError(Exception):
    """A checkpoint problem: the path, what does not match, and what to do. The CLI exits with code 2."""
