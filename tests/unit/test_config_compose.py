"""Composition: every shipped recipe, the precedence rule, presets, and the megatron-core schema."""

from __future__ import annotations

import pytest

from bridge_cli.config import recipes
from bridge_cli.config.compose import compose
from bridge_cli.runtime.parallel_layout import model_world_step
from bridge_cli.training.config import ConfigContainer
from tests.recipe_layouts import LLAMA8B_DISTRIBUTED_OPTIMIZER


def container(recipe: str, *overrides: str, world_size: int = 1) -> ConfigContainer:
    c = ConfigContainer.from_yaml_dict(compose(recipe, list(overrides)))
    c.validate(world_size, device="cuda")  # the config rules, checked as for a GPU machine (the recipes' target)
    return c


def smallest_world(name: str) -> int:
    """The fewest processes the recipe's parallel layout fits (1 for the single-device recipes)."""
    return model_world_step(ConfigContainer.from_yaml_dict(compose(name, [])).model)


@pytest.mark.parametrize("name", sorted(recipes.available()))
def test_every_shipped_recipe_composes_and_validates(name):
    c = container(name, world_size=smallest_world(name))
    assert c.model.num_layers > 0 and c.train.train_iters > 0
    assert recipes.available()[name].description, f"{name} needs a one-line description comment"


def test_shipped_recipes_reach_no_network():
    for recipe in recipes.available().values():
        text = recipe.path.read_text()
        assert "http" not in text and "hf://" not in text, recipe.path


def test_precedence_group_defaults_then_recipe_then_command_line():
    default_decay = container("tiny", "scheduler=default")  # recipe sets cosine over the group default
    assert default_decay.scheduler.lr_decay_style == "cosine"
    assert container("tiny").optimizer.lr == 3.0e-3  # recipe beats optimizer/adam.yaml's 3e-4
    assert container("tiny", "optimizer.lr=0.5").optimizer.lr == 0.5  # command line beats recipe


def test_a_group_set_to_null_turns_it_off():
    """``peft=null`` on the command line is Hydra's ``~peft`` (Hydra itself stops on it with a traceback)."""
    assert compose("llama8b_dpo_lora", []).peft is not None  # the recipe picks LoRA
    assert compose("llama8b_dpo_lora", ["peft=null"]).peft is None
    assert compose("llama8b_dpo_lora", ["~peft"]).peft is None
    assert compose("tiny_sft", ["peft=null"]).peft is None  # off already


def test_a_layer_beneath_the_command_line_decided_from_the_composed_config():
    """A Hugging Face folder's config.json goes between the recipe and the command line; which folder is known only
    once the recipe and the command line are composed. The layer sees that config, wins over the recipe, loses to
    the command line, and what follows its values by interpolation (dataset.seq_length) follows them."""
    seen = []

    def layer(cfg):
        seen.append(cfg.checkpoint.pretrained_checkpoint)
        return ["model.seq_length=64", "model.hidden_size=96", "model.num_layers=3"]

    cfg = compose("tiny", ["checkpoint.pretrained_checkpoint=/hf", "model.num_layers=5"], beneath=layer)
    assert seen == ["/hf"]
    assert (cfg.model.seq_length, cfg.dataset.seq_length, cfg.model.hidden_size) == (64, 64, 96)
    assert cfg.model.num_layers == 5 and cfg.checkpoint.pretrained_checkpoint == "/hf"
    assert compose("tiny", [], beneath=lambda cfg: []).model.hidden_size == 128  # no layer: the recipe's


def test_mixed_precision_preset_expands_but_never_overrides_the_user():
    bf16 = container("tiny", "mixed_precision=bf16_mixed")
    assert bf16.model.bf16 and bf16.optimizer.bf16 and str(bf16.model.params_dtype) == "torch.bfloat16"
    assert bf16.ddp.grad_reduce_in_fp32
    user = container("tiny", "mixed_precision=bf16_mixed", "ddp.grad_reduce_in_fp32=false")
    assert user.model.bf16 and not user.ddp.grad_reduce_in_fp32


