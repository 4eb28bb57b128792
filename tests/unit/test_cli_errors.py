"""Every config mistake gets one short paragraph naming the key, exit code 2, and no traceback."""

from __future__ import annotations

import pytest


def assert_user_error(result, *fragments: str) -> None:
    assert result.exit_code == 2, (result.exit_code, result.output)
    text = result.stderr
    assert "Traceback" not in result.output and "Traceback" not in text
    assert text.startswith("error: ") and text.count("\n") <= 2, text
    for fragment in fragments:
        assert fragment.lower() in text.lower(), (fragment, text)


@pytest.mark.parametrize("args, fragments", [
    (["train.train_iter=5"], ["train.train_iter: unknown key", "did you mean train.train_iters"]),
    (["+train.train_iters=5"], ["train.train_iters: already exists", "Drop the '+'"]),
    (["+train.not_a_field=5"], ["train.not_a_field: unknown key"]),
    (["train.lr=0.1"], ["train.lr: unknown key", "optimizer.lr"]),
    (["optimizer.use_torch_fused_adam=false"], ["optimizer.use_torch_fused_adam: unknown key", "it was replaced",
                                                "optimizer.adam_kernel", "false foreach"]),
    (["train.train_iters=abc"], ["train.train_iters", "'abc'", "Integer"]),
    (["scheduler.lr_decay_style=cosin"], ["scheduler.lr_decay_style: 'cosin' is not allowed", "cosine"]),
    (["model.normalization=BatchNorm"], ["model.normalization", "LayerNorm, RMSNorm"]),
    (["model.params_dtype=bf16"], ["model.params_dtype", "bfloat16"]),
    (["model=lama"], ["model: no config group option 'lama'", "llama"]),
    (["recipe=tny"], ["recipe: no recipe named 'tny'", "tiny"]),
    (["recipe=./missing.yaml"], ["recipe: no recipe file at missing.yaml"]),
    (["model.tensor_model_parallel_size=3", "model.num_attention_heads=6", "model.num_query_groups=3",
      "--world-size", "4"], ["model.tensor_model_parallel_size", "does not divide the world size (4)"]),
    (["train.global_batch_size=6"], ["train.global_batch_size: 6 is not a multiple", "micro batch (4)"]),
    (["dataset.seq_length=256"], ["dataset.seq_length: 256 is longer than model.seq_length (128)"]),
    (["model.bf16=true", "model.fp16=true"], ["mutually exclusive"]),
    (["scheduler.lr_warmup_fraction=0.1", "scheduler.lr_warmup_iters=5"], ["mutually exclusive"]),
    (["profiling.use_pytorch_profiler=true", "profiling.use_nsys_profiler=true"], ["profiling."]),
    (["train.train_iters=[1"], ["cannot parse override"]),
    (["train.rampup_batch_size=[2,2,100]"], ["train.rampup_batch_size", "multiples of micro batch"]),
    # fields that did nothing without a word: the launcher's local rank, a loader built outside bridge
    (["dist.local_rank=1"], ["dist.local_rank", "LOCAL_RANK", "Leave it at its default (0)"]),
    (["dataset.dataloader_type=external"], ["dataset.dataloader_type: external", "single", "cyclic"]),
    # the override to type, not a class name
    (["dataset.blend=[a]"], ["dataset.blend", "dataset=gpt"]),
    # megatron-core's own asserts (a traceback) or a division by zero without these
    (["train.global_batch_size=32", "train.rampup_batch_size=[8,16,96]"], ["train.rampup_batch_size", "does not end at"]),
    (["train.global_batch_size=32", "train.rampup_batch_size=[32,8,96]"], ["train.rampup_batch_size", "does not end at"]),
    (["train.global_batch_size=32", "train.rampup_batch_size=[0,8,96]"], ["train.rampup_batch_size", ">= 1"]),
    (["train.global_batch_size=32", "train.rampup_batch_size=[8,8,0]"], ["train.rampup_batch_size", ">= 1"]),
])
def test_config_errors(cli, args, fragments):
    assert_user_error(cli("config", "validate", *args), *fragments)


