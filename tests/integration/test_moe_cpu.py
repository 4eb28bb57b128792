"""MoE through the real CLI on the CPU: tiny_moe trains, and every router, load-balancing and
dispatcher choice trains with falling loss. Five short runs cover the choices between them."""

from __future__ import annotations

import re

import pytest

from tests.conftest import bridge
from tests.integration.test_pretrain_cpu import losses

# per-expert GEMMs (SequentialMLP) unless a variant asks for grouped ones, which the recipe itself trains below
SHORT = ["recipe=tiny_moe", "train.train_iters=12", "logger.log_interval=1", "train.eval_iters=0",
         "model.moe_grouped_gemm=false"]

VARIANTS = {
    # tiny_moe itself (alltoall, softmax top-2, aux_loss + z-loss, a shared expert, the first layer
    # dense) is test_moe_losses_reach_the_log_line_and_tensorboard.
    "allgather_sigmoid_expert_bias_no_balancing_local_spec": [
        "model.spec=local", "model.moe_token_dispatcher_type=allgather", "model.moe_router_score_function=sigmoid",
        "model.moe_router_enable_expert_bias=true", "model.moe_router_load_balancing_type=none",
        "model.moe_aux_loss_coeff=0", "model.moe_shared_expert_intermediate_size=null"],
    "group_limited_seq_aux_capacity_padded_overlap": [
        "model.moe_router_load_balancing_type=seq_aux_loss", "model.moe_router_num_groups=4",
        "model.moe_router_group_topk=2", "model.moe_router_topk_scaling_factor=2.0",
        "model.moe_expert_capacity_factor=1.0", "model.moe_pad_expert_input_to_capacity=true",
        "model.moe_shared_expert_overlap=true", "model.moe_layer_freq=2"],
    "allgather_dropping_two_balancing_losses_grouped_gemm": [
        "model.moe_token_dispatcher_type=allgather", "model.moe_expert_capacity_factor=0.5",
        "model.moe_router_pre_softmax=true", "model.moe_router_load_balancing_type=[aux_loss,seq_aux_loss]",
        "model.moe_aux_loss_coeff=[1e-2,1e-3]", "model.moe_z_loss_coeff=null", "model.moe_grouped_gemm=true"],
    "sinkhorn_top1_grouped_gemm": [
        "model.moe_router_load_balancing_type=sinkhorn", "model.moe_router_topk=1", "model.moe_aux_loss_coeff=0",
        "model.moe_grouped_gemm=true"],
}


@pytest.mark.slow
def test_tiny_moe_recipe_trains_and_the_loss_falls():
    result = bridge("pretrain", "recipe=tiny_moe")
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert len(curve) == 10 and curve[-1] < 0.5 * curve[0], curve
    assert "GPTModel 4 layers" in result.stdout


@pytest.mark.slow
def test_moe_losses_reach_the_log_line_and_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    result = bridge("pretrain", *SHORT, f"logger.tensorboard_dir={tmp_path}", "model.moe_per_layer_logging=true")
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert len(curve) == 12 and curve[-1] < curve[0] - 0.3, curve
    balancing = [float(v) for v in re.findall(r"\| load_balancing_loss ([0-9.]+) ", result.stdout)]
    z_losses = [float(v) for v in re.findall(r"\| z_loss ([0-9.]+) ", result.stdout)]
    assert len(balancing) == len(z_losses) == 12 and all(v > 0 for v in balancing + z_losses)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"load_balancing_loss", "z_loss", "moe/load_balancing_loss_layer_3", "moe/z_loss_layer_1"} <= tags, tags
    logged = [e.value for e in events.Scalars("load_balancing_loss")]
    assert logged == pytest.approx(balancing, rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("overrides", VARIANTS.values(), ids=VARIANTS.keys())
def test_each_router_and_dispatcher_choice_trains(overrides):
    result = bridge("pretrain", *SHORT, *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert len(curve) == 12 and curve[-1] < curve[0] - 0.3, curve
