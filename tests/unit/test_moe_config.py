"""MoE settings: list-valued fields are settable, and combinations megatron-core cannot build or train
are one-paragraph ConfigErrors naming the field, caught by `--dry-run` (no model built)."""

from __future__ import annotations

import pytest

from tests.unit.test_cli_errors import assert_user_error

MOE = ["recipe=tiny_moe", "model.moe_grouped_gemm=false"]  # per-expert GEMMs, as the rules below are about them


def test_list_valued_moe_fields_reach_megatron_core(cli):
    result = cli("pretrain", *MOE, "model.moe_router_load_balancing_type=[aux_loss,seq_aux_loss]",
                 "model.moe_aux_loss_coeff=[1e-2,1e-3]", "model.moe_layer_freq=[0,0,1,1]", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "moe_aux_loss_coeff:\n  - 0.01\n  - 0.001" in result.stdout
    assert "moe_layer_freq:\n  - 0\n  - 0\n  - 1\n  - 1" in result.stdout


@pytest.mark.parametrize("args, fragments", [
    (["model.moe_layer_freq=[0,1]"], ["model.moe_layer_freq", "one 0 (dense) or 1 (MoE) per layer"]),
    (["model.moe_layer_freq=abc"], ["model.moe_layer_freq: 'abc' is neither one int nor a list"]),
    (["model.moe_aux_loss_coeff=[0.1,0.2]"], ["model.moe_aux_loss_coeff", "one coefficient per load-balancing type"]),
    (["model.moe_router_topk=9"], ["model.moe_router_topk: 9 must be between 1 and model.num_moe_experts (8)"]),
    (["model.moe_router_load_balancing_type=foo"], ["model.moe_router_load_balancing_type: 'foo'", "seq_aux_loss"]),
    (["model.moe_router_load_balancing_type=sinkhorn"], ["sinkhorn", "model.moe_router_topk=1"]),
    (["model.moe_router_num_groups=3", "model.moe_router_group_topk=1"],
     ["model.num_moe_experts: megatron-core rejected", "model.moe_router_num_groups"]),
    (["model.moe_router_enable_expert_bias=true"], ["model.moe_router_score_function: megatron-core rejected"]),
    (["model.moe_expert_capacity_factor=1.0", "model.moe_router_load_balancing_type=sinkhorn",
      "model.moe_router_topk=1"], ["model.moe_expert_capacity_factor: megatron-core rejected"]),
    (["model.moe_pad_expert_input_to_capacity=true", "model.moe_expert_capacity_factor=1.0",
      "model.moe_token_dispatcher_type=allgather"], ["model.moe_pad_expert_input_to_capacity", "alltoall"]),
    (["model.moe_router_fusion=true"], ["model.moe_router_fusion", "Transformer Engine"]),
    (["model.moe_permute_fusion=true"], ["model.moe_permute_fusion", "Transformer Engine"]),
    (["model.moe_token_dispatcher_type=flex"], ["model.moe_token_dispatcher_type", "DeepEP"]),
    (["model.moe_grouped_gemm=true", "model.add_bias_linear=true", "model.spec=torch"],
     ["model.moe_grouped_gemm", "add_bias_linear"]),
    (["model.expert_model_parallel_size=3", "train.global_batch_size=12", "--world-size", "3"], ["model.expert_model_parallel_size: 3 does not divide"]),
    (["model.expert_model_parallel_size=4", "--world-size", "2"], ["does not divide the world size (2)"]),
    (["model.tensor_model_parallel_size=2", "--world-size", "2"], ["model.sequence_parallel", "must be true"]),
    # each TP rank's experts would learn from its own tokens only (megatron-core sums them across EP layouts)
    (["model.tensor_model_parallel_size=2", "model.sequence_parallel=true", "model.expert_tensor_parallel_size=1",
      "--world-size", "2"], ["model.expert_tensor_parallel_size: 1 is below model.tensor_model_parallel_size (2) "
                             "with model.expert_model_parallel_size=1", "model.expert_model_parallel_size to 2"]),
    # compiled MoE layers need bridge's token dispatch (megatron-core's dispatchers wait on the GPU)
    (["model.compile_layers=true"], ["model.compile_layers", "model.moe_grouped_gemm=false (SequentialMLP experts)"]),
    (["model.compile_layers=true", "model.moe_grouped_gemm=true", "model.expert_model_parallel_size=4",
      "--world-size", "4"], ["model.compile_layers", "model.expert_model_parallel_size=4 above model.moe_router_topk=2",
                             "allgather dispatcher"]),
    (["model.compile_layers=true", "model.moe_grouped_gemm=true", "model.moe_expert_capacity_factor=1.0",
      "model.moe_pad_expert_input_to_capacity=true"],
     ["model.compile_layers", "model.moe_pad_expert_input_to_capacity=true", "no padding to capacity"]),
])
def test_moe_config_errors(cli, args, fragments):
    assert_user_error(cli("pretrain", *MOE, *args, "--dry-run"), *fragments)


@pytest.mark.parametrize("layout", [[], ["model.expert_model_parallel_size=2", "--world-size", "2"],
                                    ["model.expert_model_parallel_size=4", "model.moe_token_dispatcher_type=allgather", "train.global_batch_size=16",
                                     "--world-size", "4"],
                                    ["model.expert_model_parallel_size=2", "model.moe_expert_capacity_factor=1.0",
                                     "--world-size", "2"]], ids=["local", "ep2", "ep4_allgather", "ep2_capacity"])
def test_compiled_moe_layers_pass_the_dry_run(cli, layout):
    result = cli("pretrain", *MOE, "model.compile_layers=true", "model.moe_grouped_gemm=true", *layout, "--dry-run")
    assert result.exit_code == 0, result.output
