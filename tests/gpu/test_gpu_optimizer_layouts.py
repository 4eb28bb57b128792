"""The distributed optimizer's Adam state follows a change of layout on 2 GPUs (docs/checkpoints.md): a run saves
``fully_reshardable`` (``checkpoint.dist_ckpt_optim_fully_reshardable=true``) at iteration 6 under layout A, another resumes it under layout B and saves at 9, a third
resumes that under A to 12; all 6 resumed losses equal the uninterrupted run's under A to 1e-3 (fp32, so bf16's
rounding does not hide a fresh optimizer), and no log says the optimizer starts fresh.

    python -m pytest -q -n 0 tests/gpu/test_gpu_optimizer_layouts.py
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import torchrun
from tests.integration.test_pretrain_cpu import losses

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]

COMMON = ["train.train_iters=12", "logger.log_interval=1", "train.eval_iters=0", "mixed_precision=fp32",
          "optimizer.use_distributed_optimizer=true", "checkpoint.dist_ckpt_optim_fully_reshardable=true"]
# the small recipes the CPU resume tests use, which the GPU tests run in fp32 too (test_gpu_rerun)
DENSE = ["recipe=tiny", *COMMON]
MOE = ["recipe=tiny_moe", "model.moe_grouped_gemm=true", *COMMON]
TOLERANCE = 1e-3
"""fp32: another layout sums its products in another order, which moves the losses by far less; Adam's moments
starting from zero move them by far more."""


@pytest.mark.parametrize("run, layout_a, layout_b", [
    (DENSE, ["model.tensor_model_parallel_size=2"], []),
    (DENSE, ["model.pipeline_model_parallel_size=2"], []),
    (MOE, ["model.expert_model_parallel_size=2"], []),
], ids=["TP2-DP2", "PP2-DP2", "EP2-EP1"])
def test_adam_state_follows_a_change_of_layout_and_back(tmp_path, run, layout_a, layout_b):
    """A (straight, saving at 6) -> B (6 to 9) -> A (9 to 12); B is data parallel 2 on the same 2 GPUs."""
    first, second = tmp_path / "a", tmp_path / "b"
    straight = torchrun(2, "pretrain", *run, *layout_a, f"checkpoint.save={first}", "checkpoint.save_interval=6")
    assert straight.returncode == 0, straight.stdout[-2000:] + straight.stderr[-3000:]
    there = torchrun(2, "pretrain", *run, *layout_b, f"checkpoint.load={first}", "checkpoint.ckpt_step=6",
                     f"checkpoint.save={second}", "train.exit_interval=9")
    assert there.returncode == 0, there.stdout[-2000:] + there.stderr[-3000:]
    back = torchrun(2, "pretrain", *run, *layout_a, f"checkpoint.save={second}")
    assert back.returncode == 0, back.stdout[-2000:] + back.stderr[-3000:]
    for result in (there, back):
        assert "optimizer starts fresh" not in result.stdout, result.stdout[-3000:]
        assert "resharding it to this run's layout" in result.stdout, result.stdout[-3000:]
    assert f"loaded checkpoint {first}/iter_0000006" in there.stdout
    assert f"loaded checkpoint {second}/iter_0000009" in back.stdout
    whole, resumed = losses(straight.stdout), losses(there.stdout) + losses(back.stdout)
    assert len(whole) == 12 and len(resumed) == 6, (whole, resumed)
    assert resumed == pytest.approx(whole[6:], rel=TOLERANCE), (resumed, whole[6:])
