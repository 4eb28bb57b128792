"""Damaged or mismatched data is named with its file before training, exit 2, no traceback."""

from __future__ import annotations

import json

from tests.integration.test_indexed_data import write_indexed_dataset


def _pretrain(cli, prefix, *extra):
    return cli("pretrain", "recipe=tiny", "dataset=gpt", f"dataset.blend=[{prefix}]", "model.vocab_size=1000",
               "train.train_iters=2", "train.eval_iters=0", "dataset.split='1,0,0'", *extra)


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and "iteration" not in result.output, result.output
    lines = [line for line in result.output.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, result.output
    return lines[0]


def test_a_truncated_bin_is_named(cli, tmp_path):
    prefix = str(tmp_path / "data")
    write_indexed_dataset(prefix, documents=20, seed=0)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(f.seek(0, 2) - 100)
    error = _one_line_error(_pretrain(cli, prefix))
    assert f"{prefix}.bin is" in error and "truncated" in error


def test_an_index_of_garbage_is_named(cli, tmp_path):
    prefix = str(tmp_path / "data")
    write_indexed_dataset(prefix, documents=20, seed=0)
    (tmp_path / "data.idx").write_bytes(bytes(range(256)) * 4)
    error = _one_line_error(_pretrain(cli, prefix))
    assert f"{prefix}.idx is not an indexed-dataset index" in error


def test_token_ids_beyond_the_vocabulary_are_named(cli, tmp_path):
    prefix = str(tmp_path / "data")
    write_indexed_dataset(prefix, documents=20, seed=0, vocab=1500)  # its end-of-document id is 1499
    error = _one_line_error(_pretrain(cli, prefix))
    assert f"{prefix}.bin holds token id 1499, but the model's vocabulary has 1000 ids" in error


def test_an_sft_line_that_is_not_utf8_is_named_by_file_and_line(cli, tmp_path):
    data = tmp_path / "sft"
    data.mkdir()
    good = json.dumps({"input": "a question", "output": "an answer"}).encode()
    (data / "training.jsonl").write_bytes(good + b"\n" + b'{"input": "caf\xe9", "output": "x"}\n' + good + b"\n")
    # pretrain reads SFT data with the reader finetune uses, without needing a pretrained checkpoint
    result = cli("pretrain", "recipe=tiny_sft", f"dataset.dataset_root={data}", "train.train_iters=2",
                 "train.eval_iters=0")
    error = _one_line_error(result)
    assert f"{data / 'training.jsonl'}:2" in error and "UTF-8" in error
