"""model.gradient_accumulation_fusion without Apex (bridge_cli/models/wgrad_accumulation.py): the GEMM adds
into main_grad, megatron-core's linears find it where they look for Apex, and validation refuses it on a
torch without addmm's fp32 output unless Apex is there. Training with it is tested on the GPU
(tests/gpu/test_gpu_perf_options.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from bridge_cli.config.errors import ConfigError
from bridge_cli.models import wgrad_accumulation


def test_the_gemm_adds_into_main_grad():
    torch.manual_seed(0)
    x, dy = torch.randn(2, 5, 7), torch.randn(2, 5, 3)  # [batch, tokens, in] and [batch, tokens, out]
    main_grad = torch.randn(3, 7)
    expected = main_grad.double() + dy.reshape(-1, 3).double().t() @ x.reshape(-1, 7).double()
    wgrad_accumulation.wgrad_gemm_accum_fp32(x, dy, main_grad)
    torch.testing.assert_close(main_grad.double(), expected, rtol=1e-6, atol=1e-5)


def test_megatron_core_linears_find_it_where_they_look_for_apex(monkeypatch):
    from megatron.core.tensor_parallel import layers

    monkeypatch.setattr(layers, "_grad_accum_fusion_available", False)
    monkeypatch.setattr(layers, "fused_weight_gradient_mlp_cuda", None, raising=False)
    wgrad_accumulation.install()
    assert layers._grad_accum_fusion_available
    assert layers.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32 is wgrad_accumulation.wgrad_gemm_accum_fp32


def test_a_torch_without_fp32_addmm_output_is_refused_at_validation(monkeypatch):
    monkeypatch.setattr(wgrad_accumulation, "addmm_has_fp32_output", lambda: False)
    monkeypatch.setattr(wgrad_accumulation, "_apex_has_it", lambda: False)
    with pytest.raises(ConfigError, match="model.gradient_accumulation_fusion: needs Apex or torch >= 2.8"):
        wgrad_accumulation.check(SimpleNamespace(gradient_accumulation_fusion=True))
    wgrad_accumulation.check(SimpleNamespace(gradient_accumulation_fusion=False))
    monkeypatch.setattr(wgrad_accumulation, "_apex_has_it", lambda: True)
    wgrad_accumulation.check(SimpleNamespace(gradient_accumulation_fusion=True))
