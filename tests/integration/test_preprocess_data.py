"""`bridge preprocess-data` on a real corpus (the Python standard library's own sources), then
`bridge pretrain` on a blend of the results with a tokenizer trained here; malformed input."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from tests.conftest import bridge
from tests.unit.test_tokenizers import train_bpe

STDLIB = Path(os.__file__).parent
TEXT_PACKAGES = ("json", "email", "wsgiref", "concurrent/futures")  # one document per .py file
JSONL_PACKAGES = ("http", "urllib", "xml/dom")  # 40-line chunks as JSON lines
VALIDATION = re.compile(r"^validation at iteration \d+ \| lm loss ([0-9.]+)", re.M)
SUMMARY = re.compile(r"preprocessed ([0-9,]+) documents, ([0-9,]+) tokens in [0-9.]+ s "
                     r"\([0-9,]+ docs/s, [0-9,]+ tokens/s\)")


def sources(packages) -> list[Path]:
    return [p for package in packages for p in sorted((STDLIB / package).glob("*.py"))]


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The text files as globs, one JSONL file of chunks, and a BPE tokenizer trained on both."""
    root = tmp_path_factory.mktemp("stdlib")
    chunks = []
    for path in sources(JSONL_PACKAGES):
        lines = path.read_text().splitlines(keepends=True)
        chunks += ["".join(lines[i:i + 40]) for i in range(0, len(lines), 40)]
    jsonl = root / "chunks.jsonl"
    jsonl.write_text("".join(json.dumps({"text": chunk}) + "\n" for chunk in chunks))
    texts = [p.read_text() for p in sources(TEXT_PACKAGES)] + chunks
    return {"globs": [str(STDLIB / package / "*.py") for package in TEXT_PACKAGES], "jsonl": jsonl,
            "chunks": chunks, "tokenizer": train_bpe(texts, root / "bpe", vocab_size=512), "root": root}


def preprocess(cli, inputs, prefix, *args):
    flags = [item for path in inputs for item in ("--input", str(path))]
    return cli("preprocess-data", *flags, "--output-prefix", str(prefix), *args)


def read_documents(prefix) -> list[list[int]]:
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    data = IndexedDataset(str(prefix))
    return [data[i].tolist() for i in range(len(data))]


@pytest.mark.slow
def test_preprocess_the_stdlib_then_pretrain_on_a_blend_and_validation_loss_falls(cli, corpus, tmp_path):
    from bridge_cli.config.data_configs import TokenizerConfig
    from bridge_cli.data.tokenizers import build_tokenizer

    hf = ["--tokenizer-type", "HuggingFaceTokenizer", "--tokenizer-model", str(corpus["tokenizer"])]
    code, chunks = tmp_path / "data" / "code", tmp_path / "data" / "chunks"
    result = preprocess(cli, corpus["globs"], code, *hf, "--workers", "2")
    assert result.exit_code == 0, result.output
    files = sources(TEXT_PACKAGES)
    assert SUMMARY.search(result.output).group(1) == f"{len(files):,}"
    assert f"{code}.bin, {code}.idx" in result.output
    result = preprocess(cli, [corpus["jsonl"]], chunks, *hf, "--chunk-size", "16")
    assert result.exit_code == 0, result.output
    assert SUMMARY.search(result.output).group(1) == f"{len(corpus['chunks']):,}"

    tokenizer = build_tokenizer(TokenizerConfig(tokenizer_type="HuggingFaceTokenizer",
                                                tokenizer_model=str(corpus["tokenizer"])))
    documents = read_documents(code)
    assert len(documents) == len(files) and all(doc[-1] == tokenizer.eod for doc in documents)
    assert tokenizer.detokenize(documents[0]) == files[0].read_text()  # in input order, losslessly
    assert tokenizer.detokenize(read_documents(chunks)[-1]) == corpus["chunks"][-1]
    assert sorted(p.name for p in code.parent.iterdir()) == ["chunks.bin", "chunks.idx", "code.bin", "code.idx"]

    run = bridge("pretrain", "recipe=tiny", "dataset=gpt", f"dataset.blend=[{code},0.7,{chunks},0.3]",
                 "dataset.split='90,5,5'", "tokenizer=huggingface", f"tokenizer.tokenizer_model={corpus['tokenizer']}",
                 "train.train_iters=80", "train.eval_interval=20", "train.eval_iters=4", "logger.log_interval=20",
                 f"dataset.path_to_cache={tmp_path}/cache")
    assert run.returncode == 0, run.stderr[-3000:]
    assert "padded vocab (size: 512) with 0 dummy tokens (new size: 512)" in run.stdout
    curve = [float(loss) for loss in VALIDATION.findall(run.stdout)]
    assert len(curve) == 4 and curve == sorted(curve, reverse=True) and curve[-1] < curve[0] - 0.3, curve


