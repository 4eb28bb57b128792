"""LoRA math on a stand-in parallel linear layer: zero at start, W x + (alpha/dim) B A x, merging, TP slices."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bridge_cli.config.errors import ConfigError
from bridge_cli.config.fields import check_section
from bridge_cli.config.peft_config import LoRAConfig
from bridge_cli.peft.lora import add_adapter, is_adapter_key, merge_lora


class Group:
    def __init__(self, size: int = 1, rank: int = 0):
        self._size, self._rank = size, rank

    def size(self) -> int:
        return self._size

    def rank(self) -> int:
        return self._rank


class Linear(torch.nn.Module):
    """What LoRA needs of megatron-core's parallel linear layers: weight, tp_group, (output, bias)."""

    def __init__(self, out_features: int, in_features: int, tp: Group = Group()):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(out_features, in_features))
        self.tp_group = tp

    def forward(self, x):
        return F.linear(x, self.weight), None


CFG = LoRAConfig(dim=4, alpha=8)


def test_adapter_starts_at_zero_then_adds_scaled_b_a():
    torch.manual_seed(0)
    layer, x = Linear(6, 5), torch.randn(3, 2, 5)
    base = layer(x)[0]
    adapter = add_adapter(layer, CFG, column_parallel=True, swiglu=False, seed=1)
    assert torch.equal(layer(x)[0], base)  # B is zero: the model starts as the base model
    with torch.no_grad():
        adapter.linear_out.weight.normal_()
    a, b = adapter.linear_in.weight, adapter.linear_out.weight
    expected = base + (CFG.alpha / CFG.dim) * x @ a.T @ b.T
    torch.testing.assert_close(layer(x)[0], expected)
    assert sorted(layer.state_dict()) == ["adapter.linear_in.weight", "adapter.linear_out.weight", "weight"]
    assert is_adapter_key("decoder.layers.0.mlp.linear_fc1.adapter.linear_out.weight")
    assert not is_adapter_key("decoder.layers.0.mlp.linear_fc1.weight")


def test_merging_folds_the_adapter_into_the_weight():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(6, 5))
    adapter = add_adapter(model[0], CFG, column_parallel=False, swiglu=False, seed=2)
    with torch.no_grad():
        adapter.linear_out.weight.normal_()
    x = torch.randn(4, 5)
    with_adapter = model[0](x)[0]
    assert merge_lora([model]) == 1
    assert type(model[0]) is Linear and not hasattr(model[0], "adapter")
    torch.testing.assert_close(model[0](x)[0], with_adapter, atol=1e-5, rtol=1e-5)


def test_a_is_the_same_matrix_under_any_tensor_parallel_size():
    full = add_adapter(Linear(6, 8), CFG, column_parallel=False, swiglu=False, seed=7).linear_in.weight
    for rank in range(2):
        shard = add_adapter(Linear(6, 4, Group(2, rank)), CFG, column_parallel=False, swiglu=False, seed=7)
        assert torch.equal(shard.linear_in.weight, full[:, rank * 4:(rank + 1) * 4])
        assert shard.linear_in.weight.tensor_model_parallel and shard.linear_in.weight.partition_dim == 1
    column = add_adapter(Linear(3, 8, Group(2, 1)), CFG, column_parallel=True, swiglu=False, seed=7)
    assert torch.equal(column.linear_in.weight, full)  # replicated on every tensor-parallel rank
    assert column.linear_out.weight.shape == (3, 4) and column.linear_out.weight.partition_dim == 0
    other_seed = add_adapter(Linear(6, 8), CFG, column_parallel=False, swiglu=False, seed=8).linear_in.weight
    assert not torch.equal(other_seed, full)


@pytest.mark.parametrize("field, value, fragment", [
    ("target_modules", ["linear_qkv", "q_proj"], "['q_proj'] is not a subset"),
    ("dim", 0, "must be >= 1"),
    ("dropout", 1.0, "must be in [0, 1)"),
])
def test_lora_config_errors_name_the_key(field, value, fragment):
    cfg = LoRAConfig(**{field: value})
    with pytest.raises(ConfigError) as err:
        check_section("peft", cfg)
    assert str(err.value).startswith(f"peft.{field}:") and fragment in str(err.value)
