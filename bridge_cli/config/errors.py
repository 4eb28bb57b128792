"""The one error type users see for bad configuration, with its did-you-mean helper."""

from __future__ import annotations

import difflib
from typing import Iterable


class ConfigError(Exception):
    """A configuration problem: what is wrong, the full key or path, and how to fix it.

    The CLI prints it as one short paragraph and exits with code 2.
    """

    def __init__(self, key: str | None, message: str, hint: str | None = None):
        self.key = key
        self.message = message
        self.hint = hint
        super().__init__(str(self))

    def __str__(self) -> str:
        where = f"{self.key}: " if self.key else ""
        return f"{where}{self.message}" + (f" {self.hint}" if self.hint else "")


def did_you_mean(word: str, candidates: Iterable[str], n: int = 3) -> str | None:
    """'did you mean a, b?' for the closest candidates, or None when none is close."""
    close = difflib.get_close_matches(word, list(candidates), n=n, cutoff=0.6)
    if not close:
        return None
    return "Did you mean " + " or ".join(close) + "?"