def test_byte_level_text_files_with_and_without_end_of_document(cli, corpus, tmp_path):
    files = sources(["json"])
    for flag, extra in (("--append-eod", 1), ("--no-append-eod", 0)):
        result = preprocess(cli, [STDLIB / "json" / "*.py"], tmp_path / flag, "--tokenizer-type", "ByteLevelTokenizer",
                            flag)
        assert result.exit_code == 0, result.output
        documents = read_documents(tmp_path / flag)
        assert [len(doc) for doc in documents] == [len(p.read_bytes()) + extra for p in files]
        assert documents[0][-1] == (256 if extra else files[0].read_bytes()[-1])


@pytest.fixture
def malformed(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "first"}\n{"text": "second"}\n{"text": "broken\n\n{"body": "no text key"}\n'
                    '{"text": "last"}\n')
    return path


def test_malformed_lines_are_fatal_by_default_and_leave_no_output(cli, malformed, tmp_path):
    result = preprocess(cli, [malformed], tmp_path / "out" / "docs", "--tokenizer-type", "ByteLevelTokenizer")
    assert result.exit_code == 2, result.output
    assert f"error: {malformed}:3: not valid JSON" in result.stderr and "--on-error skip" in result.stderr
    assert not (tmp_path / "out").exists(), "the folder this run created goes too"


def test_malformed_lines_are_reported_and_skipped_on_request(cli, malformed, tmp_path):
    result = preprocess(cli, [malformed], tmp_path / "docs", "--tokenizer-type", "ByteLevelTokenizer",
                        "--on-error", "skip", "--workers", "2", "--chunk-size", "1")
    assert result.exit_code == 0, result.output
    assert f"{malformed}:3: not valid JSON" in result.stderr
    assert f"{malformed}:5: no string under the key 'text'" in result.stderr
    assert "preprocessed 3 documents" in result.stdout and "skipped 2 malformed document(s)" in result.stdout
    assert [bytes(doc[:-1]).decode() for doc in read_documents(tmp_path / "docs")] == ["first", "second", "last"]


@pytest.mark.parametrize("missing", ["/nonexistent/corpus.jsonl", "/nonexistent/*.jsonl"])
def test_missing_input_is_named(cli, tmp_path, missing):
    result = preprocess(cli, [missing], tmp_path / "docs", "--tokenizer-type", "ByteLevelTokenizer")
    assert result.exit_code == 2, result.output
    assert missing in result.stderr and "--input" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_missing_tokenizer_folder_is_named_before_anything_is_written(cli, corpus, tmp_path):
    result = preprocess(cli, [corpus["jsonl"]], tmp_path / "docs", "--tokenizer-type", "HuggingFaceTokenizer",
                        "--tokenizer-model", str(tmp_path / "no-tokenizer"))
    assert result.exit_code == 2, result.output
    assert f"tokenizer.tokenizer_model: no tokenizer folder at {tmp_path / 'no-tokenizer'}" in result.stderr
    assert list(tmp_path.iterdir()) == []
