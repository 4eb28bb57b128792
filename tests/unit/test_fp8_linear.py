"""FP8 linears without Transformer Engine: the casts, the scaled GEMMs against their fp32 emulation,
a GPTModel built with them (same checkpoint keys as bf16), and the settings validation refuses.

torch's CPU build implements ``torch._scaled_mm``, so the GEMM layouts and scales are checked here;
training in FP8 is refused on the CPU and runs in tests/gpu/test_gpu_fp8.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

from bridge_cli.models.fp8_linear import (
    Fp8ColumnParallelLinear,
    Fp8RowParallelLinear,
    Fp8Scaling,
    fp8_linear,
    fp8_linear_count,
    quantize,
)
from bridge_cli.models.provider import GPTModelProvider
from tests.unit.test_cli_errors import assert_user_error

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
TENSORWISE = Fp8Scaling("tensorwise", E5M2)


def _cpu_has_rowwise_scaled_mm() -> bool:
    a = torch.zeros(16, 16).to(E4M3)
    try:
        torch._scaled_mm(a, a.t(), scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except RuntimeError:  # torch < 2.13's CPU kernel: per-tensor scales only (the GPU test covers row-wise)
        return False
    return True


ROWWISE = pytest.param(Fp8Scaling("rowwise", E4M3), marks=pytest.mark.skipif(
    not _cpu_has_rowwise_scaled_mm(), reason="this torch's CPU _scaled_mm has per-tensor scales only"))


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def within_e4m3_rounding(q: torch.Tensor, back: torch.Tensor, t: torch.Tensor) -> bool:
    """Half a unit in the last place: 2^-4 relative for normal numbers, 2^-10 of the scale for subnormal ones."""
    return bool(((q.float() * back - t).abs() <= t.abs() * 2 ** -4 + back * 2 ** -10).all())


def test_tensorwise_cast_maps_the_amax_to_the_largest_fp8_value():
    torch.manual_seed(0)
    t = torch.randn(40, 64) * 3
    q, back = quantize(t, E4M3, rowwise=False)
    assert q.dtype == E4M3 and back.numel() == 1
    assert q.float().abs().max().item() == 448.0
    assert within_e4m3_rounding(q, back, t)


def test_rowwise_cast_has_a_power_of_two_scale_per_row():
    torch.manual_seed(0)
    t = torch.randn(40, 64) * torch.logspace(-3, 3, 40).unsqueeze(1)  # rows of very different size
    q, back = quantize(t, E4M3, rowwise=True)
    assert back.shape == (40, 1)
    assert torch.equal(torch.log2(back), torch.log2(back).round())
    row_max = q.float().abs().amax(dim=1)
    assert (row_max <= 448).all() and (row_max >= 224).all()  # each row uses the top binade
    assert within_e4m3_rounding(q, back, t)


@pytest.mark.parametrize("scaling", [TENSORWISE, ROWWISE], ids=["tensorwise", "rowwise"])
def test_forward_is_the_gemm_of_the_dequantized_operands(scaling):
    torch.manual_seed(0)
    x, w = torch.randn(40, 64, dtype=torch.bfloat16), torch.randn(96, 64, dtype=torch.bfloat16) * 0.05
    x8, xs = quantize(x, E4M3, scaling.rowwise)
    w8, ws = quantize(w, E4M3, scaling.rowwise)
    expected = (x8.float() * xs) @ (w8.float() * ws).t()
    torch.testing.assert_close(fp8_linear(x, w, None, scaling).float(), expected, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("scaling", [TENSORWISE, ROWWISE, Fp8Scaling("tensorwise", E4M3, wgrad=False)],
                         ids=["tensorwise", "rowwise", "bf16-wgrad"])
def test_gradients_follow_the_fp32_ones(scaling):
    """40 tokens is not a multiple of 16: the weight-gradient GEMM pads the tokens it reduces over."""
    torch.manual_seed(0)
    x = torch.randn(20, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(96, 64, dtype=torch.bfloat16) * 0.05).requires_grad_()
    b = torch.randn(96, dtype=torch.bfloat16, requires_grad=True)
    grad_y = torch.randn(20, 2, 96, dtype=torch.bfloat16)
    fp8_linear(x, w, b, scaling).backward(grad_y)
    x32, w32 = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    F.linear(x32, w32).backward(grad_y.float())
    fp8_error = 0.08 if scaling.grad_dtype == E5M2 else 0.05  # e5m2 has two mantissa bits, e4m3 three
    assert relative(x.grad, x32.grad) < fp8_error
    assert relative(b.grad, grad_y.float().sum((0, 1))) < 1e-2
    if scaling.wgrad:
        assert relative(w.grad, w32.grad) < fp8_error
    else:
        torch.testing.assert_close(w.grad, (grad_y.reshape(40, 96).t() @ x.detach().reshape(40, 64)))


def build(fp8: str | None, **fields):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    shape = dict(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, ffn_hidden_size=128)
    config = GPTModelProvider(
        **{**shape, **fields}, vocab_size=128, seq_length=32, position_embedding_type="rope", normalization="RMSNorm",
        add_bias_linear=False, gated_linear_unit=True, activation_func=F.silu, hidden_dropout=0.0,
        attention_dropout=0.0, spec="torch", bf16=True, params_dtype=torch.bfloat16, fp8=fp8)
    return config.provide()


def assert_loads_and_runs_like(fp8, bf16) -> None:
    """``fp8`` has ``bf16``'s checkpoint keys, loads its weights, and then gives its logits within FP8's error
    and gradients."""
    assert fp8.state_dict().keys() == bf16.state_dict().keys()
    fp8.load_state_dict(bf16.state_dict())
    tokens = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(32).expand(2, 32)
    logits = fp8(tokens, positions, None)
    logits.float().square().mean().backward()
    assert relative(logits, bf16(tokens, positions, None)) < 0.05


def test_a_gpt_model_runs_its_layer_linears_in_fp8_with_the_bf16_checkpoint_keys(one_process):
    fp8 = build("hybrid", first_last_layers_bf16=True)
    bf16 = build(None)
    layer = fp8.decoder.layers[1]
    assert isinstance(layer.self_attention.linear_qkv, Fp8ColumnParallelLinear)
    assert isinstance(layer.mlp.linear_fc2, Fp8RowParallelLinear)
    assert fp8.config.fp8 is None  # megatron-core's own (Transformer Engine) fp8 paths stay off
    assert fp8_linear_count(fp8) == (8, 8)  # 4 linears a layer: layers 2, 3 in fp8, the first and last in bf16
    assert fp8.decoder.layers[0].mlp.linear_fc1.fp8 is None and layer.mlp.linear_fc1.fp8 == TENSORWISE
    # a bf16 layer's linears are megatron-core's own again, so every bf16 path (the in-graph wgrad) takes them
    assert type(fp8.decoder.layers[0].mlp.linear_fc1) is ColumnParallelLinear
    assert_loads_and_runs_like(fp8, bf16)
    assert layer.self_attention.linear_qkv.weight.grad is not None


@pytest.mark.parametrize("tied", [False, True])
def test_the_output_layer_runs_in_fp8_when_asked_with_the_bf16_checkpoint_keys(one_process, tied):
    fields = dict(fp8_output_layer=True, share_embeddings_and_output_weights=tied)
    fp8, bf16 = build("hybrid", **fields), build(None, share_embeddings_and_output_weights=tied)
    assert isinstance(fp8.output_layer, Fp8ColumnParallelLinear) and fp8.output_layer.fp8 == TENSORWISE
    assert fp8_linear_count(fp8) == (17, 0)  # 4 linears in each of 4 layers, and the output layer
    assert fp8_linear_count(build("hybrid")) == (16, 0)  # without the option the output layer is bf16
    assert_loads_and_runs_like(fp8, bf16)
    assert fp8.shared_embedding_or_output_weight().grad is not None


def test_a_linear_whose_partition_is_not_a_multiple_of_16_stays_bf16(one_process):
    model = build("e4m3", fp8_recipe="rowwise", ffn_hidden_size=120)
    fc1, fc2 = model.decoder.layers[0].mlp.linear_fc1, model.decoder.layers[0].mlp.linear_fc2
    assert fc1.fp8 is not None  # 2 x 120 = 240 rows (SwiGLU's gate and up)
    assert fc2.fp8 is None and type(fc2) is RowParallelLinear  # 120 inputs


TENSORWISE_PRESET = "mixed_precision=bf16_with_fp8_current_scaling_mixed"
REFUSED = [
    ([TENSORWISE_PRESET, "model.first_last_layers_bf16=false", "model.fp8_recipe=delayed"],
     ["model.fp8_recipe", "delayed scaling needs Transformer Engine", "model.fp8_recipe=tensorwise"]),
    (["mixed_precision=bf16_with_fp8_rowwise_mixed", "model.fp8=hybrid"],
     ["model.fp8", "row-wise FP8 GEMMs take e4m3 operands only"]),
    (["model.fp8=hybrid"], ["model.fp8", "model.bf16 is false", "bf16_with_fp8_current_scaling_mixed"]),
    (["mixed_precision=bf16_mixed", "model.fp4=e2m1"], ["model.fp4", "is a Transformer Engine setting"]),
    ([TENSORWISE_PRESET, "model.fp8_amax_history_len=16"], ["model.fp8_amax_history_len", "Transformer Engine setting"]),
    (["ddp.fp8_param_gather=true"], ["ddp.fp8_param_gather", "is a Transformer Engine setting"]),
    (["mixed_precision=bf16_mixed", "model.fp8_output_layer=true"],
     ["model.fp8_output_layer", "model.fp8 is not set", "bf16_with_fp8_current_scaling_mixed"]),
    ([TENSORWISE_PRESET, "model.fp8_output_layer=true", "model.fused_linear_cross_entropy=true"],
     ["model.fp8_output_layer", "model.fused_linear_cross_entropy", "Set one of them to false"]),
    ([TENSORWISE_PRESET, "model.fp8_output_layer=true", "model.spec=te"],
     ["model.fp8_output_layer", "te spec", "model.spec=torch"]),
]


@pytest.mark.parametrize("args, fragments", REFUSED)
def test_settings_the_torch_spec_cannot_honour_are_refused(cli, args, fragments):
    assert_user_error(cli("config", "validate", "recipe=tiny", "--device", "cuda", *args), *fragments)


def test_fp8_is_refused_on_the_cpu_and_checks_for_a_gpu(cli):
    assert_user_error(cli("pretrain", "--dry-run", "recipe=tiny", "mixed_precision=bf16_with_fp8_current_scaling_mixed",
                          "--device", "cpu"), "model.fp8 need", "CUDA", "mixed_precision=fp32")
    for preset in ("bf16_with_fp8_current_scaling_mixed", "bf16_with_fp8_rowwise_mixed"):
        result = cli("pretrain", "--dry-run", "recipe=tiny", f"mixed_precision={preset}", "--device", "cuda")
        assert result.exit_code == 0, result.output
