"""Where checkpoints live on disk, and how a save becomes visible to readers all at once.

The layout is Megatron-LM's, so checkpoints move between the tools::

    <root>/latest_checkpointed_iteration.txt     the tracker: the iteration to resume from
    <root>/iter_0000100/                         one complete torch_dist checkpoint
    <root>/iter_0000200.incomplete/              a save in progress (or one a crash interrupted)

A save writes into ``iter_XXXXXXX.incomplete``, renames it to ``iter_XXXXXXX`` once every rank
has finished, and only then replaces the tracker (write a temporary file, ``os.replace``). A
reader therefore never sees a half-written ``iter_*`` folder: a kill at any point leaves the
previous checkpoint as the one the tracker names. Everything here is plain filesystem work,
done by one rank; the callers own the barriers.
"""

from __future__ import annotations

import os
import re
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from bridge_cli.checkpoint.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
INCOMPLETE = ".incomplete"
RELEASE = "release"
_ITER = re.compile(r"^iter_(\d{7,})$")
_FINISHED = "metadata.json"  # megatron-core writes it after every shard
_FOREIGN_SUFFIXES = {".distcp", ".safetensors", ".bin", ".pt", ".pth", ".json"}


def iter_name(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def checkpoint_dir(root: Path, iteration: int) -> Path:
    return Path(root) / iter_name(iteration)


def incomplete_dir(root: Path, iteration: int) -> Path:
    return Path(root) / (iter_name(iteration) + INCOMPLETE)


def is_complete(path: Path) -> bool:
    """Whether ``path`` holds the file a finished torch_dist save writes last."""
    return (Path(path) / _FINISHED).is_file()


def complete_iterations(root: Path) -> list[int]:
    """Iterations with an ``iter_*`` folder under ``root``, ascending."""
    if not Path(root).is_dir():
        return []
    found = (_ITER.match(p.name) for p in Path(root).iterdir() if p.is_dir())
    return sorted(int(m.group(1)) for m in found if m)


def incomplete_dirs(root: Path) -> list[Path]:
    """Folders a save started and never published (a crash or kill mid-save)."""
    if not Path(root).is_dir():
        return []
    return sorted(p for p in Path(root).iterdir() if p.is_dir() and p.name.endswith(INCOMPLETE))


def read_tracker(root: Path) -> Optional[str]:
    """The tracker's content (an iteration number or 'release'), or None when there is no tracker."""
    tracker = Path(root) / TRACKER
    if not tracker.is_file():
        return None
    text = tracker.read_bytes().decode("utf-8", errors="replace").strip()
    if text != RELEASE and not text.isdigit():
        raise CheckpointError(f"{tracker}: expected an iteration number or 'release', found {text[:40]!r}. "
                              "Fix or delete the file (the newest iter_* folder is then used).")
    return text


def write_tracker(root: Path, iteration: int) -> None:
    """Point the tracker at ``iteration``; readers see the old or the new content, never a mix."""
    tracker = Path(root) / TRACKER
    tmp = tracker.with_name(f"{TRACKER}.tmp{os.getpid()}")
    with open(tmp, "w") as f:
        f.write(str(iteration))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, tracker)


def start(root: Path, iteration: int) -> Path:
    """An empty ``.incomplete`` folder for ``iteration``'s save (a leftover of a crashed one is cleared)."""
    path = incomplete_dir(root, iteration)
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    return path


def publish(root: Path, iteration: int) -> Path:
    """Rename the finished ``.incomplete`` folder into place, then move the tracker to it."""
    final = checkpoint_dir(root, iteration)
    if final.exists():  # saved before, e.g. by a run that resumed from an older checkpoint
        replaced = final.with_name(final.name + ".replaced")
        shutil.rmtree(replaced, ignore_errors=True)
        final.rename(replaced)
        incomplete_dir(root, iteration).rename(final)
        shutil.rmtree(replaced)
    else:
        incomplete_dir(root, iteration).rename(final)
    write_tracker(root, iteration)
    return final


def prune(root: Path, keep: int, protect: int) -> list[Path]:
    """Delete all but the ``keep`` newest ``iter_*`` folders (``protect`` always stays)."""
    if keep < 1:
        return []
    iterations = complete_iterations(root)
    doomed = [i for i in iterations[:-keep] if i != protect]
    for iteration in doomed:
        shutil.rmtree(checkpoint_dir(root, iteration))
    return [checkpoint_dir(root, i) for i in doomed]


