"""The comm_overlap section (Megatron-Bridge's CommOverlapConfig): every field loads, lands on the megatron-core
fields it stands for, and is refused where bridge or megatron-core would not act on it."""

from __future__ import annotations

import dataclasses
import importlib.util

import pytest
import yaml

from bridge_cli.config.comm_overlap_config import CommOverlapConfig
from tests.unit.test_cli_errors import assert_user_error

EVERY_FIELD = {
    # Transformer Engine's userbuffers: the values that leave them off (anything else is refused, below)
    "tp_comm_overlap": False,
    "tp_comm_overlap_cfg": None,
    "tp_comm_bootstrap_backend": "nccl",
    "overlap_p2p_comm": True,
    "batch_p2p_comm": False,
    "overlap_grad_reduce": True,
    "overlap_param_gather": True,
    "overlap_param_gather_with_optimizer_step": True,
    "align_param_gather": True,
    "bucket_size": 1_000_000,
    "defer_embedding_wgrad_compute": True,
    "wgrad_deferral_limit": 2,
    "data_parallel_size": 4,
    "overlap_moe_expert_parallel_comm": False,
    "delay_wgrad_compute": False,
}

LAYOUT = {  # 8 GPUs: PP 2 x 2 virtual stages x DP 4, the distributed optimizer, the fused wgrad GEMM
    "model": {"num_layers": 4, "pipeline_model_parallel_size": 2, "virtual_pipeline_model_parallel_size": 2,
              "gradient_accumulation_fusion": True},
    "optimizer": {"use_distributed_optimizer": True},
    "train": {"global_batch_size": 32},
}

EXPECTED = {
    "model.tp_comm_overlap": False, "model.tp_comm_bootstrap_backend": "nccl",
    "model.overlap_p2p_comm": True, "model.batch_p2p_comm": False,
    "ddp.overlap_grad_reduce": True, "ddp.overlap_param_gather": True, "optimizer.overlap_param_gather": True,
    "optimizer.overlap_param_gather_with_optimizer_step": True, "ddp.align_param_gather": True,
    "ddp.bucket_size": 1_000_000, "model.defer_embedding_wgrad_compute": True, "model.wgrad_deferral_limit": 2,
    "model.overlap_moe_expert_parallel_comm": False, "model.delay_wgrad_compute": False, "ddp.delay_wgrad_compute": False,
}


def recipe_with(tmp_path, comm_overlap: dict) -> str:
    """A copy of the tiny recipe with the layout above and this comm_overlap block, as a Megatron-Bridge YAML has it."""
    from bridge_cli.config.recipes import find

    recipe = yaml.safe_load(find("tiny").path.read_text())
    for section, values in LAYOUT.items():
        recipe[section].update(values)
    path = tmp_path / "overlap.yaml"
    path.write_text("# @package _global_\n" + yaml.safe_dump({**recipe, "comm_overlap": comm_overlap}, sort_keys=False))
    return str(path)


def load(recipe: str, *overrides: str):
    from bridge_cli.config.compose import compose
    from bridge_cli.training.config import ConfigContainer

    return ConfigContainer.from_yaml_dict(compose(recipe, list(overrides)))


def get(cfg, key: str):
    section, _, name = key.partition(".")
    return getattr(getattr(cfg, section), name)


def test_the_test_sets_every_field():
    assert set(EVERY_FIELD) == {f.name for f in dataclasses.fields(CommOverlapConfig)}


def test_every_field_loads_and_lands_on_its_megatron_core_field(tmp_path):
    cfg = load(recipe_with(tmp_path, EVERY_FIELD))
    assert dataclasses.asdict(cfg.comm_overlap) == EVERY_FIELD
    before = {key: get(cfg, key) for key in EXPECTED}
    assert before["ddp.overlap_grad_reduce"] is False and before["model.batch_p2p_comm"] is True
    derived = cfg.validate(8, "cuda")
    assert {key: get(cfg, key) for key in EXPECTED} == EXPECTED
    assert derived.as_dict()["comm_overlap"] == EXPECTED and derived.data_parallel_size == 4
    # the model the run builds carries them; a second pass (pretrain validates again in setup) changes nothing
    assert derived.model.overlap_p2p_comm and derived.model.defer_embedding_wgrad_compute
    assert cfg.validate(8, "cuda").as_dict() == derived.as_dict()


def test_an_unset_section_changes_nothing():
    plain, with_section = load("tiny"), load("tiny")
    plain.comm_overlap = None
    plain.validate(1, "cpu"), with_section.validate(1, "cpu")
    assert with_section.to_dict()["ddp"] == plain.to_dict()["ddp"]
    assert with_section.to_dict()["model"] == plain.to_dict()["model"]
    assert "comm_overlap" not in with_section.derived.as_dict()


def test_dry_run_shows_the_section_and_what_it_set(cli, tmp_path):
    result = cli("pretrain", f"recipe={recipe_with(tmp_path, EVERY_FIELD)}", "--dry-run", "--device", "cuda",
                 "--world-size", "8")
    assert result.exit_code == 0, result.output
    printed = yaml.safe_load(result.stdout.split("memory_per_gpu:")[0])
    assert printed["comm_overlap"] == EVERY_FIELD
    assert printed["derived"]["comm_overlap"] == EXPECTED
    assert printed["ddp"]["bucket_size"] == 1_000_000 and printed["model"]["wgrad_deferral_limit"] == 2


