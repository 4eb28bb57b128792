"""The one validate-and-derive pass: config validate, --dry-run and a run refuse the same things."""

from __future__ import annotations

import pytest

from tests.unit.test_cli_errors import assert_user_error

REFUSED = [
    (["model.num_attention_heads=5"], ["model.num_query_groups", "does not divide model.num_attention_heads (5)"]),
    (["logger.log_interval=0"], ["logger.log_interval", "must be a finite number >= 1"]),
    (["rerun_state_machine.error_injection_rate=10"],
     ["rerun_state_machine.error_injection_rate", "rerun_state_machine.rerun_mode=validate_results"]),
    (["rerun_state_machine.check_for_spiky_loss=true"],
     ["rerun_state_machine.check_for_spiky_loss", "rerun_state_machine.rerun_mode=validate_results"]),
    (["rerun_state_machine.error_injection_type=persistent_error"],
     ["rerun_state_machine.error_injection_type", "rerun_state_machine.error_injection_rate"]),
    (["rerun_state_machine.rerun_mode=validate_results", "rerun_state_machine.error_injection_rate=-1"],
     ["rerun_state_machine.error_injection_rate", "must be a finite number >= 0"]),
    (["mixed_precision=fp16_mixed", "rerun_state_machine.rerun_mode=validate_results", "--device", "cuda"],
     ["rerun_state_machine.check_for_nan_in_loss", "loss scaler's signal", "check_for_nan_in_loss=false"]),
    (["straggler.log_straggler=true", "--device", "cpu"], ["straggler.log_straggler=true needs CUDA"]),
    (["model.gradient_accumulation_fusion=true", "model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
      "--world-size", "2", "--device", "cpu"],
     ["model.gradient_accumulation_fusion=true with model.sequence_parallel=true needs CUDA",
      "model.gradient_accumulation_fusion=false"]),
    (["straggler.straggler_ctrlr_port=0", "--device", "cuda"], ["straggler.straggler_ctrlr_port", "<= 65535"]),
    (["model.num_layers=3", "model.pipeline_model_parallel_size=2", "--world-size", "2"],
     ["model.num_layers", "3 layers do not split evenly into 2 pipeline stages"]),
    (["model.ffn_hidden_size=511", "model.tensor_model_parallel_size=2", "--world-size", "2"],
     ["model.ffn_hidden_size", "not divisible by model.tensor_model_parallel_size (2)"]),
    (["scheduler.lr_decay_steps=100"], ["scheduler.lr_decay_steps", "scheduler.lr_decay_iters instead"]),
    # FSDP's combinations: tests/unit/test_fsdp_config.py
    (["model.tp_comm_overlap=true"], ["model.tp_comm_overlap", "userbuffers, which bridge does not initialize"]),
    (["model.pre_sublayer_norm=false", "model.spec=te", "--device", "cuda"],
     ["model.pre_sublayer_norm", "local and torch layer specs only", "model.spec=torch"]),
    (["model.cuda_graph_impl=local"], ["model.cuda_graph_impl", "Megatron-LM's training loop", "default ('none')"]),
    (["recipe=tiny_moe", "model.overlap_moe_expert_parallel_comm=true", "model.expert_model_parallel_size=2",
      "mixed_precision=bf16_mixed", "--world-size", "2", "--device", "cuda"],
     ["model.overlap_moe_expert_parallel_comm", "combined 1F1B schedule", "Leave it at its default (False)"]),
    (["model.hierarchical_context_parallel_sizes=[2]"],
     ["model.hierarchical_context_parallel_sizes", "a2a+p2p context parallelism", "Leave it at its default (None)"]),
    (["model.pipeline_model_parallel_comm_backend=nccl", "--device", "cpu"],
     ["model.pipeline_model_parallel_comm_backend", "NCCL needs CUDA"]),
    (["mixed_precision=bf16_mixed", "--device", "cpu"], ["model.bf16=true needs CUDA", "mixed_precision=fp32"]),
    (["model.fused_linear_cross_entropy=true", "model.fp16_lm_cross_entropy=true"],
     ["model.fp16_lm_cross_entropy", "model.fused_linear_cross_entropy replaces"]),
    (["model.fused_linear_cross_entropy=true", "model.linear_cross_entropy_chunk=0"],
     ["model.linear_cross_entropy_chunk", ">= 1"]),
]


