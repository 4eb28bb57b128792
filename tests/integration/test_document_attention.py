"""`bridge pretrain` with per-document masks, sliding windows, sinks and context parallelism, through the real CLI."""

from __future__ import annotations

import json

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.test_indexed_data import write_indexed_dataset
from tests.integration.test_pretrain_cpu import losses

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    prefix = str(tmp_path_factory.mktemp("documents") / "docs")
    write_indexed_dataset(prefix, documents=300, seed=0)  # 50-300 tokens each: rows of 128 hold one to three
    return prefix


def run_args(corpus: str, split: str = "100,0,0") -> list[str]:
    return ["recipe=tiny", "dataset=gpt", f"dataset.blend=[{corpus}]", f"dataset.split='{split}'",
            "model.vocab_size=1000", "train.train_iters=6", "logger.log_interval=1", "train.eval_iters=0"]


DOCUMENTS = ["dataset.reset_attention_mask=true", "dataset.reset_position_ids=true"]
WINDOWS = ["model.window_size=[16,0]", "model.window_attn_skip_freq=2"]


def test_reset_attention_mask_changes_what_the_model_sees(corpus):
    crossing = bridge("pretrain", *run_args(corpus))
    masked = bridge("pretrain", *run_args(corpus), *DOCUMENTS)
    assert crossing.returncode == 0 and masked.returncode == 0, crossing.stderr[-2000:] + masked.stderr[-2000:]
    crossing_curve, masked_curve = losses(crossing.stdout), losses(masked.stdout)
    assert len(masked_curve) == 6
    # same weights and data at iteration 1: only the attention across documents differs
    assert abs(crossing_curve[0] - masked_curve[0]) > 1e-4, (crossing_curve, masked_curve)


@pytest.fixture(scope="module")
def one_process_curve(corpus) -> list[float]:
    result = bridge("pretrain", *run_args(corpus), *DOCUMENTS, *WINDOWS, "model.softmax_type=off-by-one")
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(result.stdout)


@pytest.mark.parametrize("layout", ["model.tensor_model_parallel_size=2", "model.context_parallel_size=2"],
                         ids=["tp2", "cp2"])
def test_two_ranks_match_one_process_with_documents_windows_and_sinks(corpus, one_process_curve, layout):
    """Context parallelism: each rank holds half of every row and all-gathers the keys and values."""
    result = torchrun(2, "pretrain", *run_args(corpus), *DOCUMENTS, *WINDOWS, "model.softmax_type=off-by-one", layout,
                      env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(result.stdout) == pytest.approx(one_process_curve, rel=1e-5)


def test_context_parallel_causal_matches_one_process(corpus):
    """Plain causal layers under context parallelism (RoPE cut by megatron-core, mask by row places)."""
    one = bridge("pretrain", *run_args(corpus))
    two = torchrun(2, "pretrain", *run_args(corpus), "model.context_parallel_size=2", env={"OMP_NUM_THREADS": "1"})
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert losses(two.stdout) == pytest.approx(losses(one.stdout), rel=1e-5)


def test_learnable_sinks_reshard_across_tensor_parallel_sizes(corpus, tmp_path):
    """Sinks trained at TP=1 and saved load at TP=2 head by head: the evaluated loss is the same."""
    layout = [*run_args(corpus, split="90,10,0"), *DOCUMENTS, *WINDOWS, "model.softmax_type=learnable",
              "model.make_vocab_size_divisible_by=64"]
    trained = bridge("pretrain", *layout, f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=6")
    assert trained.returncode == 0, trained.stderr[-3000:]
    reports = {}
    for tp in (1, 2):
        output = tmp_path / f"eval_tp{tp}.json"
        args = ["eval", *layout, "train.eval_iters=2", f"checkpoint.load={tmp_path / 'ckpt'}",
                f"model.tensor_model_parallel_size={tp}", "--output", str(output)]
        result = torchrun(2, *args, env={"OMP_NUM_THREADS": "1"}) if tp == 2 else bridge(*args)
        assert result.returncode == 0, result.stderr[-3000:]
        reports[tp] = json.loads(output.read_text())["splits"]
    assert reports[2]["validation"]["lm loss"] == pytest.approx(reports[1]["validation"]["lm loss"], abs=1e-5)
