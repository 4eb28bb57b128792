"""megatron-core imports without inductor; its fused kernels compile at their first call, and a compiled region
that calls one traces it inline, in one graph."""

import subprocess
import sys

import pytest

CHECK = """
import sys
from bridge_cli.runtime.mcore_import import import_megatron_core
import_megatron_core()
from bridge_cli.cli.app import load_config
load_config(["recipe=gpt2_124m"], None, device="cuda")
import megatron.core.models.gpt, megatron.core.optimizer
print("dynamo at import:", "torch._dynamo" in sys.modules)

import torch
from megatron.core.fusions.fused_bias_gelu import bias_gelu, bias_gelu_back
bias, y = torch.randn(8), torch.randn(4, 8)
x = bias + y
eager = x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))
torch.testing.assert_close(bias_gelu(bias, y), eager)
print("dynamo after the first call:", "torch._dynamo" in sys.modules)

# bias_gelu_back's first call is inside a compiled region: traced inline, not compiled there on its own
from torch._dynamo.testing import CompileCounter
counter = CompileCounter()
region = torch.compile(lambda g, b, v: bias_gelu_back(g, b, v) * 2, backend=counter, fullgraph=True)
g = torch.randn(4, 8)
torch.testing.assert_close(region(g, bias, y), bias_gelu_back.__wrapped__(g, bias, y) * 2)
print("graphs of the region:", counter.frame_count)
"""


@pytest.mark.slow  # a fresh megatron-core import, then inductor compiles a kernel
def test_fused_kernels_compile_at_first_call_not_at_import():
    out = subprocess.run([sys.executable, "-c", CHECK], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "dynamo at import: False" in out.stdout
    assert "dynamo after the first call: True" in out.stdout
    assert "graphs of the region: 1" in out.stdout
