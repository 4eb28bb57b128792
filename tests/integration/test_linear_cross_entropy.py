"""model.fused_linear_cross_entropy and model.cross_entropy_fusion_impl=triton through `bridge pretrain` on the CPU:
training and validation losses are the unfused run's, in one process (tied embeddings, multi-token prediction,
chunks that do not divide the tokens) and with the vocabulary split over two tensor-parallel ranks."""

from __future__ import annotations

import re

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.test_pretrain_cpu import losses

RUN = ["recipe=tiny", "train.train_iters=4", "logger.log_interval=1", "train.eval_iters=1", "train.eval_interval=2"]
FUSED = ["model.fused_linear_cross_entropy=true", "model.linear_cross_entropy_chunk=300"]  # 512 tokens a micro-batch
TRITON = ["model.cross_entropy_loss_fusion=true", "model.cross_entropy_fusion_impl=triton"]  # its torch passes here


def curves(output: str) -> tuple[list[float], list[float]]:
    return losses(output), [float(v) for v in re.findall(r"validation[^|]*\| lm loss ([\d.]+)", output)]


@pytest.mark.slow
def test_the_fused_losses_train_as_the_unfused_one_with_multi_token_prediction():
    runs = [bridge("pretrain", *RUN, "model.mtp_num_layers=1", *extra) for extra in ([], FUSED, TRITON)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    (train, valid), *others = (curves(run.stdout) for run in runs)
    assert len(train) == 4 and len(valid) == 3
    for fused_train, fused_valid in others:
        assert fused_train == pytest.approx(train, rel=1e-6) and fused_valid == pytest.approx(valid, rel=1e-6)
    mtp = [[float(v) for v in re.findall(r"mtp_1 loss ([\d.]+)", run.stdout)] for run in runs]
    assert len(mtp[0]) == 4 and mtp[1] == pytest.approx(mtp[0], rel=1e-6) and mtp[2] == pytest.approx(mtp[0], rel=1e-6)


@pytest.mark.slow
def test_the_fused_losses_over_a_vocabulary_split_by_tensor_parallelism():
    layout = ["model.tensor_model_parallel_size=2", "model.share_embeddings_and_output_weights=false"]
    runs = [torchrun(2, "pretrain", *RUN, *layout, *extra) for extra in ([], FUSED, TRITON)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    (train, valid), *others = (curves(run.stdout) for run in runs)
    assert len(train) == 4
    for fused_train, fused_valid in others:
        assert fused_train == pytest.approx(train, rel=1e-6)
        assert fused_valid == pytest.approx(valid, rel=1e-6)


@pytest.mark.slow
def test_the_triton_loss_overwrites_soft_capped_logits_safely():
    """Its gradient takes the logits' storage; soft capping's tanh keeps its own output, not the logits, so the
    curve is the unfused one."""
    runs = [bridge("pretrain", *RUN, "model.final_logit_softcapping=30", *extra) for extra in ([], TRITON)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    (train, valid), (triton_train, triton_valid) = (curves(run.stdout) for run in runs)
    assert len(train) == 4 and triton_train == pytest.approx(train, rel=1e-6)
    assert triton_valid == pytest.approx(valid, rel=1e-6)
