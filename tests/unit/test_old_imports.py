"""Which recipes are imports from before import-hf mapped sliding windows, and the refusal of a model.seq_length past
their window (bridge_cli/convert/old_imports.py), on recipe folders written here; the runs, exports and re-import of
a real one: tests/integration/test_old_imports.py."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from bridge_cli.config.errors import ConfigError
from bridge_cli.convert.old_imports import check_seq_length, find

MISTRAL = {"model_type": "mistral", "vocab_size": 512, "hidden_size": 64, "intermediate_size": 160,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128}


def imported(tmp_path: Path, family: str, model: dict, sliding_window=16, source_exists: bool = True) -> Path:
    """An import-hf output folder's recipe.yaml (its header as import-hf writes it) from a source folder."""
    source, root = tmp_path / "hf", tmp_path / "import"
    if source_exists:
        source.mkdir()
        (source / "config.json").write_text(json.dumps({**MISTRAL, "model_type": family,
                                                        "sliding_window": sliding_window}))
    root.mkdir()
    (root / "recipe.yaml").write_text(
        f"# @package _global_\n# {family} imported from {source} by `bridge convert-ckpt import-hf`; training "
        f"settings from recipe tiny.\n" + yaml.safe_dump({"model": model}))
    return root


def checkpoint(root: Path, load=None) -> SimpleNamespace:
    return SimpleNamespace(pretrained_checkpoint=str(root), load=load)


def test_a_recipe_with_the_seq_length_capped_and_no_window_size_is_an_old_import(tmp_path):
    root = imported(tmp_path, "mistral", {"seq_length": 16})
    old = find(checkpoint(root))
    assert (old.family, old.seq_length, old.base_recipe, old.window()) == ("mistral", 16, "tiny", (True, 16))
    with pytest.raises(ConfigError, match=r"^model.seq_length: 17 reaches past the sliding window .* mistral's "
                                          r"sliding window is 16 tokens") as refused:
        check_seq_length(checkpoint(root), 17)
    assert f"bridge convert-ckpt import-hf {tmp_path / 'hf'} {root}_windowed --recipe tiny" in str(refused.value)
    check_seq_length(checkpoint(root), 16)  # within the window: exact


@pytest.mark.parametrize("family, model", [
    ("mistral", {"seq_length": 128, "window_size": [15, 0], "window_attn_skip_freq": [1, 1]}),  # today's, windowed
    ("mistral", {"seq_length": 128, "window_size": None}),  # today's, without a window
    ("llama", {"seq_length": 16}),  # never capped
])
def test_todays_imports_and_families_that_never_capped_are_not(tmp_path, family, model):
    root = imported(tmp_path, family, model)
    assert find(checkpoint(root)) is None
    check_seq_length(checkpoint(root), 4096)


def test_an_old_import_of_a_model_without_a_window_takes_any_length(tmp_path):
    root = imported(tmp_path, "mistral", {"seq_length": 128}, sliding_window=None)
    assert find(checkpoint(root)).window() == (True, None)
    check_seq_length(checkpoint(root), 4096)


def test_without_the_source_the_imports_length_is_the_bound(tmp_path):
    root = imported(tmp_path, "phi3", {"seq_length": 16}, source_exists=False)
    check_seq_length(checkpoint(root), 16)
    with pytest.raises(ConfigError, match="is gone, so its sliding window is unknown beyond the 16 tokens"):
        check_seq_length(checkpoint(root), 32)
