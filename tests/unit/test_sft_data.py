"""Fine-tuning data: JSONL records become rows whose loss mask covers the answer tokens only."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from bridge_cli.config.data_configs import FinetuningDatasetConfig, PackedSequenceSpecs
from bridge_cli.config.errors import ConfigError
from bridge_cli.data.sft import (
    SFTDataset,
    build_sample,
    build_sft_datasets,
    pack_rows,
    read_jsonl,
    record_segments,
    sample_row,
)
from bridge_cli.data.tokenizers import ByteLevelTokenizer

TOK = ByteLevelTokenizer()


def row_of(record: dict, capacity: int = 64):
    return sample_row(build_sample(record_segments(record, TOK), capacity))


def answer_text(row) -> str:
    """The label tokens the loss mask keeps, as text (eod dropped by detokenize)."""
    return TOK.detokenize([label for label, m in zip(row.labels, row.loss_mask) if m])


def test_input_output_loss_falls_on_the_answer_and_its_eod_only():
    row = row_of({"input": "ab", "output": "c"})
    assert row.tokens == [97, 98, 99] and row.labels == [98, 99, TOK.eod]
    assert row.loss_mask == [0.0, 1.0, 1.0]  # predicting "b" is prompt; "c" and eod are the answer
    assert row.position_ids == [0, 1, 2]


def test_padding_carries_no_loss():
    item = SFTDataset([row_of({"input": "reverse: abc\n", "output": "cba"})], 32, TOK.pad, 1, None)[0]
    prompt = len(TOK.tokenize("reverse: abc\n"))
    mask = item["loss_mask"].tolist()
    assert mask[:prompt - 1] == [0.0] * (prompt - 1)
    assert mask[prompt - 1:prompt + 3] == [1.0] * 4  # "cba" + eod
    assert mask[prompt + 3:] == [0.0] * (32 - prompt - 3)
    assert item["tokens"].shape == (32,) and item["tokens"][-1] == TOK.pad
    assert TOK.detokenize(item["labels"][item["loss_mask"].bool()].tolist()) == "cba"


def test_chat_template_masks_every_assistant_turn_and_nothing_else():
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"}, {"role": "user", "content": "2+2"},
                {"role": "assistant", "content": "4"}]
    row = row_of({"messages": messages}, capacity=256)
    assert answer_text(row) == "hello4"
    assert TOK.detokenize(row.tokens).startswith("<|system|>\nbe brief\n<|user|>\nhi\n<|assistant|>\nhello")
    assert row.labels.count(TOK.eod) == 2 and all(m for l, m in zip(row.labels, row.loss_mask) if l == TOK.eod)


def test_a_tokenizer_chat_template_is_used_when_the_tokenizer_has_one():
    class Templated(ByteLevelTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=False):
            text = "".join(f"[{m['role']}]{m['content']}[end]" for m in messages)
            return text + ("[assistant]" if add_generation_prompt else "")

    tok = Templated()
    segments = record_segments({"messages": [{"role": "user", "content": "q"},
                                             {"role": "assistant", "content": "a"}]}, tok)
    assert [(tok.detokenize(ids), answer) for ids, answer in segments] == [("[user]q[end][assistant]", False),
                                                                          ("a[end]", True)]


def test_a_long_answer_is_truncated_to_the_row():
    sample = build_sample(record_segments({"input": "abcd", "output": "x" * 50}, TOK), capacity=10)
    assert len(sample.ids) == 11 and sample.answer == [False] * 4 + [True] * 7


def test_a_prompt_longer_than_the_row_names_file_and_line(tmp_path):
    path = tmp_path / "training.jsonl"
    path.write_text(json.dumps({"input": "ok", "output": "y"}) + "\n" + json.dumps({"input": "p" * 20, "output": "y"}) + "\n")
    with pytest.raises(ConfigError) as err:
        read_jsonl(path, TOK, capacity=16)
    assert f"{path}:2:" in str(err.value) and "prompt is 20 tokens" in str(err.value)
    assert "dataset.seq_length" in str(err.value)


@pytest.mark.parametrize("line, fragment", [
    ('{"input": "a", "output": ', "not valid JSON"),
    ('{"question": "a", "answer": "b"}', "expected string fields 'input' and 'output', or 'messages'"),
    ('{"messages": [{"role": "user", "content": "a"}]}', "no assistant message"),
    ('{"messages": [{"role": "bot", "content": "a"}]}', "each message needs a role"),
    ('[1, 2]', "expected a JSON object"),
])
def test_malformed_records_name_file_and_line(tmp_path, line, fragment):
    path = tmp_path / "training.jsonl"
    path.write_text('{"input": "a", "output": "b"}\n\n' + line + "\n")
    with pytest.raises(ConfigError) as err:
        read_jsonl(path, TOK, capacity=64)
    assert f"{path}:3:" in str(err.value) and fragment in str(err.value)


def test_packing_keeps_each_sample_whole_with_its_mask_and_positions():
    rows = [row_of({"input": "ab", "output": "cd"}), row_of({"input": "e", "output": "f"}),
            row_of({"input": "gh", "output": "ij"})]  # 4, 2 and 4 tokens
    packs = pack_rows(rows, pack_size=7)
    assert [len(p.tokens) for p in packs] == [6, 4]
    assert packs[0].position_ids == [0, 1, 2, 3, 0, 1]
    assert packs[0].labels == rows[0].labels + rows[1].labels  # no label crosses a sample boundary
    assert packs[0].loss_mask == rows[0].loss_mask + rows[1].loss_mask
    assert answer_text(packs[0]) == "cdf"


def _cfg(root, **dataset):
    data = FinetuningDatasetConfig(dataset_root=str(root), seq_length=32, **dataset)
    return SimpleNamespace(dataset=data, model=SimpleNamespace(seq_length=32))


def _write(path, n):
    path.write_text("".join(json.dumps({"input": f"q{i}:", "output": f"a{i}"}) + "\n" for i in range(n)))


def test_splits_are_sized_repeated_and_shuffled_per_epoch(tmp_path):
    _write(tmp_path / "training.jsonl", 5)
    _write(tmp_path / "validation.jsonl", 3)
    train, valid, test = build_sft_datasets(_cfg(tmp_path), TOK, [12, 6, 4])
    assert (len(train), len(valid), test) == (12, 6, None)  # no test.jsonl: no test split

    def answers(dataset, n):
        return [TOK.detokenize(dataset[i]["labels"][dataset[i]["loss_mask"].bool()].tolist()) for i in range(n)]

    first, second = answers(train, 5), [answers(train, 10)[i] for i in range(5, 10)]
    assert sorted(first) == sorted(second) == [f"a{i}" for i in range(5)] and first != second
    assert answers(valid, 6) == ["a0", "a1", "a2"] * 2  # validation in file order, repeated
    again, _, _ = build_sft_datasets(_cfg(tmp_path), TOK, [12, 0, 0])
    assert answers(again, 12) == answers(train, 12)


def test_max_train_samples_do_validation_and_packing(tmp_path):
    _write(tmp_path / "training.jsonl", 10)
    _write(tmp_path / "validation.jsonl", 3)
    train, valid, _ = build_sft_datasets(_cfg(tmp_path, max_train_samples=4, do_validation=False), TOK, [8, 8, 0])
    assert valid is None and len(train.rows) == 4
    packed, _, _ = build_sft_datasets(
        _cfg(tmp_path, packed_sequence_specs=PackedSequenceSpecs(packed_sequence_size=20)), TOK, [4, 0, 0])
    # 10 rows of 5 tokens ("q0:a0" + eod, shifted), 4 per pack of 20, padded to seq_length 32
    assert [len(p.tokens) for p in packed.rows] == [20, 20, 10] and packed[0]["tokens"].shape == (32,)


def test_missing_training_file_names_the_key(tmp_path):
    with pytest.raises(ConfigError) as err:
        build_sft_datasets(_cfg(tmp_path), TOK, [8, 8, 8])
    assert str(err.value).startswith("dataset.dataset_root:") and "training.jsonl" in str(err.value)
    assert build_sft_datasets(_cfg(tmp_path), TOK, [0, 8, 8]) == [None, None, None]  # evaluation needs no training file
