"""Train/valid/test datasets (megatron-core GPT datasets) and the iterators the loop reads."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Iterator, Optional

from torch.utils.data import DataLoader

from bridge_cli.config.data_configs import DataloaderConfig, FinetuningDatasetConfig, GPTDatasetConfig, MockGPTDatasetConfig
from bridge_cli.config.errors import ConfigError
from bridge_cli.data.samplers import CyclicBatchSampler, SequentialBatchSampler

_NUMBER = re.compile(r"^\s*[0-9]*\.?[0-9]+(e[-+]?[0-9]+)?\s*$", re.I)


def parse_blend(blend: list, key: str = "dataset.blend") -> tuple[list[str], Optional[list[float]]]:
    """Prefixes and weights from `[p1, w1, p2, w2]`, Megatron's `[w1, p1, w2, p2]`, or `[p1, p2]`."""
    items = [str(x) for x in blend]
    numeric = [bool(_NUMBER.match(x)) for x in items]
    if not any(numeric):
        prefixes, weights = items, None
    elif len(items) % 2 == 0 and all(numeric[1::2]) and not any(numeric[0::2]):
        prefixes, weights = items[0::2], [float(w) for w in items[1::2]]
    elif len(items) % 2 == 0 and all(numeric[0::2]) and not any(numeric[1::2]):
        prefixes, weights = items[1::2], [float(w) for w in items[0::2]]
    else:
        raise ConfigError(key, f"cannot pair prefixes with weights in {items}.",
                          "Write [prefix1, weight1, prefix2, weight2, ...] or just [prefix1, prefix2, ...].")
    if weights is not None and (any(w < 0 for w in weights) or sum(weights) <= 0):
        raise ConfigError(key, f"weights must be >= 0 and not all zero, got {weights}.")
    for prefix in prefixes:
        missing = [s for s in (".bin", ".idx") if not Path(prefix + s).is_file()]
        if missing:
            raise ConfigError(key, f"no indexed dataset at {prefix} ({' and '.join(prefix + s for s in missing)} missing).",
                              "Give the path prefix without .bin/.idx, as `bridge preprocess-data` writes it.")
    return prefixes, weights


def _mcore_dataset_config(cfg: GPTDatasetConfig, tokenizer):
    """megatron-core's GPTDatasetConfig from ours; a field this megatron-core lacks must be at its default."""
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig as MCoreGPTDatasetConfig

    mcore_fields = {f.name for f in dataclasses.fields(MCoreGPTDatasetConfig) if f.init}
    loader_fields = {f.name for f in dataclasses.fields(DataloaderConfig)}
    mapped_here = {"seq_length", "blend", "blend_per_split", "split", "mock", "create_attention_mask",
                   "skip_getting_attention_mask_from_dataset"}
    kwargs = {}
    for f in dataclasses.fields(GPTDatasetConfig):
        value = getattr(cfg, f.name)
        if f.name in mcore_fields and f.name not in mapped_here:
            kwargs[f.name] = value
        elif f.name not in mcore_fields | loader_fields | mapped_here and value != f.default:
            raise ConfigError(f"dataset.{f.name}", "is not supported by the installed megatron-core.",
                              "Remove it or upgrade megatron-core.")
    blend = parse_blend(cfg.blend) if cfg.blend else None
    blend_per_split = ([parse_blend(b, f"dataset.blend_per_split[{i}]") if b else None
                        for i, b in enumerate(cfg.blend_per_split)] if cfg.blend_per_split else None)
    kwargs.update(
        sequence_length=cfg.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=None if blend_per_split else cfg.split,
        tokenizer=tokenizer,
        create_attention_mask=cfg.create_attention_mask and not cfg.skip_getting_attention_mask_from_dataset,
    )
    return MCoreGPTDatasetConfig(**kwargs)


