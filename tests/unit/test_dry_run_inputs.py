"""--dry-run refuses what the run would (issue 42, item 4): the layer-spec rules, checked by the validation pass
instead of only as the model is built, and finetune's and eval's inputs (starting checkpoint, data, the checkpoint
to score), checked after it. Same message and exit 2 as the run, nothing written."""

from __future__ import annotations

import pytest

from tests.unit.test_cli_errors import assert_user_error


@pytest.mark.parametrize("args, fragments", [
    (["model.spec=te"], ["model.spec=te needs Transformer Engine"]),
    (["model.spec=local", "model.context_parallel_size=2", "--world-size", "2"],
     ["model.context_parallel_size=2 needs Transformer Engine's attention or the torch spec's"]),
    (["model.spec=local", "model.sdpa_backend=flash"], ["model.sdpa_backend=flash applies to the torch layer spec only"]),
    (["model.spec=foo"], ["model.spec: 'foo' is not a layer spec", "te, local, torch"]),
    (["model.spec=local", "model.multi_latent_attention=true"],
     ["model.multi_latent_attention: needs the torch or te layer spec"]),
    (["model.multi_latent_attention=true", "model.fp8=hybrid", "model.bf16=true", "model.spec=torch", "--device", "cuda"],
     ["model.fp8=hybrid with model.multi_latent_attention=true is not supported by the torch spec"]),
])
def test_dry_run_refuses_the_layer_spec_rules(cli, args, fragments):
    assert_user_error(cli("pretrain", "recipe=tiny", *args, "--dry-run"), *fragments)


def test_layer_spec_keeps_the_rules_it_shares_with_the_pass():
    """layer_spec, which builds the model, asks the same function (models/specs.py), so its words are the same."""
    from bridge_cli.models.specs import check_spec
    from bridge_cli.runtime.errors import RuntimeUnavailable

    class Model:
        sdpa_backend, context_parallel_size, multi_latent_attention = "auto", 2, False

    with pytest.raises(RuntimeUnavailable, match="the local layer spec has neither"):
        check_spec("local", Model())


def test_a_dry_run_for_another_machine_checks_an_explicit_spec_only(cli):
    """--device cuda from a CPU machine: Transformer Engine may import there, and model.spec=null picks there."""
    assert cli("pretrain", "recipe=tiny", "model.spec=te", "--dry-run", "--device", "cuda").exit_code == 0
    assert_user_error(cli("pretrain", "recipe=tiny", "model.spec=local", "model.sdpa_backend=flash", "--dry-run",
                          "--device", "cuda"), "model.sdpa_backend=flash")


def _same_refusal(cli, command: str, args: list[str], *fragments: str) -> None:
    """The dry run exits 2 with the message; the run (which checks before any work) prints the same."""
    dry = cli(command, *args, "--dry-run")
    assert_user_error(dry, *fragments)
    assert cli(command, *args).stderr == dry.stderr


def test_finetune_dry_run_refuses_the_starting_checkpoint_the_run_refuses(cli, tmp_path):
    _same_refusal(cli, "finetune", ["recipe=tiny"], "checkpoint.pretrained_checkpoint: is not set")
    _same_refusal(cli, "finetune", ["recipe=tiny_sft", f"checkpoint.pretrained_checkpoint={tmp_path}"],
                  f"checkpoint.pretrained_checkpoint={tmp_path}: no checkpoint there")
    assert list(tmp_path.iterdir()) == []


def test_finetune_dry_run_refuses_the_data_the_run_refuses(cli, tmp_path):
    resumed = f"checkpoint.load={tmp_path / 'ckpt'}"  # the data is checked before the checkpoint is read
    missing = tmp_path / "nowhere"
    _same_refusal(cli, "finetune", ["recipe=tiny_sft", resumed], "dataset.dataset_root: is not set")
    _same_refusal(cli, "finetune", ["recipe=tiny_sft", resumed, f"dataset.dataset_root={missing}"],
                  f"{missing} is not a directory")
    _same_refusal(cli, "finetune", ["recipe=tiny_sft", resumed, f"dataset.dataset_root={tmp_path}"],
                  f"{tmp_path} has no training.jsonl")
    assert list(tmp_path.iterdir()) == []


def test_finetune_dry_run_counts_on_resume(cli, tmp_path):
    """--resume auto (the default) starts from checkpoint.save's checkpoint: no pretrained checkpoint needed then."""
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("1")
    (tmp_path / "iter_0000001").mkdir()
    (tmp_path / "iter_0000001" / "metadata.json").write_text("{}")
    assert cli("finetune", "recipe=tiny", f"checkpoint.save={tmp_path}", "--dry-run").exit_code == 0
    assert_user_error(cli("finetune", "recipe=tiny", f"checkpoint.save={tmp_path}", "--dry-run", "--resume", "never"),
                      "checkpoint.pretrained_checkpoint: is not set")


def test_eval_dry_run_refuses_the_checkpoint_the_run_refuses(cli, tmp_path):
    for args, fragments in ((["recipe=tiny"], ["checkpoint.load: is not set"]),
                            (["recipe=tiny", f"checkpoint.load={tmp_path}"], [f"checkpoint.load={tmp_path}: no checkpoint"]),
                            (["recipe=tiny", f"checkpoint.load={tmp_path}", "train.eval_iters=0"],
                             ["train.eval_iters: is 0"])):
        dry = cli("eval", *args, "--dry-run")
        assert_user_error(dry, *fragments)
        assert cli("eval", *args).stderr == dry.stderr
    assert list(tmp_path.iterdir()) == []


def test_a_dry_run_for_another_machine_leaves_its_files_out(cli):
    """--device names the machine the config is for; its checkpoints and data live there."""
    assert cli("finetune", "recipe=tiny", "--dry-run", "--device", "cpu").exit_code == 0
    assert cli("eval", "recipe=tiny", "--dry-run", "--device", "cpu").exit_code == 0
