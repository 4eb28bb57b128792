"""Expert parallelism on the CPU (gloo) under torchrun: EP=2, TP=2 (sequence parallel) x EP=2, and
expert-TP=2 x EP=2 reproduce the one-process loss curve, and a checkpoint saved under EP=2 resumes under EP=1 (with a
fresh optimizer, said in the log). Grouped-GEMM experts draw every expert's weights on every rank (CPU initialization), so
all layouts start from the same model."""

from __future__ import annotations

import re

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.test_pretrain_cpu import losses

SHORT = ["recipe=tiny_moe", "train.train_iters=12", "logger.log_interval=1", "train.eval_iters=0",
         "model.moe_grouped_gemm=true"]
# Four ranks with data parallelism 4 need a micro batch of 2; gloo has no uneven all-gather, which
# alltoall needs under expert TP, so that layout uses allgather.
FOUR_RANKS = ["train.micro_batch_size=2", "model.moe_token_dispatcher_type=allgather"]


def curve(result) -> tuple[list[float], list[float]]:
    """The loss and the grad norm (printed to 3 decimals) of every iteration."""
    assert result.returncode == 0, result.stderr[-3000:]
    values = losses(result.stdout)
    norms = [float(n) for n in re.findall(r"\| grad norm ([0-9.]+) ", result.stdout)]
    assert len(values) == len(norms) == 12
    return values, norms


def assert_same_run(layout, reference) -> None:
    assert layout[0] == pytest.approx(reference[0], rel=1e-3), (layout, reference)
    assert layout[1] == pytest.approx(reference[1], abs=2e-3), (layout, reference)  # clipping sees the same norm


@pytest.fixture(scope="module")
def one_process():
    return curve(bridge("pretrain", *SHORT))


@pytest.mark.slow
def test_expert_parallel_two_matches_one_process(one_process):
    ep2 = curve(torchrun(2, "pretrain", *SHORT, "model.expert_model_parallel_size=2"))
    assert_same_run(ep2, one_process)


@pytest.mark.slow
def test_tensor_parallel_two_by_expert_parallel_two_matches_one_process(one_process):
    layout = curve(torchrun(4, "pretrain", *SHORT, "model.tensor_model_parallel_size=2", "model.sequence_parallel=true",
                            "model.expert_model_parallel_size=2", "model.expert_tensor_parallel_size=1"))
    assert_same_run(layout, one_process)


@pytest.mark.slow
def test_expert_tensor_parallel_two_by_expert_parallel_two_matches_one_process():
    one = curve(bridge("pretrain", *SHORT, *FOUR_RANKS))
    layout = curve(torchrun(4, "pretrain", *SHORT, *FOUR_RANKS, "model.expert_model_parallel_size=2",
                            "model.expert_tensor_parallel_size=2"))
    assert_same_run(layout, one)


@pytest.mark.slow
def test_a_checkpoint_saved_under_ep2_resumes_under_ep1(one_process, tmp_path):
    """The model state reshards; the optimizer state does not (megatron-core chains a separate expert
    optimizer when EP > 1), so the resumed run starts a fresh optimizer: its first loss, computed
    before any update, equals the uninterrupted run's, and training goes on."""
    uninterrupted = one_process[0]
    root = tmp_path / "ckpt"
    first = torchrun(2, "pretrain", *SHORT, "model.expert_model_parallel_size=2", f"checkpoint.save={root}",
                     "train.exit_interval=6")
    assert first.returncode == 0, first.stderr[-3000:]
    resumed = bridge("pretrain", *SHORT, f"checkpoint.load={root}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "holds optimizer state for expert parallel x expert tensor parallel 2 x 1" in resumed.stdout
    assert "the optimizer starts fresh" in resumed.stdout
    assert f"loaded checkpoint {root}/iter_0000006" in resumed.stdout
    after = losses(resumed.stdout)
    assert len(after) == 6 and after[0] == pytest.approx(uninterrupted[6], rel=1e-3), (after, uninterrupted)
    assert after[-1] < after[0]
