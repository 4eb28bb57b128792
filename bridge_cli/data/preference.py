"""Preference data for DPO (``finetune.objective=dpo``): JSONL pairs of responses to one prompt.

``dataset.dataset_root`` holds ``training.jsonl`` (and optionally ``validation.jsonl``, ``test.jsonl``),
one record per line, plain text or chat messages:

    {"prompt": "flip abc =", "chosen": " CBA", "rejected": " ABC"}
    {"prompt": [{"role": "user", "content": "..."}], "chosen": [{"role": "assistant", "content": "..."}],
     "rejected": [{"role": "assistant", "content": "..."}]}

(a chat's chosen/rejected may also be a string: one assistant message). Each response becomes a
sample as an SFT record does (:mod:`bridge_cli.data.sft`): prompt + response + eod, or the chat
rendered with the tokenizer's chat template, with loss mask 1 on the response's tokens only (an
assistant turn inside the prompt is prompt).

A training sample is a whole pair. Unpacked, it is two rows, ``[2, seq_length]`` (chosen, then
rejected), so a micro-batch of N pairs runs 2N rows. Packed
(``dataset.packed_sequence_specs.packed_sequence_size=P``), pairs are appended whole, chosen then
rejected, to rows of at most P tokens, each response at most P / 2; a row's ``document_ids``
then number its sequences, even for chosen and odd for rejected. The DPO step finds the pairs
from this layout (:mod:`bridge_cli.training.dpo_step`).
"""

from __future__ import annotations

from typing import Optional

import torch

from bridge_cli.data.sft import (
    SPLIT_FILES,
    RecordError,
    Row,
    SFTDataset,
    Sample,
    build_sample,
    dataset_root,
    pack_rows,
    read_jsonl,
    record_segments,
    sample_row,
)

FIELDS = ("prompt", "chosen", "rejected")


def rows_per_sample(cfg) -> int:
    """Rows of ``model.seq_length`` tokens the model runs per training sample: 2 for DPO's unpacked pairs (chosen
    and rejected), else 1 (a packed row of whole pairs, or any other data's sample)."""
    packed = getattr(getattr(cfg.dataset, "packed_sequence_specs", None), "packed_sequence_size", -1) > 0
    return 2 if cfg.finetune.objective == "dpo" and not packed else 1


def pair_segments(record, tokenizer) -> tuple[list, list]:
    """(chosen, rejected) segments of one preference record, answer-marked on the response only."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    missing = [name for name in FIELDS if name not in record]
    if missing:
        raise RecordError(f"no {' or '.join(repr(m) for m in missing)}; a preference record needs 'prompt', "
                          f"'chosen' and 'rejected' (found keys {sorted(record)})")
    prompt = record["prompt"]
    if isinstance(prompt, str):
        for name in ("chosen", "rejected"):
            if not isinstance(record[name], str):
                raise RecordError(f"'{name}' must be a string when 'prompt' is one")
        return tuple(record_segments({"input": prompt, "output": record[name]}, tokenizer)
                     for name in ("chosen", "rejected"))
    if not isinstance(prompt, list) or not prompt:
        raise RecordError("'prompt' must be a string or a non-empty list of {role, content} messages")
    return tuple(_chat_segments(prompt, record[name], name, tokenizer) for name in ("chosen", "rejected"))


def _chat_segments(prompt: list, response, name: str, tokenizer) -> list:
    if isinstance(response, str):
        response = [{"role": "assistant", "content": response}]
    if not isinstance(response, list) or not any(isinstance(m, dict) and m.get("role") == "assistant"
                                                   for m in response):
        raise RecordError(f"'{name}' must be a string or a list of messages with an assistant message")
    segments = record_segments({"messages": prompt + response}, tokenizer)
    # one answer segment per assistant message, in order: those of the prompt are prompt here
    in_prompt = sum(isinstance(m, dict) and m.get("role") == "assistant" for m in prompt)
    marked = []
    for tokens, is_answer in segments:
        if is_answer and in_prompt:
            in_prompt -= 1
            is_answer = False
        marked.append((tokens, is_answer))
    return marked


def read_pairs(path, tokenizer, capacity: int, limit: Optional[int] = None) -> list[tuple[Sample, Sample]]:
    """(chosen, rejected) samples of ``path``, each at most ``capacity + 1`` tokens; ConfigError names file:line."""
    def to_pair(record):
        chosen, rejected = pair_segments(record, tokenizer)
        return build_sample(chosen, capacity), build_sample(rejected, capacity)

    return read_jsonl(path, tokenizer, capacity, limit, to_item=to_pair)


class PairDataset(torch.utils.data.Dataset):
    """Unpacked pairs: sample i is chosen row i stacked on rejected row i, each padded to the row length."""

    def __init__(self, chosen: SFTDataset, rejected: SFTDataset):
        self.chosen, self.rejected = chosen, rejected  # the same seed and size: the same order

    def __len__(self) -> int:
        return len(self.chosen)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        chosen, rejected = self.chosen[index], self.rejected[index]
        return {key: torch.stack([chosen[key], rejected[key]]) for key in chosen}


def pair_row(chosen: Sample, rejected: Sample) -> Row:
    """Both sequences of a pair in one row, chosen first; their positions each restart at 0."""
    c, r = sample_row(chosen), sample_row(rejected)
    return Row(c.tokens + r.tokens, c.labels + r.labels, c.loss_mask + r.loss_mask, c.position_ids + r.position_ids)


def build_preference_datasets(cfg, tokenizer, sizes: list[int]) -> list:
    """[train, validation, test] pair datasets of ``sizes`` pairs each (None where a size is 0 or the split is off)."""
    data = cfg.dataset
    root = dataset_root(data, need_training=bool(sizes[0]))
    seq_length = data.seq_length or cfg.model.seq_length
    pack_size = data.packed_sequence_specs.packed_sequence_size
    capacity = pack_size // 2 if pack_size > 0 else seq_length
    pad_id = tokenizer.pad if tokenizer.pad >= 0 else tokenizer.eod
    wanted = {"train": True, "validation": data.do_validation, "test": data.do_test}
    datasets = []
    for (split, name), size in zip(SPLIT_FILES.items(), sizes):
        path = root / name
        if not size or not wanted[split] or not path.is_file():
            datasets.append(None)
            continue
        pairs = read_pairs(path, tokenizer, capacity, data.max_train_samples if split == "train" else None)
        seed = data.seed if split == "train" else None
        if pack_size > 0:
            rows = pack_rows([pair_row(c, r) for c, r in pairs], pack_size)
            datasets.append(SFTDataset(rows, seq_length, pad_id, size, seed, packed=True))
        else:
            chosen, rejected = ([sample_row(pair[k]) for pair in pairs] for k in (0, 1))
            datasets.append(PairDataset(SFTDataset(chosen, seq_length, pad_id, size, seed),
                                        SFTDataset(rejected, seq_length, pad_id, size, seed)))
    return datasets
