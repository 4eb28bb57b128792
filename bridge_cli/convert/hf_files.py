"""The files of a conversion: a Hugging Face folder's safetensors, read lazily and written in
shards, and an output folder that appears all at once.

Reading hands out one tensor at a time, each from a memory map opened for it alone: the pages
it touched leave the process with the map, so an import never holds a second copy of the model
(one long-lived map per file would keep every page read so far resident). Writing stages everything in
``OUT_DIR.incomplete`` and renames it to ``OUT_DIR`` at the end: a failed or killed conversion
leaves no ``OUT_DIR`` behind.
"""

from __future__ import annotations

import json
import re
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.config.errors import ConfigError
from bridge_cli.runtime.errors import RuntimeUnavailable

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
STAGING_SUFFIX = ".incomplete"
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMG]?B)\s*$", re.IGNORECASE)
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9}


def tensor_names(folder: Path) -> set[str]:
    """The names of the tensors in Hugging Face folder ``folder``: its index's, where it has one (no weight file is
    opened), else those of its safetensors headers."""
    index = Path(folder) / INDEX
    if index.is_file():
        try:
            return set(json.loads(index.read_text())["weight_map"])
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CheckpointError(f"{index} is not a safetensors index ({err}).") from err
    return set(SafetensorsFolder(folder).shapes)


class SafetensorsFolder:
    """The tensors of a Hugging Face model folder: names, shapes, and each tensor on demand."""

    def __init__(self, folder: Path):
        self.folder = Path(folder)
        self._file_of: dict[str, Path] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, str] = {}
        """Each tensor's dtype as its safetensors header names it (BF16, F32, F8_E4M3, ...)."""
        for file, names in self._listing().items():
            handle = self._open(file)
            present = set(handle.keys())
            for name in names if names is not None else sorted(present):
                if name not in present:
                    raise CheckpointError(f"{file}: has no tensor {name}, which {self.folder / INDEX} places "
                                          "there; the download is incomplete or the index is stale.")
                self._file_of[name] = file
                header = handle.get_slice(name)
                self.shapes[name] = tuple(header.get_shape())
                self.dtypes[name] = header.get_dtype()

    def file_of(self, name: str) -> Path:
        """The file holding tensor ``name``."""
        return self._file_of[name]

    def tensor(self, name: str):
        """One tensor, read from its file now into memory of its own."""
        file = self._file_of[name]
        try:
            with _safetensors().safe_open(str(file), framework="pt") as handle:
                return handle.get_tensor(name)
        except Exception as err:  # safetensors raises its own error types for damaged data
            raise CheckpointError(f"{file}: cannot read tensor {name} ({err}); the file is damaged. "
                                  "Download it again.") from err

    def _listing(self) -> dict[Path, list[str] | None]:
        """file -> the tensor names the index places there (None: whatever the file holds)."""
        index = self.folder / INDEX
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as err:
                raise CheckpointError(f"{index} is not a safetensors index ({err}).") from err
            files: dict[Path, list[str]] = {}
            for name, file in weight_map.items():
                files.setdefault(self.folder / file, []).append(name)
            return files
        found = sorted(self.folder.glob("*.safetensors"))
        if not found:
            bins = sorted(p.name for p in self.folder.glob("*.bin"))
            hint = (f" It holds PyTorch weights ({', '.join(bins[:2])}): re-save them as safetensors with "
                    "transformers' model.save_pretrained(DIR) and convert that folder." if bins else "")
            raise CheckpointError(f"{self.folder} holds no *.safetensors file.{hint}")
        return {file: None for file in found}

    def _open(self, file: Path):
        safe_open = _safetensors().safe_open
        if not file.is_file():
            raise CheckpointError(f"{file} is missing ({self.folder / INDEX} lists it); the download is incomplete.")
        try:
            handle = safe_open(str(file), framework="pt")
        except Exception as err:  # a truncated or foreign file fails in the header parser
            raise CheckpointError(f"{file}: not a readable safetensors file ({err}); it is damaged or "
                                  "incomplete. Download it again.") from err
        return handle


def _safetensors():
    """The safetensors package (with its torch API), or a clear error saying how to install it."""
    try:
        import safetensors.torch
    except ImportError as err:
        raise RuntimeUnavailable("bridge convert-ckpt reads and writes safetensors files and the safetensors "
                                 "package is not installed: pip install 'bridge-cli[hf]'.") from err
    return safetensors


def parse_size(text: str) -> int:
    """'5GB', '500MB', '200KB' -> bytes (powers of 10, as Hugging Face counts shard sizes)."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError("--max-shard-size", f"{text!r} is not a size.", "Write it like 5GB, 500MB or 200KB.")
    return int(float(match.group(1)) * _UNITS[match.group(2).upper()])


def write_safetensors(folder: Path, tensors: Iterable[tuple[str, object]], max_shard_bytes: int) -> list[Path]:
    """Write ``(name, tensor)`` pairs as ``model.safetensors``, or as numbered shards plus an index
    when they exceed ``max_shard_bytes``; only one shard's tensors are held at a time."""
    save_file = _safetensors().torch.save_file
    shards: list[dict[str, int]] = []  # per written shard: tensor name -> bytes
    pending: dict[str, object] = {}
    sizes: dict[str, int] = {}

    def flush() -> None:
        save_file(pending, str(folder / f"part-{len(shards):05d}.safetensors"), metadata={"format": "pt"})
        shards.append(dict(sizes))
        pending.clear()
        sizes.clear()

    for name, tensor in tensors:
        size = tensor.numel() * tensor.element_size()
        if pending and sum(sizes.values()) + size > max_shard_bytes:
            flush()
        pending[name], sizes[name] = tensor, size
    if pending:
        flush()
    if len(shards) == 1:
        (folder / "part-00000.safetensors").rename(folder / SINGLE)
        return [folder / SINGLE]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for i, (name, shard) in enumerate(zip(names, shards)):
        (folder / f"part-{i:05d}.safetensors").rename(folder / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(sum(shard.values()) for shard in shards)
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return [folder / name for name in names]


def check_output_free(out_dir: Path) -> None:
    """An output folder may be new or empty; anything else is refused before any work."""
    if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())):
        n = 2
        while out_dir.with_name(f"{out_dir.name}_{n}").exists():
            n += 1
        raise ConfigError(None, f"{out_dir} already exists and is not empty; bridge does not write into it.",
                          f"Give a new folder (e.g. {out_dir.with_name(f'{out_dir.name}_{n}')}) or delete it first.")


@contextmanager
def staged(out_dir: Path) -> Iterator[Path]:
    """A fresh ``OUT_DIR.incomplete`` to write into, renamed to ``OUT_DIR`` when the block succeeds
    and deleted when it fails."""
    check_output_free(out_dir)
    staging = out_dir.with_name(out_dir.name + STAGING_SUFFIX)
    if staging.exists():  # left by a conversion that was killed
        shutil.rmtree(staging)
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if out_dir.exists():
        out_dir.rmdir()
    staging.rename(out_dir)
