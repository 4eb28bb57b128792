"""torch FSDP2 (`dist.use_torch_fsdp2=true`) on the CPU: DP=2 and TP=2 x DP=2 over gloo give one process's loss
curve, and its torch_dist checkpoints resume under FSDP2 and under plain DDP, and back (docs/parallelism.md#fsdp,
docs/checkpoints.md#fsdp). Megatron-FSDP needs a GPU: tests/gpu/test_gpu_fsdp.py."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.test_checkpoint_resume import iterations, losses, ok, tracker

# fp32; FSDP2 gathers the embedding and the output layer separately, so they are not tied
ARGS = ["recipe=tiny", "train.train_iters=16", "logger.log_interval=1", "train.eval_iters=0",
        "model.share_embeddings_and_output_weights=false"]
FSDP2 = "dist.use_torch_fsdp2=true"

pytestmark = pytest.mark.slow


def assert_follows(curve: dict[int, str], reference: dict[int, str], first: int, last: int) -> None:
    assert sorted(curve) == list(range(first, last + 1)), sorted(curve)
    for i in range(first, last + 1):
        assert float(curve[i]) == pytest.approx(float(reference[i]), rel=1e-5), (i, curve[i], reference[i])


@pytest.fixture(scope="module")
def reference() -> dict[int, str]:
    """One process, plain DDP, 16 iterations uninterrupted."""
    return losses(ok(bridge("pretrain", *ARGS)))


@pytest.fixture(scope="module")
def fsdp_stopped_at_8(tmp_path_factory) -> tuple[Path, str]:
    """FSDP2 over 2 processes, stopped by train.exit_interval=8: its checkpoint folder and output."""
    root = tmp_path_factory.mktemp("fsdp2") / "ckpt"
    out = ok(torchrun(2, "pretrain", *ARGS, FSDP2, f"checkpoint.save={root}", "train.exit_interval=8"))
    return root, out


def test_two_fsdp2_processes_follow_one_process(reference, fsdp_stopped_at_8):
    _, out = fsdp_stopped_at_8
    assert "DP 2" in out
    assert_follows(losses(out), reference, 1, 8)


def test_fsdp2_checkpoint_resumes_under_fsdp2(reference, fsdp_stopped_at_8, tmp_path):
    saved, _ = fsdp_stopped_at_8
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    assert tracker(root) == "8" and iterations(root) == ["iter_0000008"]
    out = ok(torchrun(2, "pretrain", *ARGS, FSDP2, f"checkpoint.save={root}"))
    assert f"loaded checkpoint {root}/iter_0000008" in out and "optimizer starts fresh" not in out
    assert_follows(losses(out), reference, 9, 16)


def test_fsdp2_checkpoint_resumes_under_ddp_and_back(reference, fsdp_stopped_at_8, tmp_path):
    """FSDP2 x 2 (saved at 8) -> one process, plain DDP (resumes, saves at 12) -> FSDP2 x 2 (resumes to 16): the
    weights and Adam's moments go from shards to whole tensors and back."""
    saved, _ = fsdp_stopped_at_8
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    out = ok(bridge("pretrain", *ARGS, f"checkpoint.save={root}", "train.exit_interval=12"))
    assert f"loaded checkpoint {root}/iter_0000008" in out and "optimizer starts fresh" not in out
    plain = losses(out)
    out = ok(torchrun(2, "pretrain", *ARGS, FSDP2, f"checkpoint.save={root}"))
    assert f"loaded checkpoint {root}/iter_0000012" in out and "optimizer starts fresh" not in out
    assert_follows({**plain, **losses(out)}, reference, 9, 16)


def test_tensor_parallel_fsdp2_follows_one_process_and_resumes_there(reference, tmp_path):
    """TP=2 x FSDP2 over DP=2 (4 ranks: each weight's TP slice sharded again over DP) follows the one-process curve,
    and its checkpoint resumes on one process under plain DDP, the curve going on to 1e-5."""
    root = tmp_path / "ckpt"
    out = ok(torchrun(4, "pretrain", *ARGS, FSDP2, "model.tensor_model_parallel_size=2", f"checkpoint.save={root}",
                      "train.exit_interval=8"))
    assert "TP 2 x PP 1 x CP 1 x DP 2" in out
    assert_follows(losses(out), reference, 1, 8)
    out = ok(bridge("pretrain", *ARGS, f"checkpoint.save={root}"))
    assert f"loaded checkpoint {root}/iter_0000008" in out and "optimizer starts fresh" not in out
    assert_follows(losses(out), reference, 9, 16)


def test_compiled_layers_under_fsdp2_resume_its_checkpoint_and_follow_one_process(reference, fsdp_stopped_at_8,
                                                                                  tmp_path):
    """model.compile_layers=true under FSDP2 x 2 resumes the eager FSDP2 checkpoint saved at 8 and goes on along the
    one-process curve to 1e-5. Each layer is one graph, which the second layer reuses, with FSDP2's all-gather and
    reduce-scatter hooks around it, not in it: no graph break, no recompile, two graphs a rank (layer and loss)."""
    saved, _ = fsdp_stopped_at_8
    root = tmp_path / "ckpt"
    shutil.copytree(saved, root)
    result = torchrun(2, "pretrain", *ARGS, FSDP2, "model.compile_layers=true", f"checkpoint.save={root}",
                      env={"TORCH_LOGS": "dynamo,graph_breaks,recompiles"})
    out = ok(result)
    assert f"loaded checkpoint {root}/iter_0000008" in out and "optimizer starts fresh" not in out
    assert_follows(losses(out), reference, 9, 16)
    assert "Graph break" not in result.stderr and "Recompiling" not in result.stderr, result.stderr[-3000:]
    assert result.stderr.count("done compiler function inductor") == 2 * 2, result.stderr[-3000:]