def test_malformed_recipe_yaml_names_file_and_line(cli, tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("# @package _global_\ntrain:\n  train_iters: 5\n   micro_batch_size: [\n")
    assert_user_error(cli("config", "validate", f"recipe={bad}"), f"{bad}:4", "malformed YAML")


@pytest.mark.parametrize("text", ["", "# settings to come\n"], ids=["empty", "comment_only"])
def test_an_empty_recipe_is_named_empty(cli, tmp_path, text):
    recipe = tmp_path / "mine.yaml"
    recipe.write_text(text)
    assert_user_error(cli("config", "validate", f"recipe={recipe}"), f"recipe: {recipe} is empty",
                      "bridge recipes cp tiny")


def test_unknown_key_inside_a_recipe_names_the_recipe(cli, tmp_path):
    bad = tmp_path / "typo.yaml"
    bad.write_text("# @package _global_\ntrain:\n  train_itrs: 5\n")
    assert_user_error(cli("config", "validate", f"recipe={bad}"), "train.train_itrs: unknown key", str(bad),
                      "train.train_iters")


def test_recipe_without_package_header_works(cli, tmp_path):
    """A user's YAML needs no Hydra header line (issue 15); one naming another package is explained."""
    from bridge_cli.config.recipes import find

    plain = tmp_path / "nohead.yaml"
    tiny = find("tiny").path.read_text()
    plain.write_text(tiny.replace("# @package _global_\n", ""))
    assert "@package" not in plain.read_text()
    result = cli("pretrain", f"recipe={plain}", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "hidden_size: 128" in result.output and "normalization: RMSNorm" in result.output
    other = tmp_path / "other.yaml"
    other.write_text("# @package _group_\ntrain:\n  train_iters: 5\n")
    assert_user_error(cli("config", "validate", f"recipe={other}"), "declares '# @package _group_'", "# @package _global_")


def test_pretrain_reports_errors_the_same_way(cli):
    assert_user_error(cli("pretrain", "train.train_iter=5", "--dry-run"), "did you mean train.train_iters")


def test_debug_shows_the_traceback(cli):
    result = cli("config", "validate", "train.train_iter=5", "--debug")
    assert result.exit_code != 0 and result.exception is not None
    assert type(result.exception).__name__ == "ConfigError"


def test_valid_config_exits_zero_quietly(cli):
    result = cli("config", "validate", "recipe=tiny", "train.train_iters=10")
    assert result.exit_code == 0 and result.output == ""


def test_import_checks_an_expert_parallel_recipe_at_a_world_its_layout_fits():
    """import-hf validates the recipe it writes; mixtral_8x7b (TP=2, EP=8) fits 8 ranks, not TP x PP = 2."""
    from types import SimpleNamespace

    from bridge_cli.cli.convert_cmd import _fitting_world

    model = SimpleNamespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=1, context_parallel_size=1,
                            expert_tensor_parallel_size=1, expert_model_parallel_size=8)
    assert _fitting_world(model, 2) == 8
    dense = SimpleNamespace(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=1,
                            expert_tensor_parallel_size=None, expert_model_parallel_size=1)
    assert _fitting_world(dense, 4) == 4


@pytest.mark.parametrize("env, says", [
    ({}, True),  # one process
    ({"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "3"}, False),  # torchrun
    ({"RANK": "4", "WORLD_SIZE": "8", "LOCAL_RANK": "0"}, True),  # torchrun, a second node's first rank
    ({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1"}, False),  # srun
    ({"SLURM_PROCID": "4", "SLURM_NTASKS": "8", "SLURM_LOCALID": "0"}, True),
])
def test_a_config_error_is_said_by_each_nodes_first_rank(monkeypatch, env, says):
    from bridge_cli.cli.errors import says_it_once
    from bridge_cli.config.errors import ConfigError

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    assert says_it_once(ConfigError("train.bad", "unknown key.")) is says
    assert says_it_once(RuntimeError("out of memory")) is True  # other errors: every rank that meets them
