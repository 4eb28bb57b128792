"""Output paths of `bridge eval` and `bridge preprocess-data` are checked before any work; a failed
preprocess-data leaves nothing of its own behind."""

from __future__ import annotations

from tests.integration.test_preprocess_data import preprocess

BYTES = ["--tokenizer-type", "ByteLevelTokenizer"]


def _one_line_error(result) -> str:
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_eval_output_that_is_a_folder_is_refused_before_evaluating(cli, tmp_path):
    error = _one_line_error(cli("eval", "recipe=tiny", f"checkpoint.load={tmp_path}", "--output", str(tmp_path)))
    assert error == f"error: --output: {tmp_path} is a folder, not a file. Give the path of a file to write."


def test_eval_output_under_a_file_is_refused(cli, tmp_path):
    (tmp_path / "plain").write_text("x")
    error = _one_line_error(cli("eval", "recipe=tiny", "--output", str(tmp_path / "plain" / "r.json")))
    assert error.startswith(f"error: --output: {tmp_path / 'plain'} is a file, not a folder.")


def test_preprocess_output_prefix_under_a_file_is_refused_writing_nothing(cli, tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"text": "one"}\n')
    (tmp_path / "plain").write_text("x")
    result = preprocess(cli, [tmp_path / "docs.jsonl"], tmp_path / "plain" / "sub" / "out", *BYTES)
    error = _one_line_error(result)
    assert error.startswith(f"error: --output-prefix: {tmp_path / 'plain' / 'sub'} cannot be created: "
                            f"{tmp_path / 'plain'} is a file.")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["docs.jsonl", "plain"]


def test_a_failed_preprocess_keeps_the_previous_output_and_adds_nothing(cli, tmp_path):
    good, bad = tmp_path / "good.jsonl", tmp_path / "bad.jsonl"
    good.write_text('{"text": "one"}\n{"text": "two"}\n')
    bad.write_text('{"text": "one"}\n{"text": \n')
    prefix = tmp_path / "out" / "docs"
    assert preprocess(cli, [good], prefix, *BYTES).exit_code == 0
    before = {p.name: p.read_bytes() for p in prefix.parent.iterdir()}
    assert sorted(before) == ["docs.bin", "docs.idx"]
    assert _one_line_error(preprocess(cli, [bad], prefix, *BYTES)).startswith(f"error: {bad}:2: not valid JSON")
    assert {p.name: p.read_bytes() for p in prefix.parent.iterdir()} == before
