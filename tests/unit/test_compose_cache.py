"""The cache of composed configs: a launch reads back what composing gives, and never a stale one."""

from __future__ import annotations

import shutil

import pytest
from omegaconf import OmegaConf

from bridge_cli.config import compose as compose_module
from bridge_cli.config import compose_cache, recipes
from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("BRIDGE_CONFIG_CACHE", "on")  # tests/conftest.py turns it off for the other tests
    return tmp_path / "cache" / "bridge" / "config"


def entries(folder) -> list:
    return sorted(folder.glob("*.json")) if folder.exists() else []


@pytest.mark.parametrize("recipe, overrides", [
    ("tiny", []),
    ("tiny", ["peft=lora", "train.train_iters=3", "model.hidden_size=64"]),
    ("tiny", ["mixed_precision=bf16_mixed", "dataset=gpt", "dataset.blend=[data/a]"]),
    ("llama1b", ["model.seq_length=4096"]),
    ("moe_proxy", []),
    ("deepseek_proxy", []),
])
def test_a_kept_config_is_the_composed_one(recipe, overrides, cache_home):
    composed = compose(recipe, overrides, keep=True)
    assert len(entries(cache_home)) == 1
    kept = compose(recipe, overrides, keep=True)
    assert len(entries(cache_home)) == 1  # read, not written again
    assert OmegaConf.to_container(kept, resolve=True) == OmegaConf.to_container(composed, resolve=True)
    for section in composed:
        if OmegaConf.is_config(composed[section]) and section not in ("model", "optimizer", "ddp"):
            assert OmegaConf.get_type(kept[section]) is OmegaConf.get_type(composed[section]), section
    assert ConfigContainer.from_yaml_dict(kept).to_dict() == ConfigContainer.from_yaml_dict(composed).to_dict()


def test_an_edited_recipe_composes_again(tmp_path, cache_home):
    recipe = tmp_path / "mine.yaml"
    shutil.copy(recipes.find("tiny").path, recipe)
    assert compose(str(recipe), [], keep=True).train.train_iters == 100
    recipe.write_text(recipe.read_text().replace("train_iters: 100", "train_iters: 37"))
    assert compose(str(recipe), [], keep=True).train.train_iters == 37
    assert len(entries(cache_home)) == 2
    assert compose(str(recipe), ["train.train_iters=5"], keep=True).train.train_iters == 5


def test_an_edited_config_group_file_composes_again(tmp_path, monkeypatch, cache_home):
    conf = tmp_path / "conf"
    shutil.copytree(recipes.conf_dir(), conf)
    monkeypatch.setattr(recipes, "conf_dir", lambda: conf)
    compose_module._compose_defaults.cache_clear()  # this process's own cache holds the shipped conf/'s
    try:
        assert compose("tiny", [], keep=True).optimizer.weight_decay == 0.1
        adam = conf / "optimizer" / "adam.yaml"
        adam.write_text(adam.read_text().replace("weight_decay: 0.1", "weight_decay: 0.25"))
        compose_module._compose_defaults.cache_clear()
        assert compose("tiny", [], keep=True).optimizer.weight_decay == 0.25
    finally:
        compose_module._compose_defaults.cache_clear()


def test_a_value_read_from_the_environment_is_never_kept(monkeypatch, cache_home):
    overrides = ["train.train_iters=${oc.env:BRIDGE_TEST_ITERS}"]
    monkeypatch.setenv("BRIDGE_TEST_ITERS", "5")
    assert compose("tiny", overrides, keep=True).train.train_iters == 5
    monkeypatch.setenv("BRIDGE_TEST_ITERS", "7")
    assert compose("tiny", overrides, keep=True).train.train_iters == 7
    assert entries(cache_home) == []


def test_an_unreadable_entry_is_composed_again(cache_home):
    compose("tiny", [], keep=True)
    (entry,) = entries(cache_home)
    entry.write_text('{"format": 1, "types": {"train": "section:nothing"}, "values": {"train": {}}}')
    assert compose("tiny", [], keep=True).train.train_iters == 100
    entry.write_text("{not json")
    assert compose("tiny", [], keep=True).train.train_iters == 100


def test_without_keep_nothing_is_kept(cache_home):
    compose("tiny", [])
    assert entries(cache_home) == []


def test_a_folder_that_cannot_be_written_keeps_nothing(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker))  # a file where the folder would go
    assert compose("tiny", [], keep=True).train.train_iters == 100
    assert compose("tiny", [], keep=True).train.train_iters == 100


def test_the_cli_keeps_the_config_of_a_launch(cli, cache_home):
    result = cli("pretrain", "recipe=tiny", "train.train_iters=3", "--dry-run")
    assert result.exit_code == 0, result.output
    assert len(entries(cache_home)) == 1
    again = cli("pretrain", "recipe=tiny", "train.train_iters=3", "--dry-run")
    assert again.exit_code == 0 and again.stdout == result.stdout


def test_bridge_config_cache_off_keeps_nothing(cache_home, monkeypatch):
    monkeypatch.setenv("BRIDGE_CONFIG_CACHE", "off")
    assert compose("tiny", [], keep=True).train.train_iters == 100
    assert entries(cache_home) == []
