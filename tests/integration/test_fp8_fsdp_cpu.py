"""bridge's FP8 linears under torch FSDP2 (dist.use_torch_fsdp2=true, as llama8b ships) on the CPU: 2 gloo processes
against the same model whole on one process, eagerly and with model.compile_layers (fp8_fsdp_worker.py).

The FP8 casts take their scales from the amax of the weight they are handed, so a GEMM handed this rank's shard
would scale by the shard's amax: a wrong number with no error. FSDP2 hands each GEMM the whole gathered weight, so
the logits are bitwise those of the whole model, and the gradients are its gradients averaged over the two ranks'
tokens to within one bf16 rounding (the worker leaves ddp.grad_reduce_in_fp32 off, so FSDP2 reduce-scatters them in
the weights' bf16; test_fsdp_reduce_cpu.py has the fp32 reduction). Eagerly, tensor-wise FP8 keeps the fp8 cast of each FP8 layer's
whole weight from the forward to the backward, where FSDP2 frees the gathered bf16 weight (the memory estimate's
note on FP8); compiled, the graphs keep none. The model's FP8 training itself is refused on the CPU
(runtime/device_rules.py), so the worker builds the model through bridge's provider and spec, not the CLI.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.conftest import REPO, python

WORKER = Path(__file__).with_name("fp8_fsdp_worker.py")
ENV = {"CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
BF16_ROUNDING = 2 ** -7
"""One bf16 unit in the last place of the largest gradient: FSDP2's bf16 average against the whole model's."""

pytestmark = pytest.mark.slow


def measure(tmp_path, recipe: str) -> list[dict]:
    result = python(str(WORKER), "--out", str(tmp_path), "--recipe", recipe, nproc=2, env=ENV, timeout=400)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(2)]


@pytest.mark.parametrize("recipe, fp8_linears, layer_graphs", [("tensorwise", 8, 2), ("rowwise", 16, 1)])
def test_fp8_linears_under_fsdp2_give_the_whole_models_numbers(tmp_path, recipe, fp8_linears, layer_graphs):
    """Tensor-wise as mixed_precision=bf16_with_fp8_current_scaling_mixed (the first and last of the 4 layers bf16:
    8 FP8 linears, two kinds of layer), row-wise as bf16_with_fp8_rowwise_mixed (16 FP8 linears)."""
    for rank in measure(tmp_path, recipe):
        for mode, run in rank.items():
            assert run["sharded"] and run["missing"] == [], (mode, run)
            assert run["logits_bitwise"], (mode, run["logits"])
            worst = max(run["grads"], key=run["grads"].get)
            assert run["grads"][worst] < BF16_ROUNDING, (mode, worst, run["grads"][worst])
        eager, compiled = rank["eager"], rank["compiled"]
        # each GEMM was handed a whole weight, gathered: no DTensor, no shard
        assert len(eager["gemm_weights"]) == fp8_linears
        assert all(not w["dtensor"] and w["shape"] in eager["fp8_weight_shapes"] for w in eager["gemm_weights"])
        if recipe == "tensorwise":  # eagerly its forward keeps the fp8 casts of the whole weights for the backward
            assert eager["held"]["fp8_weights"] == eager["fp8_weight_bytes"], eager["held"]
        # compiled under FSDP2: each layer one graph, shared by the layers of its kind
        assert compiled["graph_breaks"] == 0 and compiled["graphs_compiled_for_fsdp2"] == layer_graphs, compiled
        # and no fp8 copy of a whole weight held from the forward to the backward (FSDP2 frees the gathered bf16 one)
        assert compiled["held"]["fp8_weights"] == 0, compiled["held"]
