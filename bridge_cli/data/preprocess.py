"""Text -> megatron-core indexed dataset (.bin/.idx): what `bridge preprocess-data` runs.

Inputs are JSON-lines files (`.jsonl`, `.json`, `.ndjson`: one document per line, its text under
`json_key`) or plain-text files (any other name: one document per file). Documents are tokenized
in worker processes and written in input order, each followed by the tokenizer's end-of-document
token. The output appears only when complete: it is written under temporary names and renamed.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Optional

import numpy as np

from bridge_cli.config.data_configs import TokenizerConfig
from bridge_cli.config.errors import ConfigError
from bridge_cli.runtime.output_paths import check_output_file

JSON_SUFFIXES = (".jsonl", ".json", ".ndjson")


@dataclass
class PreprocessStats:
    """What a run did so far; passed to the progress callback and returned at the end."""

    total_bytes: int = 0
    bytes_done: int = 0
    documents: int = 0
    tokens: int = 0
    skipped: int = 0
    started: float = field(default_factory=time.time)
    outputs: tuple[str, ...] = ()

    @property
    def seconds(self) -> float:
        return time.time() - self.started


def expand_inputs(patterns: Iterable[str]) -> list[Path]:
    """Files named by each pattern (a path or a glob, `**` included), in order, without repeats."""
    files: dict[Path, None] = {}
    for pattern in patterns:
        if glob.has_magic(pattern):
            matches = sorted(Path(p) for p in glob.glob(pattern, recursive=True) if Path(p).is_file())
            if not matches:
                raise ConfigError("--input", f"no file matches {pattern}.", "Check the path and quote the glob.")
        elif Path(pattern).is_dir():
            raise ConfigError("--input", f"{pattern} is a folder.", f"Give a glob such as '{pattern}/*.jsonl'.")
        elif not Path(pattern).is_file():
            raise ConfigError("--input", f"no such file: {pattern}.")
        else:
            matches = [Path(pattern)]
        files.update(dict.fromkeys(matches))
    return list(files)


def _work_items(files: list[Path], json_key: str) -> Iterator[tuple[str, bytes, Optional[str]]]:
    """(where, raw bytes, json key or None) per document; bytes are decoded in the workers."""
    for path in files:
        if path.suffix.lower() in JSON_SUFFIXES:
            with open(path, "rb") as f:
                for number, line in enumerate(f, 1):
                    if line.strip():
                        yield f"{path}:{number}", line, json_key
        else:
            yield str(path), path.read_bytes(), None


class _Encoder:
    """Text of one work item -> token ids (end-of-document appended), or the reason it has none."""

    def __init__(self, config: TokenizerConfig, append_eod: bool):
        from bridge_cli.data.tokenizers import build_tokenizer

        self.tokenizer = build_tokenizer(config)
        self.append_eod = append_eod
        self.dtype = token_dtype(self.tokenizer.vocab_size)

    def __call__(self, item: tuple[str, bytes, Optional[str]]) -> tuple[str, int, Optional[np.ndarray], Optional[str]]:
        where, raw, json_key = item
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            return where, len(raw), None, f"not valid UTF-8 ({e.reason} at byte {e.start})"
        if json_key is not None:
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                return where, len(raw), None, f"not valid JSON ({e.msg} at column {e.colno})"
            if not isinstance(record, dict) or not isinstance(record.get(json_key), str):
                return where, len(raw), None, f"no string under the key '{json_key}' (--json-key)"
            text = record[json_key]
        ids = self.tokenizer.tokenize(text)
        if self.append_eod:
            ids.append(self.tokenizer.eod)
        return where, len(raw), np.asarray(ids, dtype=self.dtype), None


# One encoder per worker process, built by the pool's initializer: the tokenizer is built once
# per process instead of being pickled with every batch of documents.
_worker_encoder: Optional[_Encoder] = None


def _init_worker(config: TokenizerConfig, append_eod: bool) -> None:
    global _worker_encoder
    _worker_encoder = _Encoder(config, append_eod)


def _encode_in_worker(item):
    return _worker_encoder(item)


def _first_missing(folder: Path) -> Optional[Path]:
    """The outermost folder of ``folder``'s path that does not exist yet (None if it exists)."""
    missing = None
    while not folder.exists():
        missing, folder = folder, folder.parent
    return missing


