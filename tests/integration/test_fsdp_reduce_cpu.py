"""ddp.grad_reduce_in_fp32 reaches torch FSDP2 (dist.use_torch_fsdp2=true): 4 gloo processes, a bf16 model
(fsdp_reduce_worker.py). With it, every FSDP2 unit reduce-scatters in fp32 and each gradient is the correctly rounded
average of the ranks' bf16 gradients; without it, FSDP2 sums them in bf16 and about a fifth of the elements are
farther off (which is what the field used to give silently, megatron-core's FSDP2 wrapper setting no policy)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO, python

WORKER = Path(__file__).with_name("fsdp_reduce_worker.py")
ENV = {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

pytestmark = pytest.mark.slow


def measure(tmp_path: Path, *flags: str) -> list[dict]:
    result = python(str(WORKER), "--out", str(tmp_path), *flags, nproc=4, env=ENV, timeout=400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(4)]


def test_grad_reduce_in_fp32_makes_fsdp2_average_in_fp32(tmp_path):
    for rank in measure(tmp_path, "--fp32-reduce"):
        assert rank["reduce_dtypes"] == ["torch.float32"], rank
        assert rank["off"] == 0, rank


def test_without_it_fsdp2_averages_in_bf16(tmp_path):
    for rank in measure(tmp_path):
        assert rank["reduce_dtypes"] == ["None"], rank
        assert rank["off"] > rank["elements"] // 20, rank
