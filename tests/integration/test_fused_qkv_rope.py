"""model.fused_single_qkv_rope through `bridge pretrain` on the CPU, where Transformer Engine does not import:
megatron-core asserts at the first step when the option is set and no fused QKV RoPE is available, so a run
that trains took bridge's (bridge_cli/models/qkv_rope.py). It trains as the split and RoPE it replaces, in one
process and with the heads split over two tensor-parallel ranks."""

from __future__ import annotations

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.test_pretrain_cpu import losses

RUN = ["recipe=tiny", "train.train_iters=4", "logger.log_interval=1", "train.eval_iters=0"]
FUSED = "model.fused_single_qkv_rope=true"


@pytest.mark.slow
def test_fused_qkv_rope_trains_as_the_split_and_rope_in_one_process_and_at_tensor_parallel_two():
    runs = [bridge("pretrain", *RUN), bridge("pretrain", *RUN, FUSED),
            torchrun(2, "pretrain", *RUN, FUSED, "model.tensor_model_parallel_size=2")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    reference, fused, fused_tp2 = (losses(run.stdout) for run in runs)
    assert len(reference) == 4
    assert fused == pytest.approx(reference, rel=1e-6)
    assert fused_tp2 == pytest.approx(reference, rel=1e-5)
