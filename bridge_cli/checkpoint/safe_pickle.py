"""Reading a checkpoint's pickles so that a checkpoint from elsewhere cannot run code.

torch's distributed-checkpoint reader unpickles ``.metadata`` with ``pickle.load``, and every non-tensor
item of the ``*.distcp`` shards (RNG states, megatron-core's rerun and, from 0.19 on, common state,
distributed-optimizer objects) with ``torch.load(weights_only=False)``. A pickle can call any function
it names, so a planted file would run with the user's rights the moment it is read. Before torch or
megatron-core reads a folder, :func:`read_metadata` and :func:`check_objects` read each of those
pickles, and every ``*.pt`` file (``common.pt``), through an unpickler that admits only the classes
such files hold (:data:`ALLOWED`) and stops at the first other one, before it is looked up or called.
Tensor items need no check: torch reads them with its own weights-only unpickler.

``BRIDGE_TRUST_CHECKPOINT_PICKLES=1`` skips the check, for a checkpoint whose writer the user trusts.
It is an environment variable, not a config key, so that a recipe or a run_config.yaml that came with
a checkpoint cannot switch it on.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path
from typing import Any, BinaryIO

from bridge_cli.checkpoint.errors import CheckpointError

TRUST_VARIABLE = "BRIDGE_TRUST_CHECKPOINT_PICKLES"
_TRUST_HINT = (f"If you trust whoever wrote this checkpoint, run again with {TRUST_VARIABLE}=1 in the environment "
               "(its pickles are then read unchecked).")

# Every class a checkpoint's pickles named when this list was made, recorded by saving checkpoints
# (tiny, tiny_moe with EP=2, TP=2 under torchrun, LoRA adapters, a rerun-state-machine save; megatron-core
# 0.16.1, torch 2.13), plus those megatron-core 0.16-0.19 registers for its own weights-only loading of
# common state (megatron/core/safe_globals.py: what Megatron-LM's saved arguments hold) and the torch
# classes its writers can add. torch dtypes are admitted by kind (see _allowed).
ALLOWED: dict[str, frozenset[str]] = {
    # .metadata: torch.distributed.checkpoint's Metadata, and the save plans megatron-core keeps in it
    # (all_local_plans); _StoragePrefix comes with decentralized (cached-structure, async) plans
    "torch.distributed.checkpoint.metadata": frozenset({
        "Metadata", "MetadataIndex", "StorageMeta", "TensorStorageMetadata", "BytesStorageMetadata",
        "ChunkStorageMetadata", "TensorProperties", "_MEM_FORMAT_ENCODING"}),
    "torch.distributed.checkpoint.filesystem": frozenset({"_StorageInfo", "_StoragePrefix"}),
    "torch.distributed.checkpoint.planner": frozenset({
        "SavePlan", "WriteItem", "WriteItemType", "TensorWriteData", "BytesIOWriteData"}),
    # tensors (torch.save's own rebuild functions), sizes, devices, layouts
    "torch": frozenset({"Size", "device", "Tensor"}),
    "torch._utils": frozenset({"_rebuild_tensor_v2", "_rebuild_parameter"}),
    "torch._tensor": frozenset({"_rebuild_from_type_v2"}),
    "torch.nn.parameter": frozenset({"Parameter"}),
    "torch.serialization": frozenset({"_get_layout"}),
    # RNG states: NumPy's generator state (arrays, and bytes written as latin-1 text), Python's as tuples
    "numpy": frozenset({"ndarray", "dtype"}),
    "numpy.dtypes": frozenset({"UInt32DType"}),
    "numpy._core.multiarray": frozenset({"_reconstruct", "scalar"}),  # NumPy 2
    "numpy.core.multiarray": frozenset({"_reconstruct", "scalar"}),  # NumPy 1
    "_codecs": frozenset({"encode"}),
    # plain containers that have no opcode of their own
    "builtins": frozenset({"set", "frozenset", "bytearray", "complex", "slice"}),
    "collections": frozenset({"OrderedDict"}),
    # megatron-core: the rerun state machine's state, and Megatron-LM's saved arguments (argparse
    # Namespace holding dtypes, paths, signals and megatron-core's enums and OptimizerConfig);
    # megatron-core 0.19 stores its common state as a BytesIO among the shards
    "megatron.core.rerun_state_machine": frozenset({"RerunState", "RerunMode", "RerunDiagnostic", "Call", "Caller"}),
    "megatron.core.enums": frozenset({"ModelType"}),
    "megatron.core.transformer.enums": frozenset({
        "AttnBackend", "CudaGraphScope", "CudaGraphModule", "InferenceCudaGraphScope"}),
    "megatron.core.optimizer": frozenset({"OptimizerConfig"}),
    "megatron.core.optimizer.optimizer_config": frozenset({"OptimizerConfig"}),
    "argparse": frozenset({"Namespace"}),
    "types": frozenset({"SimpleNamespace"}),
    "pathlib": frozenset({"PosixPath"}),
    "signal": frozenset({"Signals"}),
    "_io": frozenset({"BytesIO"}),
    "io": frozenset({"BytesIO"}),
}

_PYTHON2_NAMES = {"__builtin__": "builtins"}  # how pickle protocol 2 (torch.save's) names builtins
_ZIP = b"PK\x03\x04"  # torch.save's archive format
_PICKLE = b"\x80"  # the PROTO opcode that opens a pickle of protocol 2 or later


def trusted() -> bool:
    """Whether the user lets checkpoint pickles run unchecked (``BRIDGE_TRUST_CHECKPOINT_PICKLES=1``)."""
    return os.environ.get(TRUST_VARIABLE, "").strip().lower() in ("1", "true", "yes")


def read_metadata(path: Path):
    """The torch_dist ``.metadata`` of checkpoint folder ``path``, read through the allow-list.

    Raises CheckpointError for a file that names another class, or that cannot be read.
    """
    file = Path(path) / ".metadata"
    if trusted():
        from torch.distributed.checkpoint import FileSystemReader

        return _reading(file, lambda: FileSystemReader(str(path)).read_metadata())

    def read():
        with open(file, "rb") as f:
            return _AllowList(f).load()

    metadata = _reading(file, read)
    if not hasattr(metadata, "state_dict_metadata") or not hasattr(metadata, "storage_data"):
        raise CheckpointError(f"{file} cannot be read (it holds a {type(metadata).__name__}, not torch's "
                              "checkpoint Metadata); the checkpoint is damaged.")
    return metadata


def check_objects(path: Path, metadata) -> None:
    """Every other pickle torch or megatron-core reads from checkpoint folder ``path``: the non-tensor
    items of its shards (``metadata`` says which, and where) and every ``*.pt`` file, ``common.pt``
    included. Run after the shards are known to be whole."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    if trusted():
        return
    path = Path(path)
    for index, info in sorted(metadata.storage_data.items(), key=lambda item: (item[1].relative_path, item[1].offset)):
        if not isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            continue
        where = f"{path / info.relative_path} (its item {index.fqn})"
        if getattr(info, "transform_descriptors", None):
            raise CheckpointError(f"{where} is stored through {', '.join(info.transform_descriptors)}, which bridge "
                                  f"cannot check for planted code. {_TRUST_HINT}")
        with open(path / info.relative_path, "rb") as f:
            f.seek(info.offset)
            item = f.read(info.length)
        _check_torch_file(io.BytesIO(item), where)
    for file in sorted(path.rglob("*.pt")):
        with open(file, "rb") as f:
            _check_torch_file(f, str(file))


