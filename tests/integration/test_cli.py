"""The `bridge` command as a user runs it: help, recipes, user recipes, dry runs.

Most run the Typer app in this process (the `cli` fixture); the subprocess tests prove the real
entry points: `--help` without torch, `python -m bridge_cli`, and a user error's exit code 2.
"""

from __future__ import annotations

import re
import sys

import pytest

from tests.conftest import REPO, _free_port, bridge, run
from tests.recipe_layouts import LLAMA8B_DISTRIBUTED_OPTIMIZER


def test_help_lists_every_command_without_importing_torch():
    result = run(sys.executable, "-c",
                 "import sys; from bridge_cli.cli.app import main; sys.argv=['bridge','--help']\n"
                 "try:\n main()\nexcept SystemExit: pass\n"
                 "assert 'torch' not in sys.modules and 'megatron' not in sys.modules, 'heavy import at start-up'")
    assert result.returncode == 0, result.stderr
    for command in ("pretrain", "finetune", "eval", "convert-ckpt", "recipes", "config"):
        assert command in result.stdout


def test_python_dash_m_works_like_the_script():
    assert "pretrain" in bridge("--help").stdout


def test_recipes_list_shows_every_shipped_recipe_with_a_description(cli):
    result = cli("recipes", "list")
    assert result.exit_code == 0
    lines = {line.split()[0]: line for line in result.stdout.splitlines()}
    assert {"tiny", "gpt2_124m", "llama1b", "llama8b"} <= set(lines)
    assert all(len(line.split(None, 1)) == 2 for line in lines.values())


def test_recipes_show_prints_the_yaml(cli):
    result = cli("recipes", "show", "llama8b")
    assert result.exit_code == 0 and "hidden_size: 4096" in result.stdout


def test_copied_recipe_is_editable_and_runs_from_a_path(cli, tmp_path):
    target = tmp_path / "my.yaml"
    assert cli("recipes", "cp", "tiny", str(target)).exit_code == 0
    target.write_text(target.read_text().replace("num_layers: 2", "num_layers: 3"))
    result = cli("pretrain", f"recipe={target}", "--dry-run")
    assert result.exit_code == 0, result.stderr
    assert "num_layers: 3" in result.stdout
    again = cli("recipes", "cp", "tiny", str(target))
    assert again.exit_code == 2 and "--force" in again.stderr


def test_recipes_dir_adds_and_shadows_recipes(cli, tmp_path):
    (tmp_path / "mine.yaml").write_text((REPO / "recipes" / "tiny.yaml").read_text().replace(
        "Tiny Llama-style", "My own").replace("hidden_size: 128", "hidden_size: 96"))
    listed = cli("recipes", "list", "--recipes-dir", str(tmp_path))
    assert "mine" in listed.stdout and "My own" in listed.stdout
    result = cli("pretrain", "recipe=mine", "--recipes-dir", str(tmp_path), "--dry-run")
    assert result.exit_code == 0 and "hidden_size: 96" in result.stdout
    env_result = cli("config", "validate", "recipe=mine", env={"BRIDGE_RECIPES_DIR": str(tmp_path)})
    assert env_result.exit_code == 0, env_result.stderr


def test_dry_run_prints_resolved_config_precedence_and_derived_values(cli):
    result = cli("pretrain", "recipe=llama8b", "train.train_iters=1000", "--dry-run", "--device", "cuda")
    assert result.exit_code == 0, result.stderr
    out = result.stdout
    assert "train_iters: 1000" in out and "hidden_size: 4096" in out and "params_dtype: bfloat16" in out
    assert "precedence: config groups (conf/) < recipe < command-line overrides" in out
    for derived in ("world_size: 1", "data_parallel_size: 1", "micro_batches_per_step: 512", "lr_decay_steps:"):
        assert derived in out


def test_dry_run_for_a_given_world_size(cli):
    result = cli("pretrain", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, "--dry-run", "--device", "cuda",
                 "--world-size", "16", "model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2")
    assert result.exit_code == 0, result.stderr
    assert "data_parallel_size: 4" in result.stdout and "micro_batches_per_step: 128" in result.stdout


@pytest.mark.parametrize("world, layout, dp", [
    (8, ["model.tensor_model_parallel_size=2"], 4),
    (8, ["model.tensor_model_parallel_size=2", "model.pipeline_model_parallel_size=2"], 2),
    (16, ["model.tensor_model_parallel_size=4", "model.pipeline_model_parallel_size=2"], 2),
    (64, ["model.tensor_model_parallel_size=8", "model.pipeline_model_parallel_size=2",
          "model.virtual_pipeline_model_parallel_size=4"], 4),
])
def test_llama8b_layouts_for_8_to_64_gpus_validate(cli, world, layout, dp):
    result = cli("pretrain", "recipe=llama8b", *LLAMA8B_DISTRIBUTED_OPTIMIZER, "--dry-run", "--device", "cuda",
                 "--world-size", str(world), *layout)
    assert result.exit_code == 0, result.output
    assert f"data_parallel_size: {dp}" in result.output and f"world_size: {world}" in result.output


def test_convert_ckpt_of_a_missing_folder_says_so_and_exits_2():
    # A process of its own: exit code 2 and nothing on stderr before the message, as a user sees it.
    result = bridge("convert-ckpt", "import-hf", "a", "b")
    assert result.returncode == 2 and result.stderr.startswith("error: a is not a folder")


def test_config_docs_shows_each_field_with_default_and_description(cli):
    result = cli("config", "docs", "train")
    assert result.exit_code == 0 and "train_iters = None" in result.stdout
    assert "Total iterations" in result.stdout or "iterations" in result.stdout.split("train_iters = None")[1].splitlines()[1]
    # A process of its own: a quiet stderr means megatron-core's import printed nothing either.
    model = bridge("config", "docs", "model")
    assert "num_layers = 0" in model.stdout and "Number of transformer layers" in model.stdout
    assert model.stderr == ""
    peft = cli("config", "docs", "peft")
    assert peft.exit_code == 0 and "dim = 32" in peft.stdout and "LoRA rank" in peft.stdout
    unknown = cli("config", "docs", "nope")
    assert unknown.exit_code == 2 and "Sections: rng" in unknown.stderr and "peft (lora)" in unknown.stderr


def test_a_config_error_under_torchrun_is_said_once_a_node_not_once_a_rank():
    """torchrun itself (not the test's fork server): local rank 0 says it and exits first, so torchrun stops rank 1
    and names rank 0 as the root cause. A quiet rank that exited at once had local rank 0 stopped before it printed
    anything, now and then (seen under the suite's load)."""
    result = run(sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                 str(_free_port()), "-m", "bridge_cli", "pretrain", "recipe=tiny", "train.global_batch_size=6",
                 "train.train_iters=2", hand_off=False)
    assert result.returncode != 0
    assert result.stderr.count("error: train.global_batch_size: 6 is not a multiple") == 1, result.stderr[-2000:]
    assert "Traceback" not in result.stderr.split("error: train.global_batch_size", 1)[0], result.stderr[-2000:]
    root = result.stderr.split("Root Cause (first observed failure):", 1)[-1]
    assert re.search(r"rank\s+: 0 \(local_rank: 0\)\s+exitcode\s+: 2 ", root), result.stderr[-2000:]