def _remove_empty_folders(folder: Path, created: Optional[Path]) -> None:
    """Undo the folders a failed run created, from ``folder`` up to ``created``, where they stayed empty."""
    if created is None:
        return
    for path in (folder, *folder.parents):
        try:
            path.rmdir()
        except OSError:
            return
        if path == created:
            return


def token_dtype(vocab_size: int) -> type:
    """uint16 when every id fits, else int32 (megatron-core's DType.optimal_dtype)."""
    from megatron.core.datasets.indexed_dataset import DType

    return DType.optimal_dtype(vocab_size)


def _batched(items: Iterator, size: int) -> Iterator[list]:
    while batch := list(itertools.islice(items, size)):
        yield batch


def preprocess_data(inputs: Iterable[str], output_prefix: str, tokenizer: TokenizerConfig, *,
                    json_key: str = "text", workers: int = 1, append_eod: bool = True, on_error: str = "fail",
                    chunk_size: int = 64, on_progress: Optional[Callable[[PreprocessStats], None]] = None,
                    on_skip: Optional[Callable[[str], None]] = None) -> PreprocessStats:
    """Tokenize ``inputs`` (paths or globs) into ``output_prefix``.bin/.idx; returns the counts.

    A malformed document (bad JSON line, no ``json_key``, not UTF-8) is passed to ``on_skip`` as
    "file[:line]: reason" and left out with ``on_error="skip"``; with "fail" it raises ConfigError
    naming it, and nothing is written.
    """
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    if on_error not in ("skip", "fail"):
        raise ConfigError("--on-error", f"must be skip or fail, got {on_error}.")
    if workers < 1 or chunk_size < 1:
        raise ConfigError("--workers" if workers < 1 else "--chunk-size", "must be at least 1.")
    prefix = Path(output_prefix)
    final = (Path(f"{prefix}.bin"), Path(f"{prefix}.idx"))
    for path in final:
        check_output_file("--output-prefix", str(path))
    files = expand_inputs(inputs)
    encoder = _Encoder(tokenizer, append_eod)  # also checks the tokenizer before any file is written
    stats = PreprocessStats(total_bytes=sum(p.stat().st_size for p in files))
    created = _first_missing(prefix.parent)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    partial = tuple(Path(f"{p}.tmp") for p in final)
    pool = builder = None
    renamed: tuple[Path, ...] = ()
    try:
        builder = IndexedDatasetBuilder(str(partial[0]), dtype=encoder.dtype)
        if workers > 1:
            import multiprocessing

            pool = multiprocessing.Pool(workers, initializer=_init_worker, initargs=(tokenizer, append_eod))
        items = _work_items(files, json_key)
        # Bounded windows: Pool.imap would otherwise read the whole input into its task queue.
        for window in _batched(items, chunk_size * workers * 16):
            results = pool.imap(_encode_in_worker, window, chunksize=chunk_size) if pool else map(encoder, window)
            for where, size, ids, error in results:
                stats.bytes_done += size
                if error is not None:
                    if on_error == "fail":
                        raise ConfigError(where, f"{error}.",
                                          "Fix it, or pass --on-error skip to leave such documents out.")
                    stats.skipped += 1
                    if on_skip:
                        on_skip(f"{where}: {error}; skipped")
                elif ids.size:
                    builder.add_document(ids, [ids.size])
                    stats.documents += 1
                    stats.tokens += int(ids.size)
                if on_progress:
                    on_progress(stats)
        if not stats.documents:
            raise ConfigError("--input", f"no document with any token in {len(files)} file(s).",
                              "Check the files and --json-key.")
        builder.finalize(str(partial[1]))
        # The index goes last: a .bin renamed without its .idx is removed below, and no .idx ever
        # describes a .bin of another run.
        final[1].unlink(missing_ok=True)
        os.replace(partial[0], final[0])
        renamed = (final[0],)
        os.replace(partial[1], final[1])
    except BaseException:
        if builder is not None:
            builder.data_file.close()
        for path in (*partial, *renamed):
            path.unlink(missing_ok=True)
        _remove_empty_folders(prefix.parent, created)
        raise
    finally:
        if pool is not None:
            pool.terminate()
    stats.outputs = tuple(str(p) for p in final)
    return stats
