"""Multi-token prediction (``model.mtp_num_layers``, DeepSeek-V3's MTP) on the CPU: megatron-core's MTP
block trains next to the decoder, each depth's loss is on the log line, tensor parallelism reproduces
the one-process curves (with MoE layers under sequence parallelism too, and the deepseek_v3 recipe at a CPU's
size on the torch spec), and its weights go through a checkpoint."""

from __future__ import annotations

import re

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.test_pretrain_cpu import losses

pytestmark = pytest.mark.slow

RUN = ["recipe=tiny", "model.mtp_num_layers=2", "train.train_iters=6", "logger.log_interval=1", "train.eval_iters=0"]


def mtp_losses(output: str) -> list[tuple[float, float]]:
    return [(float(a), float(b)) for a, b in re.findall(r"\| mtp_1 loss ([0-9.]+) \| mtp_2 loss ([0-9.]+) ", output)]


def flat(pairs: list[tuple[float, float]]) -> list[float]:
    """pytest.approx compares flat sequences only (newer pytest refuses nested ones)."""
    return [x for pair in pairs for x in pair]


@pytest.fixture(scope="module")
def one_process():
    result = bridge("pretrain", *RUN)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def test_mtp_layers_train_and_log_each_depth(one_process):
    curve, mtp = losses(one_process), mtp_losses(one_process)
    assert len(curve) == len(mtp) == 6
    assert curve[-1] < curve[0] and mtp[-1][0] < mtp[0][0] and mtp[-1][1] < mtp[0][1]
    plain = bridge("pretrain", *RUN[:1], *RUN[2:])
    assert plain.returncode == 0 and "mtp_1" not in plain.stdout
    assert losses(plain.stdout)[0] == curve[0]  # the main loss before any update: the same decoder
    assert losses(plain.stdout)[-1] != curve[-1]  # after some: the MTP losses' gradients reached it


def test_tensor_parallel_two_reproduces_the_mtp_curves(one_process):
    result = torchrun(2, "pretrain", *RUN, "model.tensor_model_parallel_size=2")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(result.stdout) == pytest.approx(losses(one_process), rel=1e-4)
    assert flat(mtp_losses(result.stdout)) == pytest.approx(flat(mtp_losses(one_process)), rel=1e-4)


def test_mtp_weights_resume_from_a_checkpoint(one_process, tmp_path):
    first = bridge("pretrain", *RUN, f"checkpoint.save={tmp_path}", "train.exit_interval=3")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = bridge("pretrain", *RUN, f"checkpoint.save={tmp_path}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert flat(mtp_losses(resumed.stdout)) == pytest.approx(flat(mtp_losses(one_process)[3:]), rel=1e-5)


MOE = ["recipe=tiny_moe", "model.moe_grouped_gemm=true", "model.mtp_num_layers=1", "train.train_iters=6",
       "logger.log_interval=1", "train.eval_iters=0"]
# deepseek_v3 at a CPU's size: multi-latent attention, group-limited sigmoid routing with a shared expert, MTP
DEEPSEEK = ["recipe=deepseek_v3", "model.spec=torch", "mixed_precision=fp32", "model.num_layers=2", "model.hidden_size=64",
            "model.ffn_hidden_size=128", "model.num_attention_heads=4", "model.num_query_groups=4", "model.q_lora_rank=32",
            "model.kv_lora_rank=16", "model.qk_head_dim=16", "model.qk_pos_emb_head_dim=8", "model.v_head_dim=16",
            "model.vocab_size=256", "model.seq_length=64", "model.original_max_position_embeddings=64",
            "model.num_moe_experts=8", "model.moe_router_topk=2", "model.moe_ffn_hidden_size=32",
            "model.moe_shared_expert_intermediate_size=32", "model.moe_layer_freq=[0,1]", "model.moe_router_num_groups=2",
            "model.moe_router_group_topk=1", "model.pipeline_model_parallel_size=1",
            "model.num_layers_in_first_pipeline_stage=null", "model.num_layers_in_last_pipeline_stage=null",
            "model.expert_model_parallel_size=1", "model.gradient_accumulation_fusion=false",
            "optimizer.use_distributed_optimizer=false", "train.global_batch_size=8", "train.train_iters=4",
            "train.eval_iters=0", "logger.log_interval=1", "scheduler.lr_warmup_iters=1", "model.use_cpu_initialization=true"]
TP2_SP = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]


@pytest.mark.parametrize("run, one_process_layout", [
    (MOE, []),
    (DEEPSEEK, ["model.tensor_model_parallel_size=1", "model.sequence_parallel=false"]),
], ids=["tiny_moe", "deepseek_v3"])
def test_mtp_trains_under_sequence_parallelism_with_moe_layers(run, one_process_layout):
    """MoE layers need sequence parallelism at TP > 1, and megatron-core's MTP layer on the torch spec built norms
    that refuse it; with bridge's norms in the MTP block both losses follow one process."""
    one = bridge("pretrain", *run, *one_process_layout)
    tp2 = torchrun(2, "pretrain", *run, *TP2_SP, "model.expert_tensor_parallel_size=2")
    assert one.returncode == 0, one.stderr[-3000:]
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    assert losses(tp2.stdout) == pytest.approx(losses(one.stdout), rel=1e-4)
    first_depth = [float(x) for x in re.findall(r"\| mtp_1 loss ([0-9.]+) ", tp2.stdout)]
    assert len(first_depth) == len(losses(one.stdout))
    assert first_depth == pytest.approx([float(x) for x in re.findall(r"\| mtp_1 loss ([0-9.]+) ", one.stdout)],
                                        rel=1e-4)
