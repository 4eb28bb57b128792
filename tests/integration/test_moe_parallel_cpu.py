"""Expert parallelism on the CPU (gloo) under torchrun: EP=2, TP=2 (sequence parallel) x EP=2, and
expert-TP=2 x EP=2 reproduce the one-process loss curve, and a checkpoint saved under one expert layout (EP 2 -> 1,
1 -> 2, expert TP 2 -> 1) resumes under another with its Adam moments, continuing the uninterrupted curve.
Grouped-GEMM experts draw every expert's weights on every rank (CPU initialization), so all layouts start from the
same model."""

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


def assert_same_run(layout, reference, rel: float = 1e-5) -> None:
    assert layout[0] == pytest.approx(reference[0], rel=rel), (layout, reference)
    assert layout[1] == pytest.approx(reference[1], abs=2e-3), (layout, reference)  # clipping sees the same norm


@pytest.fixture(scope="module")
def one_process():
    result = bridge("pretrain", *SHORT)
    assert "ep load" not in result.stdout  # every expert on the one rank: nobody waits on another
    return curve(result)


@pytest.mark.slow
def test_expert_parallel_two_matches_one_process(one_process):
    result = torchrun(2, "pretrain", *SHORT, "model.expert_model_parallel_size=2")
    assert_same_run(curve(result), one_process)
    # the busiest of the 2 ranks' expert work over their mean: between an even 1 and all of it on one rank (2)
    loads = [float(x) for x in re.findall(r"\| ep load max/mean ([0-9.]+) \|", result.stdout)]
    assert len(loads) == 12 and all(1.0 <= x <= 2.0 for x in loads), result.stdout[-2000:]


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
    assert_same_run(layout, one, rel=1e-4)  # the experts' FFN split in two sums in another order: 1.2e-5 at step 12


EP2 = ["model.expert_model_parallel_size=2"]
TP2 = ["model.tensor_model_parallel_size=2", "model.sequence_parallel=true"]  # expert TP follows TP: 2


@pytest.mark.slow
@pytest.mark.parametrize("saved, resumed", [((2, EP2), (1, [])), ((1, []), (2, EP2)), ((2, TP2), (1, []))],
                         ids=["ep2_to_ep1", "ep1_to_ep2", "expert_tp2_to_1"])
def test_a_checkpoint_resumes_under_another_expert_layout_with_its_adam_moments(one_process, tmp_path, saved,
                                                                                   resumed):
    """megatron-core keeps the expert weights' optimizer state in a separate optimizer when EP > 1, whose state
    dict does not load under another expert layout; bridge loads the Adam moments weight by weight, so the
    resumed run continues the uninterrupted one (a fresh optimizer moves the loss by far more than 1e-4)."""
    root = tmp_path / "ckpt"
    first = _launch(*saved, f"checkpoint.save={root}", "train.exit_interval=6")
    assert first.returncode == 0, first.stderr[-3000:]
    after = _launch(*resumed, f"checkpoint.save={root}")
    assert after.returncode == 0, after.stderr[-3000:]
    assert "loading its Adam moments weight by weight into this run's layout" in after.stdout
    assert f"loaded checkpoint {root}/iter_0000006" in after.stdout
    assert losses(after.stdout) == pytest.approx(one_process[0][6:], rel=1e-4)


def _launch(ranks: int, layout: list, *overrides: str):
    if ranks == 1:
        return bridge("pretrain", *SHORT, *layout, *overrides)
    return torchrun(ranks, "pretrain", *SHORT, *layout, *overrides)