@pytest.mark.skipif(importlib.util.find_spec("transformer_engine") is not None, reason="Transformer Engine imports here")
@pytest.mark.parametrize("override, key", [
    ("comm_overlap.tp_comm_overlap=true", "comm_overlap.tp_comm_overlap"),
    ("comm_overlap.tp_comm_overlap_cfg={qkv_dgrad:{method:bulk,num_sm:4,cga_size:2,set_sm_margin:false}}",
     "comm_overlap.tp_comm_overlap_cfg"),
    ("comm_overlap.tp_comm_bootstrap_backend=mpi", "comm_overlap.tp_comm_bootstrap_backend"),
])
def test_transformer_engine_fields_are_refused_without_it(cli, override, key):
    result = cli("pretrain", "recipe=tiny", "--dry-run", "model.tensor_model_parallel_size=2",
                 "model.sequence_parallel=true", "--world-size", "2", "--device", "cuda", override)
    assert_user_error(result, key, "Transformer Engine's userbuffers", "transformer_engine does not import here")


def test_a_megatron_bridge_userbuffer_layout_loads_and_is_refused_by_validation(tmp_path):
    ub = {"_target_": "megatron.bridge.training.comm_overlap.TransformerLayerTPOverlapCfg",
          "qkv_dgrad": {"method": "bulk", "num_sm": 4, "cga_size": 2, "set_sm_margin": False}, "qkv_wgrad": None}
    cfg = load(recipe_with(tmp_path, {"tp_comm_overlap": True, "tp_comm_overlap_cfg": ub}))
    assert cfg.comm_overlap.tp_comm_overlap_cfg == ub
    from bridge_cli.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        cfg.validate(8, "cuda")
    assert err.value.key == "comm_overlap.tp_comm_overlap"


@pytest.mark.parametrize("overrides, fragments", [
    (["comm_overlap.overlap_grad_reduce=true"],
     ["comm_overlap.overlap_grad_reduce", "only with the distributed optimizer", "ddp.overlap_grad_reduce instead"]),
    (["comm_overlap.overlap_param_gather=true"], ["comm_overlap.overlap_param_gather", "distributed optimizer"]),
    (["optimizer.use_distributed_optimizer=true", "ddp.overlap_grad_reduce=true", "comm_overlap.overlap_grad_reduce=false"],
     ["comm_overlap.overlap_grad_reduce", "false contradicts ddp.overlap_grad_reduce=true"]),
    (["optimizer.use_distributed_optimizer=true", "comm_overlap.bucket_size=1000"],
     ["comm_overlap.bucket_size", "comm_overlap.overlap_grad_reduce=true"]),
    (["optimizer.use_distributed_optimizer=true", "comm_overlap.align_param_gather=true"],
     ["comm_overlap.align_param_gather", "comm_overlap.overlap_param_gather=true"]),
    (["optimizer.use_distributed_optimizer=true", "comm_overlap.overlap_param_gather=true",
      "comm_overlap.overlap_param_gather_with_optimizer_step=true"],
     ["comm_overlap.overlap_param_gather_with_optimizer_step", "virtual_pipeline_model_parallel_size"]),
    (["comm_overlap.overlap_p2p_comm=true"], ["comm_overlap.overlap_p2p_comm", "interleaved pipeline schedule"]),
    (["model.num_layers=4", "model.pipeline_model_parallel_size=2", "model.virtual_pipeline_model_parallel_size=2",
      "comm_overlap.overlap_p2p_comm=true", "comm_overlap.batch_p2p_comm=true"],
     ["comm_overlap.overlap_p2p_comm", "cannot run with batch_p2p_comm"]),
    (["model.gradient_accumulation_fusion=true", "comm_overlap.defer_embedding_wgrad_compute=true"],
     ["comm_overlap.defer_embedding_wgrad_compute", "model.pipeline_model_parallel_size > 1"]),
    (["comm_overlap.wgrad_deferral_limit=3"], ["comm_overlap.wgrad_deferral_limit", "defer_embedding_wgrad_compute=true"]),
    (["comm_overlap.data_parallel_size=4"], ["comm_overlap.data_parallel_size", "this run's data-parallel size (8"]),
    (["comm_overlap.bucket_size=0"], ["comm_overlap.bucket_size", "must be >= 1"]),
    (["comm_overlap.overlap_moe_expert_parallel_comm=true"],
     ["comm_overlap.overlap_moe_expert_parallel_comm", "combined 1F1B schedule", "return_schedule_plan"]),
    (["comm_overlap.delay_wgrad_compute=true"], ["comm_overlap.delay_wgrad_compute", "combined 1F1B schedule"]),
])
def test_a_field_that_would_do_nothing_here_is_refused(cli, overrides, fragments):
    result = cli("config", "validate", "recipe=tiny", "train.global_batch_size=32", "--world-size", "8",
                 "--device", "cuda", *overrides)
    assert_user_error(result, *fragments)


def test_a_field_equal_to_its_target_is_accepted_without_the_distributed_optimizer():
    """Megatron-Bridge drops its data-parallel fields without the distributed optimizer; one that changes nothing
    is no surprise, so it loads."""
    cfg = load("tiny", "ddp.overlap_grad_reduce=true", "comm_overlap.overlap_grad_reduce=true",
               "comm_overlap.overlap_param_gather=false")
    cfg.validate(1, "cpu")
    assert cfg.ddp.overlap_grad_reduce and not cfg.ddp.overlap_param_gather
