"""Imports from before import-hf mapped sliding windows (bridge_cli/convert/old_imports.py): their recipe capped
model.seq_length at a Mistral's window and had no model.window_size, so a longer model.seq_length ran full causal
attention without a word. pretrain, finetune and eval now refuse it, exit 2, naming the field, the window and the
command that re-imports the folder; within the window they run as before. export-hf writes the window back.

An old import is made here as the old code wrote it: today's import of a tiny Mistral (sliding_window 8), its recipe
and run_config.yaml then given the old model section (seq_length 8, no window_size).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # Hugging Face conversions (reading an old recipe alone: tests/unit/test_old_imports.py)

WINDOW = 8


def mistral(folder: Path, sliding_window) -> Path:
    torch.manual_seed(0)
    config = transformers.MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        sliding_window=sliding_window, tie_word_embeddings=False)
    transformers.MistralForCausalLM(config).save_pretrained(folder)
    return folder


def aged(root: Path) -> Path:
    """``root`` (today's import) as import-hf wrote it before b8cf5f9: model.seq_length capped at the window, no
    window_size or window_attn_skip_freq, in the recipe and in the checkpoint's run_config.yaml."""
    for file in (root / "recipe.yaml", root / "iter_0000000" / "run_config.yaml"):
        text = file.read_text()
        header = "".join(line + "\n" for line in text.splitlines() if line.startswith("#"))
        config = yaml.safe_load(text)
        model = config["model"]
        cap = model["seq_length"] if model.get("window_size") is None else model["window_size"][0] + 1
        for key in ("window_size", "window_attn_skip_freq"):
            model.pop(key, None)
        model["seq_length"] = min(model["seq_length"], cap)
        config["checkpoint"].pop("export_hf_model_type")  # nor the family (recorded from 09:40 that day)
        file.write_text(header + yaml.safe_dump(config, sort_keys=False))
    return root


@pytest.fixture(scope="module")
def imports(tmp_path_factory) -> dict[str, Path]:
    from typer.testing import CliRunner

    from bridge_cli.cli.app import app

    work = tmp_path_factory.mktemp("old_imports")
    out = {}
    for name, window in (("windowed", WINDOW), ("windowless", None)):
        source = mistral(work / f"hf_{name}", window)
        result = CliRunner().invoke(app, ["convert-ckpt", "import-hf", str(source), str(work / name)])
        assert result.exit_code == 0, result.output
        out[name] = work / name
    out["current"] = work / "current"
    shutil.copytree(out["windowed"], out["current"])
    for name in ("windowed", "windowless"):
        aged(out[name])
    return out


def dry_run(cli, *args: str):
    # pretrain: eval's dry run also wants checkpoint.load, which these recipes leave to the command line
    return cli("pretrain", "--dry-run", *args, "train.micro_batch_size=2", "train.global_batch_size=2")


def test_todays_import_writes_window_size_even_where_there_is_none(imports, tmp_path):
    """The key tells today's recipes from the old ones: a windowless Mistral's says null."""
    from bridge_cli.cli.app import app  # noqa: F401  (the CLI's imports, as the import above ran)
    from typer.testing import CliRunner

    source = mistral(tmp_path / "hf", None)
    result = CliRunner().invoke(app, ["convert-ckpt", "import-hf", str(source), str(tmp_path / "out")])
    assert result.exit_code == 0, result.output
    model = yaml.safe_load((tmp_path / "out" / "recipe.yaml").read_text())["model"]
    assert "window_size" in model and model["window_size"] is None
    assert yaml.safe_load((imports["current"] / "recipe.yaml").read_text())["model"]["window_size"] == [WINDOW - 1, 0]


def test_an_old_import_run_past_its_window_is_refused_naming_the_field_and_the_reimport(cli, imports):
    recipe = f"recipe={imports['windowed'] / 'recipe.yaml'}"
    for command in ("eval", "pretrain", "finetune"):
        result = cli(command, "--dry-run", recipe, "model.seq_length=64", "train.micro_batch_size=2",
                     "train.global_batch_size=2")
        assert result.exit_code == 2 and "Traceback" not in result.output, result.output
        message = result.stderr
        assert message.startswith("error: model.seq_length: 64 reaches past the sliding window"), message
        assert f"mistral's sliding window is {WINDOW} tokens" in message
        assert "its recipe has no model.window_size and capped model.seq_length at 8" in message
        source = imports["windowed"].with_name("hf_windowed")
        assert (f"bridge convert-ckpt import-hf {source} {imports['windowed']}_windowed --recipe tiny" in message)
        assert f"or keep model.seq_length at {WINDOW} or less" in message
    # within the window, full causal attention is the window's: it runs as before
    assert dry_run(cli, recipe, f"model.seq_length={WINDOW}").exit_code == 0


def test_a_run_resuming_a_checkpoint_trained_from_an_old_import_is_refused_too(cli, imports, tmp_path):
    """checkpoint.load of a run whose run_config.yaml names the old import as its pretrained_checkpoint."""
    run = tmp_path / "run"
    shutil.copytree(imports["windowed"] / "iter_0000000", run / "iter_0000010")
    (run / "latest_checkpointed_iteration.txt").write_text("10")
    run_config = run / "iter_0000010" / "run_config.yaml"
    config = yaml.safe_load(run_config.read_text())
    config["checkpoint"]["pretrained_checkpoint"] = str(imports["windowed"])
    run_config.write_text(yaml.safe_dump(config))
    result = dry_run(cli, f"recipe={imports['windowed'] / 'recipe.yaml'}", "checkpoint.pretrained_checkpoint=null",
                     f"checkpoint.load={run}", "model.seq_length=32")
    assert result.exit_code == 2 and "32 reaches past the sliding window" in result.stderr, result.output


def test_without_its_source_folder_the_imports_own_length_is_the_bound(cli, imports, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(imports["windowed"], moved)
    recipe = moved / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace(str(imports["windowed"].with_name("hf_windowed")),
                                                 str(tmp_path / "deleted")))
    result = dry_run(cli, f"recipe={recipe}", f"checkpoint.pretrained_checkpoint={moved}", "model.seq_length=9")
    assert result.exit_code == 2, result.output
    assert f"its source, {tmp_path / 'deleted'}, is gone, so its sliding window is unknown" in result.stderr


def test_old_imports_without_a_window_and_todays_imports_take_any_length(cli, imports):
    # a Mistral whose config.json has no window (v0.2, v0.3): the old import was right
    assert dry_run(cli, f"recipe={imports['windowless'] / 'recipe.yaml'}", "model.seq_length=128").exit_code == 0
    result = dry_run(cli, f"recipe={imports['current'] / 'recipe.yaml'}",
                     f"checkpoint.pretrained_checkpoint={imports['current']}", "model.seq_length=128")
    assert result.exit_code == 0, result.output


def test_the_reimport_the_message_gives_trains_past_the_window(cli, imports, tmp_path):
    source = imports["windowed"].with_name("hf_windowed")
    out = tmp_path / "reimported"
    assert cli("convert-ckpt", "import-hf", str(source), str(out), "--recipe", "tiny").exit_code == 0
    model = yaml.safe_load((out / "recipe.yaml").read_text())["model"]
    assert (model["window_size"], model["seq_length"]) == ([WINDOW - 1, 0], 128)
    assert dry_run(cli, f"recipe={out / 'recipe.yaml'}", "model.seq_length=64").exit_code == 0
    assert json.loads((source / "config.json").read_text())["sliding_window"] == WINDOW


def test_export_writes_the_window_of_an_old_import_back(cli, imports, tmp_path):
    """Its run_config.yaml has no window; the source's config.json has, and the exported Mistral computes as the
    source does past the window (24 tokens, window 8)."""
    out = tmp_path / "exported"
    result = cli("convert-ckpt", "export-hf", str(imports["windowed"]), str(out))
    assert result.exit_code == 0, result.output
    config = json.loads((out / "config.json").read_text())
    assert (config["model_type"], config["sliding_window"]) == ("mistral", WINDOW)
    tokens = torch.randint(0, 512, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        source, exported = (transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()(
            tokens).logits for folder in (imports["windowed"].with_name("hf_windowed"), out))
    assert torch.equal(exported, source)


def test_exporting_an_old_import_whose_source_is_gone_is_refused(cli, imports, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(imports["windowed"], moved)
    recipe = moved / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace(str(imports["windowed"].with_name("hf_windowed")),
                                                 str(tmp_path / "deleted")))
    result = cli("convert-ckpt", "export-hf", str(moved), str(tmp_path / "out"))
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert f"the source folder whose config.json says the window, {tmp_path / 'deleted'}, is gone" in result.stderr
    assert f"Put the Hugging Face folder back at {tmp_path / 'deleted'}" in result.stderr
    assert not (tmp_path / "out").exists()