@pytest.mark.parametrize("args, fragments", REFUSED)
def test_config_validate_and_dry_run_refuse_alike(cli, args, fragments):
    for command in (("config", "validate"), ("pretrain", "--dry-run")):
        assert_user_error(cli(*command, "recipe=tiny", *args), *fragments)


def test_a_run_refuses_what_validation_refuses(cli):
    """pretrain without --dry-run stops in the same pass, before any process group or model."""
    assert_user_error(cli("pretrain", "recipe=tiny", "rerun_state_machine.error_injection_rate=10"),
                      "rerun_state_machine.error_injection_rate")
    assert_user_error(cli("pretrain", "recipe=tiny", "model.num_attention_heads=5"), "model.num_query_groups")


def test_device_decides_what_is_refused(cli):
    gpu = cli("pretrain", "recipe=llama1b", "--dry-run", "--device", "cuda")
    assert gpu.exit_code == 0, gpu.output
    assert "device: cuda" in gpu.output
    assert_user_error(cli("config", "validate", "recipe=llama1b", "--device", "cpu"),
                      "model.bf16=true, optimizer.use_distributed_optimizer=true need CUDA", "--device cuda")
    assert_user_error(cli("pretrain", "recipe=tiny", "--device", "cuda"), "--device", "only applies with --dry-run")


def test_validation_never_writes_the_config():
    from bridge_cli.config.compose import compose
    from bridge_cli.training.config import ConfigContainer

    cfg = ConfigContainer.from_yaml_dict(compose("tiny", ["tokenizer=byte_level", "train.global_batch_size=null"]))
    before = cfg.to_dict()
    derived = cfg.validate(2, "cpu")
    assert cfg.to_dict() == before
    assert (derived.vocab_size, derived.padded_vocab_size, derived.global_batch_size) == (259, 384, 8)
    assert derived.data_parallel_size == 2 and derived.num_microbatches == 1
    assert derived.model.vocab_size == 259 and derived.model.use_cpu_initialization
    assert cfg.model.vocab_size == 1024 and not cfg.model.use_cpu_initialization
    assert derived.lr_decay_steps == cfg.train.train_iters * 8
    with pytest.raises(Exception):
        derived.world_size = 4  # frozen


def test_a_run_checks_its_config_once_and_again_only_after_a_change(monkeypatch):
    """The command validates, then pretrain() and setup() ask again for the same world and device: they reuse the
    pass. Another world size, device or value is checked anew, so nothing a later change breaks gets through."""
    from bridge_cli.config.compose import compose
    from bridge_cli.config.errors import ConfigError
    from bridge_cli.runtime.errors import RuntimeUnavailable
    from bridge_cli.training import validation
    from bridge_cli.training.config import ConfigContainer

    passes = []
    check = validation.check_unsupported
    monkeypatch.setattr(validation, "check_unsupported",
                        lambda cfg, launcher=False: (launcher or passes.append(1), check(cfg, launcher)))
    # comm_overlap's fields are written onto ddp by the pass: the second call must still see the same config
    cfg = ConfigContainer.from_yaml_dict(compose("tiny", ["comm_overlap.overlap_grad_reduce=true",
                                                          "optimizer.use_distributed_optimizer=true"]))
    first = cfg.validate(2, "cuda")
    again = cfg.validate(2, "cuda")
    assert len(passes) == 1 and again.as_dict() == first.as_dict() and cfg.ddp.overlap_grad_reduce
    assert again.model is not first.model  # megatron-core hooks a run onto its own copy
    assert again.model.vocab_size == first.model.vocab_size == 1024
    cfg.validate(1, "cuda")
    with pytest.raises(RuntimeUnavailable):
        cfg.validate(1, "cpu")  # the distributed optimizer needs CUDA
    assert len(passes) == 3
    cfg.train.micro_batch_size = 3
    with pytest.raises(ConfigError) as err:
        cfg.validate(1, "cuda")
    assert err.value.key == "train.global_batch_size" and len(passes) == 4


