"""The distributed optimizer's overlapped communication (``ddp.overlap_grad_reduce``, ``ddp.overlap_param_gather``)
under expert parallelism, eager and with compiled layers: the same loss curve as without overlap, and compiled
layers compile as often as without it. megatron-core's forward pre-hooks, which wait on each bucket's param
all-gather, were traced into the compiled layers, where they broke the graph at each collective and made every
layer compile its own graphs (48 recompilations instead of 38 over 2 ranks here; on the MoE proxy on 4 H100s no
step finished within 105 s); bridge runs them before each compiled layer (runtime/param_gather_hooks.py).

Each run is ``bridge pretrain`` on two CPU processes (gloo) through distributed_optimizer_cli.py, which lets the
CPU run megatron-core's distributed optimizer. Overlap changes when the collectives run, not what they sum: fp32
on the CPU gives the same numbers.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from tests.conftest import python
from tests.integration.test_moe_parallel_cpu import SHORT, assert_same_run, curve

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("distributed_optimizer_cli.py")
LAYOUT = ["model.expert_model_parallel_size=2", "optimizer.use_distributed_optimizer=true",
          "model.use_cpu_initialization=true", "model.gradient_accumulation_fusion=true",
          "train.micro_batch_size=2"]  # two micro-batches a rank: grads accumulate before the reduce-scatter
OVERLAP = ["ddp.overlap_grad_reduce=true", "ddp.overlap_param_gather=true"]


def pretrain(*overrides: str):
    env = {"TORCH_LOGS": "recompiles", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return python(str(WORKER), "pretrain", *SHORT, *LAYOUT, *overrides, nproc=2, env=env, timeout=600)


def recompilations(result) -> int:
    """How often dynamo compiled a function again, over both ranks (TORCH_LOGS=recompiles)."""
    return len(re.findall(r"Recompiling function", result.stderr))


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_overlapped_communication_trains_as_without(compiled):
    compile_layers = f"model.compile_layers={str(compiled).lower()}"
    without, overlapped = pretrain(compile_layers), pretrain(compile_layers, *OVERLAP)
    assert_same_run(curve(overlapped), curve(without))
    assert recompilations(overlapped) == recompilations(without), overlapped.stderr[-3000:]
