"""Model FLOPs (megatron-core's causal formula) against values computed by hand per recipe."""

from __future__ import annotations

import pytest

from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer
from bridge_cli.training.utils.train_utils import num_floating_point_operations

# 6 x (layers x (QKV + output projection + MLP matmuls) + output layer) + 6 x layers x q x seq (causal
# attention), per token; MLP is 3 h x F matmuls with SwiGLU, 2 without; GQA shrinks K and V.
HAND_FLOPS_PER_TOKEN = {
    # 6*(32*(4096*(4096+2*1024) + 4096*4096 + 3*4096*14336) + 4096*128256) + 6*32*4096*8192
    "llama8b": 51_470_401_536,
    # 6*(16*(2048*(2048+2*512) + 2048*2048 + 3*2048*8192) + 2048*128256) + 6*16*2048*4096
    "llama1b": 8_219_787_264,
    # 6*(12*(768*(768+2*768) + 768*768 + 2*768*3072) + 768*50304) + 6*12*768*1024; vocab padded to 50304
    "gpt2_124m": 798_031_872,
}


@pytest.mark.parametrize("recipe", sorted(HAND_FLOPS_PER_TOKEN))
def test_flops_formula_matches_hand_computation(recipe):
    cfg = ConfigContainer.from_yaml_dict(compose(recipe, []))
    tokens = cfg.model.seq_length * 2
    assert num_floating_point_operations(cfg.model, batch_size=2) == HAND_FLOPS_PER_TOKEN[recipe] * tokens


def test_each_mtp_layer_adds_a_layer_its_projection_and_an_output_layer_pass():
    # llama1b per token: one more layer 6*(2048*(2048+2*512) + 2048*2048 + 3*2048*8192) + 6*2048*4096,
    # the 2h -> h projection 6*2*2048*2048, and the output layer again 6*2048*128256
    cfg = ConfigContainer.from_yaml_dict(compose("llama1b", ["model.mtp_num_layers=2"]))
    per_mtp_layer = 6 * (2048 * (2048 + 2 * 512) + 2048 * 2048 + 3 * 2048 * 8192) + 6 * 2048 * 4096 \
        + 6 * 2 * 2048 * 2048 + 6 * 2048 * 128256
    tokens = cfg.model.seq_length * 2
    expected = (HAND_FLOPS_PER_TOKEN["llama1b"] + 2 * per_mtp_layer) * tokens
    assert num_floating_point_operations(cfg.model, batch_size=2) == expected
