"""Supervised fine-tuning data: JSONL records to rows of tokens whose loss falls on the answers only.

``dataset.dataset_root`` holds Megatron-Bridge's file names: ``training.jsonl`` (required to
train), ``validation.jsonl`` and ``test.jsonl`` (each optional). One JSON object per line, either

    {"input": "reverse: abc", "output": "cba"}
    {"messages": [{"role": "system", "content": "..."}, {"role": "user", "content": "..."},
                  {"role": "assistant", "content": "..."}]}

An input/output record is ``tokenize(input) + tokenize(output) + [eod]``. A chat is rendered
with the tokenizer's own chat template when it has one (an ``apply_chat_template(messages,
add_generation_prompt)`` method returning text), else with this one, message by message:

    <|{role}|>\\n{content}\\n          system and user messages (and the assistant's header)
    <|assistant|>\\n{content}<eod>     every assistant message: content, then the eod token

The loss mask is 1 on answer tokens (the output and its eod; every assistant message's content
and eod) and 0 on prompts and padding. A sample keeps at most ``capacity + 1`` tokens, where
the capacity is ``dataset.seq_length`` (or the pack size when packing): longer samples lose the
end of their answer, and a sample whose prompt alone is longer than the capacity is an error
naming its file and line, since nothing of its answer would be learned.

Packing (``dataset.packed_sequence_specs.packed_sequence_size=P``) concatenates whole samples,
in file order, into rows of at most P tokens, padded to ``seq_length``. Each sample keeps its
own labels, loss mask and position ids (restarting at 0), and a row carries ``document_ids``
(the padding is one more document): the training step masks attention per sample and rotates
each sample from position 0, so a packed row computes what its samples compute one by one.

The splits are sized like the pretraining ones (``train.train_iters`` x global batch for
training, every evaluation's batches for validation): training repeats its samples epoch after
epoch, each epoch shuffled with ``dataset.seed``; validation and test repeat theirs in order.
Records are tokenized once, in memory.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from bridge_cli.config.errors import ConfigError

SPLIT_FILES = {"train": "training.jsonl", "validation": "validation.jsonl", "test": "test.jsonl"}
ROLES = ("system", "user", "assistant")


class RecordError(ValueError):
    """A JSONL record that cannot become a sample: what is wrong with it, and how to fix that."""

    def __init__(self, message: str, hint: str = ""):
        super().__init__(message)
        self.hint = hint


@dataclass
class Sample:
    """One tokenized record: ``ids`` and, per id, whether it is an answer token (carries loss)."""

    ids: list[int]
    answer: list[bool]


def render_messages(messages: list[dict], tokenizer) -> list[tuple[list[int], bool]]:
    """(token ids, is_answer) segments of a chat; see the module docstring for the template."""
    if callable(getattr(tokenizer, "apply_chat_template", None)):
        return _render_with_chat_template(messages, tokenizer)
    segments = []
    for message in messages:
        header = tokenizer.tokenize(f"<|{message['role']}|>\n")
        if message["role"] == "assistant":
            segments += [(header, False), (tokenizer.tokenize(message["content"]) + [tokenizer.eod], True)]
        else:
            segments.append((header + tokenizer.tokenize(message["content"] + "\n"), False))
    return segments


def _render_with_chat_template(messages: list[dict], tokenizer) -> list[tuple[list[int], bool]]:
    """The text of each assistant turn is what its message adds to the rendering of the turns before it."""
    segments, rendered = [], ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
        full = tokenizer.apply_chat_template(messages[:i + 1], add_generation_prompt=False)
        if not (prompt.startswith(rendered) and full.startswith(prompt)):
            raise RecordError("the tokenizer's chat template does not render a conversation as a prefix of its "
                             "continuation, so answer tokens cannot be told apart")
        segments += [(tokenizer.tokenize(prompt[len(rendered):]), False), (tokenizer.tokenize(full[len(prompt):]), True)]
        rendered = full
    return segments


def record_segments(record, tokenizer) -> list[tuple[list[int], bool]]:
    """(token ids, is_answer) segments of one parsed JSONL record; RecordError says what is wrong."""
    if not isinstance(record, dict):
        raise RecordError(f"expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise RecordError("'messages' must be a non-empty list of {role, content} objects")
        for message in messages:
            if not (isinstance(message, dict) and message.get("role") in ROLES and isinstance(message.get("content"), str)):
                raise RecordError(f"each message needs a role ({', '.join(ROLES)}) and a string content, got {message!r:.120}")
        if not any(m["role"] == "assistant" for m in messages):
            raise RecordError("the conversation has no assistant message, so nothing to learn")
        return render_messages(messages, tokenizer)
    if isinstance(record.get("input"), str) and isinstance(record.get("output"), str):
        return [(tokenizer.tokenize(record["input"]), False),
                (tokenizer.tokenize(record["output"]) + [tokenizer.eod], True)]
    raise RecordError(f"expected string fields 'input' and 'output', or 'messages'; found keys {sorted(record)}")


def build_sample(segments: list[tuple[list[int], bool]], capacity: int) -> Sample:
    """Concatenate the segments and keep at most ``capacity + 1`` tokens (the answer's end goes first).

    Raises RecordError when the first answer token lies beyond the capacity.
    """
    ids, answer = [], []
    for tokens, is_answer in segments:
        ids += tokens
        answer += [is_answer] * len(tokens)
    first_answer = answer.index(True) if True in answer else len(answer)
    if first_answer > capacity:
        raise RecordError(f"the prompt is {first_answer} tokens, longer than the {capacity} a row holds, "
                          "so no answer token would be trained on",
                          "Shorten the prompt or raise dataset.seq_length and model.seq_length (or the pack size).")
    return Sample(ids[:capacity + 1], answer[:capacity + 1])


def read_jsonl(path: Path, tokenizer, capacity: int, limit: Optional[int] = None,
               to_item: Optional[Callable[[object], object]] = None) -> list:
    """Tokenized samples of ``path`` (the first ``limit`` records); ConfigError names file:line on a bad one.

    ``to_item`` turns a parsed record into something else than a Sample (raising RecordError on a bad one).
    """
    to_item = to_item or (lambda record: build_sample(record_segments(record, tokenizer), capacity))
    samples = []
    # Read as bytes and decode line by line, so that bytes that are not UTF-8 are named by line too.
    with open(path, "rb") as f:
        for line_number, raw in enumerate(f, start=1):
            if limit is not None and len(samples) >= limit:
                break
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise ConfigError(None, f"{path}:{line_number}: not UTF-8 text (byte {raw[err.start]:#04x} at "
                                  f"column {err.start + 1}).", "Save the file as UTF-8.") from None
            if not line.strip():
                continue
            try:
                samples.append(to_item(json.loads(line)))
            except json.JSONDecodeError as err:
                raise ConfigError(None, f"{path}:{line_number}: not valid JSON ({err.msg} at column {err.colno}).",
                                  "Each line must be one JSON object.") from None
            except RecordError as err:
                raise ConfigError(None, f"{path}:{line_number}: {err}.", err.hint or None) from None
    if not samples:
        raise ConfigError(None, f"{path}: no records.", "Write one JSON object per line.")
    return samples


@dataclass
class Row:
    """One model input: ``tokens``, shifted ``labels``, ``loss_mask`` and ``position_ids``, all unpadded."""

    tokens: list[int]
    labels: list[int]
    loss_mask: list[float]
    position_ids: list[int]


def sample_row(sample: Sample) -> Row:
    """Inputs are ids[:-1], labels ids[1:]; a label carries loss when it is an answer token."""
    n = len(sample.ids) - 1
    return Row(sample.ids[:-1], sample.ids[1:], [float(a) for a in sample.answer[1:]], list(range(n)))


def pack_rows(rows: list[Row], pack_size: int) -> list[Row]:
    """Greedy, in order: append whole rows to a pack until the next would exceed ``pack_size`` tokens."""
    packs, current = [], Row([], [], [], [])
    for row in rows:
        if current.tokens and len(current.tokens) + len(row.tokens) > pack_size:
            packs.append(current)
            current = Row([], [], [], [])
        current.tokens += row.tokens
        current.labels += row.labels
        current.loss_mask += row.loss_mask
        current.position_ids += row.position_ids
    if current.tokens:
        packs.append(current)
    return packs


class SFTDataset(torch.utils.data.Dataset):
    """``num_samples`` rows drawn from ``rows``: epoch after epoch, shuffled per epoch when ``seed`` is set."""

    def __init__(self, rows: list[Row], seq_length: int, pad_id: int, num_samples: int, seed: Optional[int],
                 packed: bool = False):
        self.rows, self.seq_length, self.pad_id, self.packed = rows, seq_length, pad_id, packed
        self.num_samples, self.seed = num_samples, seed
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _row_index(self, index: int) -> int:
        epoch, offset = divmod(index, len(self.rows))
        if self.seed is None:
            return offset
        if epoch not in self._orders:
            self._orders[epoch] = np.random.RandomState(self.seed + epoch).permutation(len(self.rows))
        return int(self._orders[epoch][offset])

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        row = self.rows[self._row_index(index)]
        pad = self.seq_length - len(row.tokens)
        sample = {
            "tokens": torch.tensor(row.tokens + [self.pad_id] * pad, dtype=torch.long),
            "labels": torch.tensor(row.labels + [self.pad_id] * pad, dtype=torch.long),
            "loss_mask": torch.tensor(row.loss_mask + [0.0] * pad, dtype=torch.float),
            "position_ids": torch.tensor(row.position_ids + list(range(len(row.position_ids), self.seq_length)),
                                         dtype=torch.long),
        }
        if self.packed:
            # a sample starts where its positions restart; the padding after the last one is one more document
            starts = torch.tensor([p == 0 for p in row.position_ids] + [True] + [False] * (pad - 1))[: self.seq_length]
            sample["document_ids"] = torch.cumsum(starts, dim=0, dtype=torch.int32) - 1
        return sample


def build_sft_datasets(cfg, tokenizer, sizes: list[int]) -> list[Optional[SFTDataset]]:
    """[train, validation, test] datasets of ``sizes`` samples each (None where a size is 0 or the split is off)."""
    data = cfg.dataset
    root = dataset_root(data, need_training=bool(sizes[0]))
    seq_length = data.seq_length or cfg.model.seq_length
    pack_size = data.packed_sequence_specs.packed_sequence_size
    capacity = pack_size if pack_size > 0 else seq_length
    pad_id = tokenizer.pad if tokenizer.pad >= 0 else tokenizer.eod
    wanted = {"train": True, "validation": data.do_validation, "test": data.do_test}
    datasets = []
    for (split, name), size in zip(SPLIT_FILES.items(), sizes):
        path = root / name
        if not size or not wanted[split]:
            datasets.append(None)
            continue
        if not path.is_file():  # training.jsonl was checked for; the others are optional
            datasets.append(None)
            continue
        limit = data.max_train_samples if split == "train" else None
        rows = [sample_row(s) for s in read_jsonl(path, tokenizer, capacity, limit)]
        if pack_size > 0:
            rows = pack_rows(rows, pack_size)
        seed = data.seed if split == "train" else None
        datasets.append(SFTDataset(rows, seq_length, pad_id, size, seed, packed=pack_size > 0))
    return datasets


def dataset_root(data, need_training: bool = True) -> Path:
    """``dataset.dataset_root``, checked: a folder, holding training.jsonl when training reads it."""
    if not data.dataset_root:
        raise ConfigError("dataset.dataset_root", "is not set.",
                          "Set dataset.dataset_root=DIR, a folder holding training.jsonl (and validation.jsonl, test.jsonl).")
    root = Path(data.dataset_root)
    if not root.is_dir():
        raise ConfigError("dataset.dataset_root", f"{root} is not a directory.",
                          "Point it at the folder holding training.jsonl.")
    if need_training and not (root / SPLIT_FILES["train"]).is_file():
        raise ConfigError("dataset.dataset_root", f"{root} has no {SPLIT_FILES['train']}.",
                          "Put the training records there, one JSON object per line "
                          "(validation.jsonl and test.jsonl are optional).")
    return root
