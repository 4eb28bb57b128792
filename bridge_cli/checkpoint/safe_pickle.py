"""Reading a checkpoint's pickles so that a checkpoint from elsewhere cannot run code.

torch's distributed-checkpoint reader unpickles ``.metadata`` with ``pickle.load``, and every non-tensor
item of the ``*.distcp`` shards (RNG states, megatron-core's rerun and, from 0.19 on, common state,
distributed-optimizer objects) with ``torch.load(weights_only=False)``. A pickle can call any function
it names, so a planted file would run with the user's rights the moment it is read. Before torch or
megatron-core reads a folder, :func:`read_metadata` and :func:`check_objects` read each of those
pickles, and every ``*.pt`` file (``common.pt``), through an unpickler that admits only the classes
such files hold (:data:`ALLOWED`) and stops at the first other one, before it is looked up or called.
Tensor items need no check: torch reads them with its own weights-only unpickler. Transformer Engine's
FP8 state (a layer's ``_extra_state``) is a pickle inside a uint8 tensor, which Transformer Engine unpickles
with ``pickle.loads`` when the layer loads: it is read through the allow-list too.

``BRIDGE_TRUST_CHECKPOINT_PICKLES=1`` skips the check, for a checkpoint whose writer the user trusts.
It is an environment variable, not a config key, so that a recipe or a run_config.yaml that came with
a checkpoint cannot switch it on.
"""

from __future__ import annotations

import codecs
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
    "builtins": frozenset({"set", "frozenset", "bytearray", "complex"}),
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
    # Transformer Engine's FP8 extra state, a plain pickle (tensors in it pickle their storage as a nested
    # torch.save archive, read through the allow-list too, see _load_storage): the recipes megatron-core
    # 0.19's own restricted unpickler for that state admits
    "torch.storage": frozenset({"_load_from_bytes", "UntypedStorage"}),
    "transformer_engine.common.recipe": frozenset({
        "DelayedScaling", "Float8CurrentScaling", "Float8BlockScaling", "MXFP8BlockScaling", "NVFP4BlockScaling",
        "Format", "_FormatHelper", "MMParams", "QParams"}),
    "megatron.core.extensions.transformer_engine": frozenset({"TEDelayedScaling"}),
}

_PYTHON2_NAMES = {"__builtin__": "builtins"}  # how pickle protocol 2 (torch.save's) names builtins
_EXTRA_STATE = "_extra_state"  # the key suffix of a layer's Transformer Engine state


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
    from torch.distributed.checkpoint.utils import _create_file_view

    if trusted():
        return
    path = Path(path)
    items: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        if isinstance(metadata.state_dict_metadata.get(index.fqn), BytesStorageMetadata):
            items.setdefault(info.relative_path, []).append((info.offset, index.fqn, info))
    for relative_path, in_file in sorted(items.items()):
        with open(path / relative_path, "rb") as f:
            for _, key, info in sorted(in_file, key=lambda item: item[:2]):
                where = f"{path / relative_path} (its item {key})"
                if getattr(info, "transform_descriptors", None):
                    raise CheckpointError(f"{where} is stored through {', '.join(info.transform_descriptors)}, which "
                                          f"bridge cannot check for planted code. {_TRUST_HINT}")
                # the slice torch's reader hands to torch.load, through the same view
                _check_torch_file(_create_file_view(f, info.offset, info.length), where, _EXTRA_STATE in key)
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
        if (module, name) == ("torch.storage", "_load_from_bytes"):
            return _load_storage
        if module == "torch" and name.endswith("Storage"):  # what torch.load makes of a storage's type, as it does
            from torch.serialization import StorageType

            try:
                return StorageType(name)
            except KeyError:  # torch.UntypedStorage
                pass
        return super().find_class(module, name)


def _allowed(module: str, name: str) -> bool:
    if name in ALLOWED.get(module, ()):
        return True
    if module == "torch":  # torch.float32, torch.FloatStorage, ...: dtypes and storage types, as attributes of torch
        import torch

        return isinstance(getattr(torch, name, None), torch.dtype) or (
            name.endswith("Storage") and isinstance(getattr(torch, name, None), type))
    return False


