"""Check an indexed dataset (.bin/.idx) before training: a damaged file or a token id the model has no
embedding for is named here, not met as a crash when a batch reaches it."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from bridge_cli.config.errors import ConfigError

# megatron-core's index layout (indexed_dataset._IndexReader): magic, version <Q, dtype code <B,
# sequence count <Q, document count <Q, then int32 lengths and int64 byte pointers per sequence.
_MAGIC = b"MMIDIDX\x00\x00"
_HEADER = struct.Struct("<9sQBQQ")
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
           8: np.uint16}
# 64 Mi tokens a chunk: the max of one takes tens of milliseconds and bounds the memory it touches.
_CHUNK_TOKENS = 64 * 1024 * 1024


def check_indexed_dataset(prefix: str, vocab_size: int, key: str = "dataset.blend") -> None:
    """Raise ConfigError naming the file when ``prefix``.idx is not an index, ``prefix``.bin is not the
    length the index says, or a token id in the .bin is >= ``vocab_size``."""
    idx, bin_path = Path(prefix + ".idx"), Path(prefix + ".bin")
    dtype, lengths, pointers = _read_index(idx, key)
    expected = int(pointers[-1]) + int(lengths[-1]) * np.dtype(dtype).itemsize if len(lengths) else 0
    actual = bin_path.stat().st_size
    if actual != expected:
        raise ConfigError(key, f"{bin_path} is {actual} bytes but its index {idx} says {expected}: "
                          f"the file is {'truncated' if actual < expected else 'not the one indexed'}.",
                          "Copy it again or rerun `bridge preprocess-data`.")
    largest = _largest_token(bin_path, dtype, actual // np.dtype(dtype).itemsize)
    if largest is not None and largest >= vocab_size:
        raise ConfigError(key, f"{bin_path} holds token id {largest}, but the model's vocabulary has "
                          f"{vocab_size} ids (model.vocab_size or the tokenizer's).",
                          "Tokenize the data with the tokenizer the model uses, or set the matching "
                          "tokenizer / model.vocab_size.")


def _read_index(idx: Path, key: str) -> tuple[type, np.ndarray, np.ndarray]:
    size = idx.stat().st_size
    with open(idx, "rb") as stream:
        head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        raise ConfigError(key, f"{idx} is not an indexed-dataset index (only {size} bytes).",
                          "Rerun `bridge preprocess-data` to write it again.")
    magic, version, code, sequences, documents = _HEADER.unpack(head)
    if magic != _MAGIC or version != 1 or code not in _DTYPES:
        raise ConfigError(key, f"{idx} is not an indexed-dataset index (bad header).",
                          "Rerun `bridge preprocess-data` to write it again.")
    needed = _HEADER.size + sequences * (4 + 8) + documents * 8
    if size < needed:
        raise ConfigError(key, f"{idx} is truncated: {size} bytes where its header needs {needed}.",
                          "Rerun `bridge preprocess-data` to write it again.")
    lengths = np.fromfile(idx, dtype=np.int32, count=sequences, offset=_HEADER.size)
    pointers = np.fromfile(idx, dtype=np.int64, count=sequences, offset=_HEADER.size + 4 * sequences)
    if (lengths < 0).any() or (pointers < 0).any():
        raise ConfigError(key, f"{idx} holds negative sequence lengths or offsets: it is damaged.",
                          "Rerun `bridge preprocess-data` to write it again.")
    return _DTYPES[code], lengths, pointers


def _largest_token(bin_path: Path, dtype: type, count: int):
    """The largest token id in the file, read in chunks (None for an empty file)."""
    if count == 0:
        return None
    tokens = np.memmap(bin_path, dtype=dtype, mode="r", shape=(count,))
    return max(int(tokens[i:i + _CHUNK_TOKENS].max()) for i in range(0, count, _CHUNK_TOKENS))
