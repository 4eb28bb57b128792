"""Reading a torch_dist checkpoint one decoder layer at a time, for export.

megatron-core stores each layer's weights as one slice of a tensor stacked over the layers
(``decoder.layers.self_attention.linear_qkv.weight`` of shape ``[layers, ...]``), and its loader
in a one-process world only reads whole stacked tensors: loading through it holds the model. This
module reads just the region of each stacked tensor that a layer's megatron-core parameter covers,
through torch.distributed.checkpoint's own file reader (``FileSystemReader.read_data``, which
understands every layout and serialisation torch_dist writes), and assembles it from whichever
stored chunks overlap it, so a checkpoint saved under any tensor/pipeline-parallel layout reads
the same. megatron-core's factories (the gate/up halves of ``linear_fc1``) are applied and merged
as its loader does.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Iterator

_LAYER = re.compile(r"^(decoder|mtp)\.layers\.\d+\.")
"""The prefix of one decoder layer's parameters, or of one multi-token-prediction layer's."""


def layer_groups(names: list[str]) -> list[list[str]]:
    """``names`` (in order) grouped per decoder (or multi-token-prediction) layer; each name outside them alone."""
    groups: dict[str, list[str]] = {}
    for name in names:
        layer = _LAYER.match(name)
        groups.setdefault(layer.group(0) if layer else name, []).append(name)
    return list(groups.values())


def read_by_layer(template: dict[str, Any], path: Path) -> Iterator[dict[str, Any]]:
    """``{parameter name: tensor}`` for each group of :func:`layer_groups`, read when asked for.

    ``template`` maps parameter names to the model's sharded state dict entries (ShardedTensor or
    ShardedTensorFactory) for a model built in this one process; the tensors read are new, so the
    model's own storage is never touched.
    """
    from megatron.core.dist_checkpointing.dict_utils import dict_list_map_inplace, extract_matching_values
    from megatron.core.dist_checkpointing.mapping import (ShardedTensor, ShardedTensorFactory, apply_factories,
                                                         apply_factory_merges)
    from torch.distributed.checkpoint import FileSystemReader

    reader = FileSystemReader(str(path))
    metadata = reader.read_metadata()
    reader.set_up_storage_reader(metadata, True)
    for names in layer_groups(list(template)):
        part = {name: template[name] for name in names}
        factories, _ = extract_matching_values(part, lambda v: isinstance(v, ShardedTensorFactory))
        apply_factories(part)
        dict_list_map_inplace(lambda v: _read(reader, metadata, v) if isinstance(v, ShardedTensor) else v, part)
        yield apply_factory_merges(part, factories)


def _read(reader, metadata, sharded):
    """The region of the stored tensor ``sharded.key`` that megatron-core's ``sharded`` covers, as a new tensor."""
    import torch
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, ReadItem

    if sharded.flattened_range is not None:  # only optimizer states are flattened
        raise RuntimeError(f"{sharded.key}: a flattened tensor, which export does not read")
    # megatron-core stores a tensor with its prepended (layer) axes as axes of length 1
    out = torch.empty((1,) * sharded.prepend_axis_num + tuple(sharded.local_shape), dtype=sharded.data.dtype)
    start, size = tuple(sharded.global_offset), tuple(out.shape)
    items = []
    for index, chunk in enumerate(metadata.state_dict_metadata[sharded.key].chunks):
        low = [max(a, b) for a, b in zip(start, chunk.offsets)]
        high = [min(a + n, b + m) for a, n, b, m in zip(start, size, chunk.offsets, chunk.sizes)]
        if all(lo < hi for lo, hi in zip(low, high)):
            items.append(ReadItem(
                type=LoadItemType.TENSOR, dest_index=MetadataIndex(sharded.key, start),
                dest_offsets=torch.Size(lo - s for lo, s in zip(low, start)),
                storage_index=MetadataIndex(sharded.key, chunk.offsets, index),
                storage_offsets=torch.Size(lo - c for lo, c in zip(low, chunk.offsets)),
                lengths=torch.Size(hi - lo for lo, hi in zip(low, high))))
    if sum(item.lengths.numel() for item in items) != out.numel():
        raise RuntimeError(f"{sharded.key}: the checkpoint's chunks do not cover offset {start}, shape {size}")
    reader.read_data(LoadPlan(items), _Into(out)).wait()
    return out.view(tuple(sharded.local_shape))


class _Into:
    """The two calls of torch's LoadPlanner that ``FileSystemReader.read_data`` makes for tensors:
    where a read item goes (its block of ``out``), and that it arrived."""

    def __init__(self, out):
        self.out = out

    def resolve_tensor(self, item):
        block = self.out
        for dim, (offset, length) in enumerate(zip(item.dest_offsets, item.lengths)):
            block = block.narrow(dim, offset, length)
        return block

    def commit_tensor(self, item, tensor) -> None:
        """Nothing to do: the data was copied into ``out`` in place."""
