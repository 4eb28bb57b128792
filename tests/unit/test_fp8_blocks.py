"""FP8 block dequantization (bridge_cli/convert/fp8_blocks.py): the arithmetic against a block-by-block loop written
here from the convention (scale_inv[i, j] multiplies rows 128 i.., columns 128 j.., cut short at the edges), and
config.json's quantization_config settings it refuses. The imports of FP8 folders: tests/integration/test_convert_fp8.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.convert.fp8_blocks import check_config, dequantize

DEEPSEEK = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
"""DeepSeek-V3's quantization_config (Qwen3's -FP8 releases have the same)."""
WHERE = Path("/models/DeepSeek-V3/config.json")


def by_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: int = 128) -> torch.Tensor:
    out = weight.float()
    for i in range(scale_inv.shape[0]):
        for j in range(scale_inv.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] *= scale_inv[i, j]
    return out


@pytest.mark.parametrize("shape", [(300, 257), (256, 384), (5, 7), (129, 128), (576, 200)])
def test_each_block_is_its_fp8_values_times_its_scale(shape):
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(shape, generator=generator) * 100).to(torch.float8_e4m3fn)
    grid = (-(-shape[0] // 128), -(-shape[1] // 128))
    scale_inv = torch.rand(grid, generator=generator) + torch.arange(grid[0] * grid[1]).view(grid)  # each differs
    got = dequantize(weight, scale_inv)
    assert got.dtype == torch.float32 and got.shape == shape
    assert torch.equal(got, by_blocks(weight, scale_inv))


def test_the_scales_are_not_read_transposed():
    weight = torch.ones(256, 128, dtype=torch.float8_e4m3fn)
    got = dequantize(weight, torch.tensor([[2.0], [3.0]]))
    assert got[:128].eq(2).all() and got[128:].eq(3).all()


def test_deepseek_and_qwen3_settings_are_accepted():
    assert check_config({"quantization_config": DEEPSEEK}, WHERE) == (128, 128)
    assert check_config({}, WHERE) is None
    # keys transformers defaults (FineGrainedFP8Config) and ones that change nothing here
    assert check_config({"quantization_config": {"quant_method": "fp8"}}, WHERE) == (128, 128)
    assert check_config({"quantization_config": {**DEEPSEEK, "modules_to_not_convert": ["lm_head"],
                                                 "scale_fmt": "ue8m0"}}, WHERE) == (128, 128)


@pytest.mark.parametrize("key, value", [("quant_method", "mxfp4"), ("fmt", "e5m2"), ("activation_scheme", "static"),
                                        ("weight_block_size", [64, 64]), ("weight_block_size", [128, 64]),
                                        ("scale_fmt", "e4m3"), ("kv_cache_scheme", "fp8")])
def test_other_settings_are_refused_naming_the_key_and_value(key, value):
    with pytest.raises(CheckpointError) as refused:
        check_config({"quantization_config": {**DEEPSEEK, key: value}}, WHERE)
    assert str(refused.value).startswith(f"{WHERE}: quantization_config.{key} is {value!r}")
    assert "bridge cannot convert this model" in str(refused.value)
