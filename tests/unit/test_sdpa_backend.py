"""model.sdpa_backend: the torch spec's attention runs on the kernel asked for, or is refused at build."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.enums import AttnMaskType

from bridge_cli.models.provider import GPTModelProvider
from bridge_cli.models.attention.core import TorchAttention
from bridge_cli.models.specs import layer_spec
from bridge_cli.runtime.errors import RuntimeUnavailable


def attention(**fields) -> TorchAttention:
    base = dict(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, attention_dropout=0.0)
    config = GPTModelProvider(**{**base, **fields})
    return TorchAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def run(module: TorchAttention) -> tuple[torch.Tensor, torch.Tensor, set[str]]:
    """Output, query grad and kernel names of one forward and backward on fixed ``[s, b, heads, d]`` inputs."""
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(32, 2, 4, 16, generator=generator, requires_grad=True)
    k, v = (torch.randn(32, 2, 2, 16, generator=generator) for _ in range(2))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = module(q, k, v)
        out.square().sum().backward()
    return out.detach(), q.grad, {event.name for event in profile.events()}


def test_math_matches_auto_and_runs_the_math_kernel():
    auto_out, auto_grad, auto_kernels = run(attention())
    math_out, math_grad, math_kernels = run(attention(sdpa_backend="math"))
    torch.testing.assert_close(math_out, auto_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(math_grad, auto_grad, rtol=1e-5, atol=1e-5)
    assert "aten::_scaled_dot_product_attention_math" in math_kernels
    assert not any("flash" in name for name in math_kernels), math_kernels
    assert any("flash" in name for name in auto_kernels), auto_kernels  # what torch picks on the CPU


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU's flash kernel is the one without dropout")
def test_flash_on_the_cpu_cannot_drop_out():
    with pytest.raises(RuntimeUnavailable, match=r"model.sdpa_backend=flash cannot run .* on cpu: .*dropout"):
        attention(sdpa_backend="flash", attention_dropout=0.1)


@pytest.mark.parametrize("spec", ["local", "te"])
def test_other_specs_refuse_a_backend(spec):
    with pytest.raises(RuntimeUnavailable, match=f"model.sdpa_backend=math applies to the torch layer spec only, "
                                                 f"and model.spec={spec}"):
        layer_spec(spec, GPTModelProvider(num_layers=1, hidden_size=64, num_attention_heads=4, sdpa_backend="math"))