def test_recipe_value_beats_preset(tmp_path):
    text = recipes.find("tiny").path.read_text()
    text = text.replace("  - override /dataset: mock\n", "  - override /dataset: mock\n  - override /mixed_precision: bf16_mixed\n")
    text += "ddp:\n  grad_reduce_in_fp32: false\n"
    path = tmp_path / "mine.yaml"
    path.write_text(text)
    c = ConfigContainer.from_yaml_dict(compose(str(path), []))
    assert c.model.bf16 and not c.ddp.grad_reduce_in_fp32


def test_composing_again_in_one_process_sees_an_edited_recipe_and_none_of_the_last_overrides(tmp_path):
    # the defaults list's composition is kept per recipe text and group options (config/compose.py)
    path = tmp_path / "mine.yaml"
    path.write_text(recipes.find("tiny").path.read_text())
    first = compose(str(path), ["optimizer.lr=0.5"])
    assert first.optimizer.lr == 0.5
    first.train.train_iters = 7  # a caller's edit of its config reaches no later compose
    again = compose(str(path), [])
    assert again.optimizer.lr == 3.0e-3 and again.train.train_iters != 7
    path.write_text(path.read_text().replace("lr: 3.0e-3", "lr: 2.0e-3"))
    assert compose(str(path), []).optimizer.lr == 2.0e-3
    assert compose(str(path), ["optimizer=sgd"]).optimizer.optimizer == "sgd"
    assert compose(str(path), []).optimizer.optimizer == "adam"


def test_megatron_core_fields_settable_by_name_and_resolved():
    c = container("tiny", "model.init_method_std=0.01", "model.activation_func=gelu", "optimizer.adam_beta2=0.99",
                  "ddp.bucket_size=1000")
    import torch.nn.functional as F

    assert c.model.init_method_std == 0.01 and c.model.activation_func is F.gelu
    assert c.optimizer.adam_beta2 == 0.99 and c.ddp.bucket_size == 1000


def test_derived_values_for_a_large_world():
    c = container("llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, "train.train_iters=1000",
                  "model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2", world_size=64)
    assert c.data_parallel_size == 16
    assert c.num_microbatches == 512 // 16
    assert c.derived.lr_decay_steps == c.scheduler.lr_decay_iters * 512
    assert c.derived.lr_warmup_steps == 2000 * 512


def test_to_dict_spells_dtypes_and_functions_by_name():
    values = container("tiny", "train.train_iters=33").to_dict()
    assert values["model"]["activation_func"] == "silu" and values["model"]["params_dtype"] == "float32"
    assert values["train"]["train_iters"] == 33 and values["dataset"]["seq_length"] == 128


def test_the_sections_are_the_same_in_the_schema_the_container_and_the_primary_config():
    """Three lists of sections exist for three readers (the schema, the dataclass, Hydra's defaults list):
    adding a section to one and not the others fails here, not at a user's first run."""
    import dataclasses

    import yaml

    import typing

    from bridge_cli.config.schema import SECTIONS, mcore_sections
    from tests.conftest import REPO

    container = {f.name for f in dataclasses.fields(ConfigContainer) if f.init} - {"mixed_precision"}
    defaults = yaml.safe_load((REPO / "conf" / "config.yaml").read_text())["defaults"]
    groups = {next(iter(entry)) for entry in defaults if isinstance(entry, dict)}
    groups -= {"mixed_precision", "optional recipe"}
    assert set(SECTIONS) | set(mcore_sections()) | {"dataset", "peft"} == container == groups
    # and each section's class is the schema's: the container declares the schema's list, it does not keep its own
    types = typing.get_type_hints(ConfigContainer)
    for name, cls in {**SECTIONS, **mcore_sections()}.items():
        assert cls in (types[name], *typing.get_args(types[name])), (name, types[name], cls)