def remove_incomplete(root: Path, keep: Optional[Path] = None) -> list[Path]:
    """Delete folders that interrupted saves left behind (not ``keep``, the save in progress)."""
    removed = [p for p in incomplete_dirs(root) if p != keep]
    for path in removed:
        shutil.rmtree(path, ignore_errors=True)
    return removed


@dataclass
class Found:
    """A checkpoint chosen for loading, and what the search noticed on the way."""

    path: Optional[Path]
    iteration: int = 0
    release: bool = False
    notes: list[str] = field(default_factory=list)


def require_checkpoint(root: Path, step: Optional[int] = None, label: Optional[str] = None) -> Found:
    """:func:`find_checkpoint`, or a CheckpointError naming ``label`` (default: ``root``) when there is none."""
    found = find_checkpoint(Path(root), step)
    if found.path is None:
        raise CheckpointError(f"{label or root}: no checkpoint there (no {TRACKER}, no iter_* folder, no metadata.json).")
    return found


def find_checkpoint(root: Path, step: Optional[int] = None) -> Found:
    """The checkpoint to load from ``root``: ``iter_<step>`` if given, else the tracker's, else the newest.

    ``Found.path`` is None when ``root`` holds no checkpoint at all. ``root`` may also be one
    checkpoint folder itself (``.../iter_0000100``). Raises CheckpointError for a ``step`` that is
    not there and for a folder that is not a checkpoint directory.
    """
    root = Path(root)
    if root.is_file():
        raise CheckpointError(f"{root} is a file; a checkpoint is a folder (the one `bridge pretrain "
                              "checkpoint.save=DIR` wrote, or one iter_* folder in it).")
    notes = [f"ignoring {p}: a save was interrupted before it finished (it is deleted by the next save)."
             for p in incomplete_dirs(root)]
    if is_complete(root):
        match = _ITER.match(root.name)
        return Found(root, int(match.group(1)) if match else 0, release=not match, notes=notes)
    available = complete_iterations(root)
    if step is not None:
        if step not in available:
            raise CheckpointError(f"checkpoint.ckpt_step={step}: there is no {iter_name(step)} in {root}. "
                                  f"Available iterations: {_listing(available)}.")
        return Found(checkpoint_dir(root, step), step, notes=notes)
    tracked = read_tracker(root)
    if tracked == RELEASE and is_complete(root / RELEASE):
        return Found(root / RELEASE, 0, release=True, notes=notes)
    if tracked is not None and tracked != RELEASE and int(tracked) in available:
        return Found(checkpoint_dir(root, int(tracked)), int(tracked), notes=notes)
    if tracked is not None:
        notes.append(f"{root / TRACKER} names {tracked}, which has no checkpoint folder; "
                     + (f"using the newest one, {iter_name(available[-1])}." if available else "nothing to load."))
    if available:
        return Found(checkpoint_dir(root, available[-1]), available[-1], notes=notes)
    if holds_hugging_face_weights(root):
        raise CheckpointError(f"{root} is a Hugging Face model folder; convert it first: "
                              f"bridge convert-ckpt import-hf {root} OUT_DIR")
    foreign = sorted(p.name for p in root.iterdir() if p.suffix in _FOREIGN_SUFFIXES) if root.is_dir() else []
    if foreign:
        raise CheckpointError(f"{root} is not a bridge/Megatron checkpoint directory: it holds "
                              f"{', '.join(foreign[:3])} "
                              f"but no {TRACKER}, no iter_* folder and no metadata.json. Point "
                              "checkpoint.load at a folder that `bridge pretrain checkpoint.save=DIR` (or "
                              "Megatron-LM --save) wrote.")
    return Found(None, notes=notes)


def holds_hugging_face_weights(root: Path) -> bool:
    """Whether ``root`` holds a Hugging Face model: config.json and safetensors files."""
    return (Path(root) / "config.json").is_file() and any(Path(root).glob("*.safetensors"))


def is_hugging_face_folder(path: Optional[str]) -> bool:
    """Whether ``path`` is a Hugging Face model folder (config.json and safetensors, no bridge checkpoint)."""
    if path is None:
        return False
    folder = Path(path)
    return (holds_hugging_face_weights(folder) and not is_complete(folder) and not complete_iterations(folder)
            and not (folder / TRACKER).is_file())


def _listing(iterations: list[int]) -> str:
    return ", ".join(map(str, iterations)) if iterations else "none"
