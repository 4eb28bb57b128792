"""How the CLI reports a user's mistake: one short paragraph on stderr, exit code 2."""

from __future__ import annotations

import functools
import sys
from typing import Callable

import typer

USAGE_EXIT_CODE = 2


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean 'fix your input', not 'bridge has a bug'.

    Imported lazily so that `bridge --help` does not pay for them.
    """
    from bridge_cli.checkpoint.errors import CheckpointError
    from bridge_cli.config.errors import ConfigError
    from bridge_cli.runtime.errors import RuntimeUnavailable

    return (ConfigError, RuntimeUnavailable, CheckpointError)


def report(err: BaseException) -> None:
    typer.secho(f"error: {err}", fg=typer.colors.RED, err=True)


def handles_user_errors(command: Callable) -> Callable:
    """Turn a user error into a one-paragraph message and exit 2 (a traceback only with --debug)."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except Exception as err:
            if kwargs.get("debug") or not isinstance(err, user_errors()):
                raise
            report(err)
            sys.exit(USAGE_EXIT_CODE)

    return wrapper