def _latin1_encode(text: str, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    """``_codecs.encode`` as pickle protocol 2 uses it, for bytes (written as latin-1 text), and nothing else:
    a codec is looked up by name."""
    if encoding not in ("latin1", "latin-1"):
        raise _Refused("_codecs", f"encode (with the {encoding!r} codec)")
    return codecs.encode(text, "latin-1", errors)


def _load_storage(data: bytes):
    """``torch.storage._load_from_bytes``, which a pickled tensor calls on its storage (a torch.save archive)
    and which would read it with ``weights_only=False``: read through the allow-list instead."""
    return _torch_load(io.BytesIO(data))


def _torch_load(f: BinaryIO) -> Any:
    """torch.load of ``f`` with the allow-list, tensor data included; a TorchScript archive, which torch.load
    would hand to torch.jit.load, is refused."""
    import torch

    _open_archive(f)
    # weights_only=False lets torch take pickle_module: its reader, our allow-list
    return torch.load(f, map_location="cpu", weights_only=False, pickle_module=_PickleModule)


class _PickleModule:
    """What torch.load unpickles with when given ``pickle_module``: the allow-list, both for its archive
    format and for its legacy one (a sequence of pickles)."""

    Unpickler = _AllowList

    @staticmethod
    def load(file: BinaryIO, **kwargs) -> Any:
        return _AllowList(file, **kwargs).load()


def _check_torch_file(f: BinaryIO, where: str, extra_state: bool = False, read=None) -> None:
    """A ``torch.save`` file (or a shard item in that format), and what it holds that readers unpickle in turn: a
    BytesIO (torch.load reads megatron-core 0.19's common state and Transformer Engine's older FP8 state so),
    and in a layer's ``_extra_state`` a uint8 tensor (Transformer Engine's pickled FP8 state)."""
    import torch

    read = read or _reading
    # an extra state is small, and its tensors' bytes are the point
    loaded = read(where, lambda: _torch_load(f) if extra_state else _unpickle_archive(f))
    for buffer in _leaves(loaded, io.BytesIO):
        if buffer.getbuffer().nbytes:
            _check_torch_file(io.BytesIO(buffer.getvalue()), f"{where}, a BytesIO in it", extra_state, _nested)
    for tensor in _leaves(loaded, torch.Tensor) if extra_state else ():
        if tensor.dtype == torch.uint8 and tensor.numel():
            content = tensor.detach().cpu().numpy().tobytes()
            _nested(f"{where}, the Transformer Engine state in it", lambda: _AllowList(io.BytesIO(content)).load())


def _unpickle_archive(f: BinaryIO) -> Any:
    """The object of torch.save file ``f`` with its tensors on the meta device: the pickle torch.load would run,
    through the allow-list, and no tensor data read (a distributed optimizer's state item holds gigabytes)."""
    archive = _open_archive(f)
    if archive is None:  # torch's legacy format (before 1.6): pickles all through
        return _torch_load(f)
    unpickler = _AllowList(io.BytesIO(archive.get_record("data.pkl")))
    unpickler.persistent_load = _meta_storage
    return unpickler.load()


def _open_archive(f: BinaryIO):
    """torch's own reader of torch.save's zip format (it finds the pickle torch.load would), or None for another
    format; a TorchScript archive, which torch.load would hand to torch.jit.load, is refused."""
    import torch
    from torch.serialization import _is_zipfile

    if not _is_zipfile(f):
        return None
    start = f.tell()
    archive = torch._C.PyTorchFileReader(f)
    if "constants.pkl" in archive.get_all_records():  # how torch.load tells TorchScript
        raise _Refused("torch.jit", "load (the file is a TorchScript archive)")
    f.seek(start)
    return archive


def _meta_storage(saved_id: tuple) -> Any:
    """A storage as torch.save's pickle names it ("storage", its type, key, location, elements), on the meta device."""
    import torch

    kind, storage_type, _, _, numel = saved_id
    if kind != "storage":
        raise pickle.UnpicklingError(f"unknown persistent id {kind!r}")
    dtype = torch.uint8 if storage_type is torch.UntypedStorage else storage_type.dtype
    untyped = torch.UntypedStorage(numel * torch._utils._element_size(dtype), device="meta")
    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def _leaves(obj: Any, kind: type, depth: int = 0):
    """The objects of type ``kind`` in ``obj`` and the containers in it."""
    if isinstance(obj, kind):
        yield obj
    elif depth < 32 and isinstance(obj, dict):
        for value in obj.values():
            yield from _leaves(value, kind, depth + 1)
    elif depth < 32 and isinstance(obj, (list, tuple, set, frozenset)):
        for value in obj:
            yield from _leaves(value, kind, depth + 1)


def _reading(where, read):
    """Run ``read``: a refused class, or any failure, becomes a CheckpointError naming ``where``."""
    try:
        return read()
    except _Refused as refused:
        raise _refusal(where, refused) from None
    except CheckpointError:
        raise
    except Exception as err:  # a damaged file surfaces as whatever unpickling it raises
        raise CheckpointError(f"{where} cannot be read ({type(err).__name__}: {str(err)[:300]}); "
                              "the checkpoint is damaged.") from err


def _nested(where, read):
    """``read`` of data a reader may unpickle in turn, where only a refused class counts: data that is no
    pickle fails that reader at the same opcode, having called nothing outside the allow-list."""
    try:
        return read()
    except _Refused as refused:
        raise _refusal(where, refused) from None
    except CheckpointError:
        raise
    except Exception:
        return None


def _refusal(where, refused: _Refused) -> CheckpointError:
    return CheckpointError(
        f"{where}: refused to unpickle {refused.module}.{refused.name}, which no checkpoint holds: loading the "
        f"file could run code planted in it, so bridge stopped before loading anything. {_TRUST_HINT}")
