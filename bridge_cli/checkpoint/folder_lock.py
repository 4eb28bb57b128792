"""One run at a time per checkpoint.save folder: a lock file naming its holder.

Two runs saving into one folder would replace each other's checkpoints. The lock is
``<save>/.bridge.lock`` holding ``host pid``, created exclusively by rank 0 when the run starts and
removed when it ends. A lock whose holder is gone (same host, process not alive) is stale and taken
over, saying so; a live holder, or one on another host, makes the second run stop with both named.
"""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Optional

from bridge_cli.checkpoint.errors import FolderInUse

LOCK = ".bridge.lock"


def acquire(folder: Path) -> list[str]:
    """Take the lock of ``folder`` (created if missing) for this process; returns lines to tell the user."""
    folder.mkdir(parents=True, exist_ok=True)
    lock, me = folder / LOCK, f"{socket.gethostname()} {os.getpid()}"
    notes = []
    for _ in range(2):
        try:
            fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            holder = _holder(lock)
            if holder == (socket.gethostname(), os.getpid()):
                return notes  # this process holds it already (an earlier run of the same Python session)
            if holder is not None and not _is_stale(holder):
                host, pid = holder
                raise FolderInUse(
                    f"checkpoint.save={folder}: another run (pid {pid} on {host}) is saving there; two runs would "
                    f"replace each other's checkpoints. Give this run its own checkpoint.save, or, if that run is "
                    f"gone, delete {lock}.")
            notes.append(f"taking over {lock} from a run that is gone ({' '.join(map(str, holder or ('?',)))}).")
            lock.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(me + "\n")
        return notes
    raise FolderInUse(f"checkpoint.save={folder}: could not take {lock}; another run is starting there.")


def release(folder: Path) -> None:
    """Remove the lock when this process holds it."""
    lock = folder / LOCK
    if _holder(lock) == (socket.gethostname(), os.getpid()):
        lock.unlink(missing_ok=True)


def _holder(lock: Path) -> Optional[tuple[str, int]]:
    try:
        host, pid = lock.read_text().split()
        return host, int(pid)
    except (OSError, ValueError):
        return None


def _is_stale(holder: tuple[str, int]) -> bool:
    host, pid = holder
    if host != socket.gethostname():
        return False  # cannot tell from here
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