def test_decrease_batch_size_if_needed_rounds_the_global_batch_down():
    from bridge_cli.config.compose import compose
    from bridge_cli.training.config import ConfigContainer

    overrides = ["train.global_batch_size=14", "train.decrease_batch_size_if_needed=true"]
    derived = ConfigContainer.from_yaml_dict(compose("tiny", overrides)).validate(2, "cpu")
    assert (derived.global_batch_size, derived.num_microbatches) == (8, 1)  # micro batch 4 x DP 2


# Issue 22's values that passed validation and crashed, hung or trained silently later.
OUT_OF_RANGE = [
    ("optimizer.lr=nan", "optimizer.lr: must be a finite number >= 0, got nan"),
    ("optimizer.lr=inf", "optimizer.lr: must be a finite number"),
    ("optimizer.lr=-1e-3", "optimizer.lr: must be a finite number >= 0"),
    ("optimizer.adam_beta1=1.5", "optimizer.adam_beta1: must be a finite number >= 0 and < 1"),
    ("model.num_attention_heads=0", "model.num_attention_heads: must be a finite number >= 1"),
    ("model.hidden_dropout=2.0", "model.hidden_dropout: must be a finite number >= 0 and <= 1"),
    ("train.global_batch_size=0", "train.global_batch_size: must be a finite number >= 1"),
    ("dataset.num_workers=-1", "dataset.num_workers: must be a finite number >= 0"),
    ("rng.seed=-1", "rng.seed: must be a finite number >= 0"),
    ("train.exit_signal=99", "train.exit_signal: 99 is not a signal"),
    ("train.exit_signal=9", "SIGKILL cannot be caught"),
    ("model.seq_length=0", "model.seq_length: must be a finite number >= 1"),
    ("train.train_iters=100000000000", "train.train_iters: must be a finite number >= 1 and <= 1e+10"),
    ("dataset.split='-1,1,1'", "dataset.split: '-1,1,1' is not up to three non-negative weights"),
    ("dataset.split='abc'", "dataset.split: 'abc' is not"),
    ("dataset.split='90,8,2,5'", "dataset.split: '90,8,2,5' is not"),
]


@pytest.mark.parametrize("override, fragment", OUT_OF_RANGE)
def test_out_of_range_values_are_refused_before_any_work(cli, override, fragment):
    assert_user_error(cli("config", "validate", "recipe=tiny", override), fragment)


def test_output_folders_are_checked_before_any_work(cli, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert_user_error(cli("pretrain", "recipe=tiny", f"checkpoint.save={a_file}"),
                      f"checkpoint.save: {a_file} is a file, not a folder")
    assert_user_error(cli("config", "validate", "recipe=tiny", f"logger.tensorboard_dir={a_file}/tb"),
                      f"logger.tensorboard_dir: {a_file}/tb cannot be created: {a_file} is a file")
    assert_user_error(cli("pretrain", "recipe=tiny", f"checkpoint.load={a_file}"), f"{a_file} is a file")
    garbage = tmp_path / "ckpt"
    garbage.mkdir()
    (garbage / "latest_checkpointed_iteration.txt").write_bytes(b"\x00\xff\xfe")
    assert_user_error(cli("pretrain", "recipe=tiny", f"checkpoint.load={garbage}"),
                      "latest_checkpointed_iteration.txt: expected an iteration number")


def test_the_rerun_state_machine_is_accepted_where_megatron_core_runs_it(cli):
    from importlib.metadata import version

    ok = cli("config", "validate", "recipe=tiny", "rerun_state_machine.rerun_mode=validate_results",
             "rerun_state_machine.check_for_spiky_loss=true", "rerun_state_machine.error_injection_rate=100",
             "rerun_state_machine.error_injection_type=persistent_error")
    assert ok.exit_code == 0, ok.output
    stats = cli("config", "validate", "recipe=tiny", "rerun_state_machine.rerun_mode=report_determinism_stats")
    if tuple(int(part) for part in version("megatron-core").split(".")[:2]) < (0, 19):
        assert_user_error(stats, "rerun_state_machine.rerun_mode", "upgrade megatron-core to 0.19")
    else:
        assert stats.exit_code == 0, stats.output