def dataset_sizes(train_iters: int, global_batch_size: int, eval_interval: Optional[int], eval_iters: int) -> list[int]:
    """Samples needed per split: every training step, every evaluation, one final test."""
    evaluations = (train_iters // eval_interval + 1) if eval_interval else 1
    return [train_iters * global_batch_size, evaluations * eval_iters * global_batch_size,
            eval_iters * global_batch_size]


def build_datasets(cfg, tokenizer, sizes: Optional[list[int]] = None) -> list:
    """[train, valid, test] datasets of ``sizes`` samples (default: what training reads; None where a split is empty)."""
    from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder
    from megatron.core.datasets.gpt_dataset import GPTDataset, MockGPTDataset

    sizes = sizes or dataset_sizes(cfg.train.train_iters, cfg.derived.global_batch_size, cfg.train.eval_interval,
                                   cfg.train.eval_iters)
    if isinstance(cfg.dataset, FinetuningDatasetConfig) and cfg.finetune.objective == "dpo":
        from bridge_cli.data.preference import build_preference_datasets

        return build_preference_datasets(cfg, tokenizer, sizes)
    if isinstance(cfg.dataset, FinetuningDatasetConfig):
        from bridge_cli.data.sft import build_sft_datasets

        return build_sft_datasets(cfg, tokenizer, sizes)
    mcore_config = _mcore_dataset_config(cfg.dataset, tokenizer)
    cls = MockGPTDataset if isinstance(cfg.dataset, MockGPTDatasetConfig) else GPTDataset
    if mcore_config.split_matrix is not None:
        # A split nobody reads is not built: megatron-core would still count epochs over it.
        mcore_config.split_matrix = [bounds if size else None for bounds, size in zip(mcore_config.split_matrix, sizes)]
    _check_files(mcore_config, cfg.derived.vocab_size)
    if mcore_config.blend is not None:
        _check_splits_have_documents(mcore_config, sizes)
    datasets = BlendedMegatronDatasetBuilder(cls, sizes, lambda: True, mcore_config).build()
    if cfg.dataset.reset_attention_mask:
        from bridge_cli.data.documents import WithDocumentIds

        datasets = [WithDocumentIds(d, tokenizer) if d is not None else None for d in datasets]
    return datasets


_SPLITS = ("train", "validation", "test")


def _check_files(mcore_config, vocab_size: int) -> None:
    """Every indexed dataset the run reads, checked once before training (damaged files, token ids)."""
    from bridge_cli.data.indexed_check import check_indexed_dataset

    if mcore_config.blend is not None:
        for prefix in mcore_config.blend[0]:
            check_indexed_dataset(prefix, vocab_size)
    for i, blend in enumerate(mcore_config.blend_per_split or []):
        for prefix in (blend[0] if blend else []):
            check_indexed_dataset(prefix, vocab_size, f"dataset.blend_per_split[{i}]")


def _check_splits_have_documents(mcore_config, sizes: list[int]) -> None:
    """A split that gets no document of a dataset but must yield samples would make megatron-core
    loop forever counting epochs; say so instead."""
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    for prefix in mcore_config.blend[0]:
        documents = IndexedDataset(prefix, mmap=True).document_indices.shape[0] - 1
        for name, bounds, size in zip(_SPLITS, mcore_config.split_matrix, sizes):
            if not size or bounds is None:
                continue
            count = int(round(bounds[1] * documents)) - int(round(bounds[0] * documents))
            if count == 0:
                raise ConfigError("dataset.split", f"the {name} split ({mcore_config.split}) gets none of the "
                                  f"{documents} documents of {prefix}.",
                                  "Give that split a larger share (e.g. \"dataset.split='90,8,2'\") or more data"
                                  + (", or set train.eval_iters=0." if name != "train" else "."))


def build_iterator(dataset, cfg, consumed_samples: int, data_parallel_rank: int, data_parallel_size: int,
                   pin_memory: bool) -> Optional[Iterator]:
    """An iterator of micro-batches (dicts of tensors) for this data-parallel rank, or None."""
    if dataset is None or len(dataset) == 0:
        return None
    mbs = cfg.train.micro_batch_size
    if (cfg.dataset.dataloader_type or "single") == "cyclic":
        sampler = CyclicBatchSampler(len(dataset), consumed_samples, mbs, data_parallel_rank, data_parallel_size,
                                     cfg.dataset.random_seed)
    else:
        sampler = SequentialBatchSampler(len(dataset), consumed_samples, mbs, data_parallel_rank, data_parallel_size)
    workers = cfg.dataset.num_workers
    loader = DataLoader(dataset, batch_sampler=sampler, num_workers=workers, pin_memory=pin_memory and cfg.dataset.pin_memory,
                        persistent_workers=workers > 0 and cfg.dataset.persistent_workers)
    return iter(loader)