class _Refused(pickle.UnpicklingError):
    def __init__(self, module: str, name: str):
        super().__init__(f"{module}.{name}")
        self.module, self.name = module, name


class _AllowList(pickle.Unpickler):
    """pickle's own (C) unpickler, except that a class or function outside ALLOWED is never looked up."""

    def find_class(self, module: str, name: str) -> Any:
        if not _allowed(_PYTHON2_NAMES.get(module, module), name):
            raise _Refused(module, name)
        if (module, name) == ("_codecs", "encode"):
            return _latin1_encode
        return super().find_class(module, name)


def _allowed(module: str, name: str) -> bool:
    if name in ALLOWED.get(module, ()):
        return True
    if module == "torch":  # torch.float32, torch.bfloat16, ...: dtypes pickle as attributes of torch
        import torch

        return isinstance(getattr(torch, name, None), torch.dtype)
    return False


def _latin1_encode(text: str, encoding: str) -> bytes:
    """``_codecs.encode`` as pickle protocol 2 uses it, for bytes (written as latin-1 text), and nothing else:
    a codec is looked up by name."""
    if encoding not in ("latin1", "latin-1"):
        raise _Refused("_codecs", f"encode (with the {encoding!r} codec)")
    return text.encode("latin-1")


class _PickleModule:
    """What torch.load unpickles with when given ``pickle_module``: the allow-list, both for its archive
    format and for its legacy one (a sequence of pickles)."""

    Unpickler = _AllowList

    @staticmethod
    def load(file: BinaryIO, **kwargs) -> Any:
        return _AllowList(file, **kwargs).load()


def _check_torch_file(f: BinaryIO, where: str) -> None:
    """A ``torch.save`` file (or a shard item in that format), and any archive nested in it as a BytesIO."""
    import torch

    # weights_only=False lets torch take pickle_module: its reader, our allow-list; tensor data stays on the CPU
    loaded = _reading(where, lambda: torch.load(f, map_location="cpu", weights_only=False, pickle_module=_PickleModule))
    for nested in _byte_buffers(loaded):
        content = nested.getvalue()
        if content.startswith(_ZIP):
            _check_torch_file(io.BytesIO(content), f"{where}, an archive nested in it")
        elif content.startswith(_PICKLE):
            _reading(f"{where}, a pickle nested in it", lambda: _AllowList(io.BytesIO(content)).load())


def _byte_buffers(obj: Any, depth: int = 0):
    """The BytesIO objects in ``obj`` (megatron-core 0.19 nests its common state so; readers unpickle them)."""
    if isinstance(obj, io.BytesIO):
        yield obj
    elif depth < 32 and isinstance(obj, dict):
        for value in obj.values():
            yield from _byte_buffers(value, depth + 1)
    elif depth < 32 and isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from _byte_buffers(value, depth + 1)


def _reading(where, read):
    """Run ``read``: a refused class, or any failure, becomes a CheckpointError naming ``where``."""
    try:
        return read()
    except _Refused as refused:
        raise CheckpointError(
            f"{where}: refused to unpickle {refused.module}.{refused.name}, which no checkpoint holds: loading the "
            f"file could run code planted in it, so bridge stopped before loading anything. {_TRUST_HINT}") from None
    except CheckpointError:
        raise
    except Exception as err:  # a damaged file surfaces as whatever unpickling it raises
        raise CheckpointError(f"{where} cannot be read ({type(err).__name__}: {str(err)[:300]}); "
                              "the checkpoint is damaged.") from err
