"""bridge's token dispatcher under expert parallelism equals megatron-core's, in fp32 on the CPU (gloo).

Each case runs moe_dispatch_worker.py under torchrun: the same model with bridge's dispatcher and with
megatron-core's, forward and backward on each rank's own tokens; every rank compares the logits and every
parameter's gradient (experts, routers through the probabilities and the auxiliary loss, attention, embedding).
With 8 experts over the expert-parallel ranks each rank holds some of them, so the pairs it receives vary in
number and the dispatcher's unused tail (rows past the count) is exercised; with a capacity factor fewer pairs
still (megatron-core's router drops them on each rank before the exchange).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO, python

pytestmark = pytest.mark.slow

WORKER = Path(__file__).with_name("moe_dispatch_worker.py")


@pytest.mark.parametrize("ranks, layout", [
    (2, ["--ep", "2"]),
    (4, ["--ep", "4", "--topk", "4"]),
    (4, ["--tp", "2", "--ep", "2", "--etp", "1"]),  # sequence parallel: each rank routes its part of the sequence
    (4, ["--ep", "2", "--etp", "2", "--dispatcher", "allgather"]),  # gloo has no uneven all-gather for alltoall's
    (2, ["--ep", "2", "--capacity", "0.5"]),  # each rank's router drops pairs past half an expert's share
], ids=["ep2", "ep4", "tp2_ep2", "etp2_ep2", "ep2_capacity"])
def test_device_dispatch_equals_megatron_cores_under_expert_parallelism(tmp_path, ranks, layout):
    env = {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = python(str(WORKER), "--out", str(tmp_path), *layout, nproc=ranks, env=env, timeout=300)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    for rank in range(ranks):
        measured = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert measured["dispatchers"] == ["DeviceTokenDispatcher"]
        assert measured["reference"][0].startswith("MoE") and measured["missing"] == []
        assert measured["logits"] < 1e-5, measured
        assert len(measured["grads"]) == 16 and max(measured["grads"].values()) < 1e-5, measured
