"""How the CLI reports a user's mistake: one short paragraph on stderr, exit code 2."""

from __future__ import annotations

import functools
import sys
import time
from typing import Callable

import typer

USAGE_EXIT_CODE = 2
RUN_FAILED_EXIT_CODE = 1
QUIET_RANK_GRACE_S = 10.0
"""How long a rank that leaves a config error to its node's local rank 0 waits before it exits. torchrun stops every
worker once one fails, so a quiet rank that exited first had local rank 0 stopped before it printed the error: no
message at all (seen in the test suite under load). Waiting, the quiet rank is the one torchrun stops, and torchrun
names local rank 0's exit as the failure; under srun, which leaves the other tasks running, it exits after the wait."""


def user_errors() -> tuple[type[BaseException], ...]:
    """The exception types that mean 'fix your input', not 'bridge has a bug'.

    Imported lazily so that `bridge --help` does not pay for them.
    """
    from bridge_cli.checkpoint.errors import CheckpointError, FolderInUse
    from bridge_cli.config.errors import ConfigError
    from bridge_cli.runtime.errors import RuntimeUnavailable

    return (ConfigError, RuntimeUnavailable, CheckpointError, FolderInUse)


def run_failures() -> tuple[type[BaseException], ...]:
    """Failures of a valid run that need no traceback either: training diverged, a save failed, a step did
    not fit the GPU."""
    from bridge_cli.checkpoint.errors import SaveFailed
    from bridge_cli.logging.training_logger import TrainingDiverged
    from bridge_cli.runtime.errors import OutOfGPUMemory

    return (TrainingDiverged, SaveFailed, OutOfGPUMemory)


def report(err: BaseException) -> None:
    # megatron-core's module builder re-raises with " when instantiating <Module>" appended per level:
    # where in megatron-core it surfaced says nothing to the user.
    message = str(err).split(" when instantiating ", 1)[0]
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)


def says_it_once(err: BaseException) -> bool:
    """Whether this process prints ``err``: a config error is the same on every rank of a launch (the same config and
    world), so under torchrun or srun only each node's local rank 0 says it, not once per GPU; every other error is
    said by every rank that meets it."""
    from bridge_cli.config.errors import ConfigError
    from bridge_cli.runtime.launch_env import local_rank

    return not isinstance(err, ConfigError) or local_rank() == 0


def handles_user_errors(command: Callable) -> Callable:
    """A user error becomes a one-paragraph message and exit 2, a diverged run a message and exit 1;
    a traceback only with --debug, or for a bug."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except Exception as err:
            if kwargs.get("debug"):
                raise
            for kinds, code in ((user_errors(), USAGE_EXIT_CODE), (run_failures(), RUN_FAILED_EXIT_CODE)):
                if isinstance(err, kinds):
                    if says_it_once(err):
                        report(err)
                    else:  # the rank that says it exits first
                        time.sleep(QUIET_RANK_GRACE_S)
                    sys.exit(code)
            raise

    return wrapper
