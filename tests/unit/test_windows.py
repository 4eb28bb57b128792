"""Sliding windows of the Llama-layout families (bridge_cli/convert/families/windows.py): which layers config.json
windows, as transformers reads it, and what export writes back. Logits against transformers' above and below the
window: the mistral, mixtral, phi3, starcoder2 and Qwen rows of tests/integration/test_convert_hf.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.convert.families import FAMILIES, for_export

WHERE = Path("hf/config.json")
SHAPE = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 4, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128}
MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
EXPORTED = {"params_dtype": "float32", "attention_dropout": 0.0, "init_method_std": 0.02}


def windows(model_type: str, **config) -> tuple:
    fields = FAMILIES[model_type].model_fields({"model_type": model_type, **SHAPE, **config}, WHERE)
    return fields.get("window_size"), fields.get("window_attn_skip_freq"), fields["seq_length"]


@pytest.mark.parametrize("model_type, config, expected", [
    ("mistral", {"sliding_window": 16}, ([15, 0], [1, 1, 1, 1], 128)),  # seq_length no longer capped at 16
    ("mistral", {}, ([4095, 0], [1, 1, 1, 1], 128)),  # MistralConfig's default window, 4,096
    ("mistral", {"sliding_window": None}, (None, None, 128)),
    ("mixtral", {"num_local_experts": 4}, (None, None, 128)),  # MixtralConfig's default: none
    ("phi3", {"sliding_window": 16}, ([15, 0], [1, 1, 1, 1], 128)),
    ("starcoder2", {"sliding_window": 16}, ([15, 0], [1, 1, 1, 1], 128)),
    ("qwen2", {"sliding_window": 16}, (None, None, 128)),  # without use_sliding_window transformers drops it
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}, ([15, 0], [0, 1, 1, 1], 128)),
    ("qwen3", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 3}, ([15, 0], [0, 0, 0, 1], 128)),
    ("qwen3", {"use_sliding_window": True, "sliding_window": None, "max_window_layers": 1}, (None, None, 128)),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1,  # layer_types come first
               "layer_types": ["sliding_attention", "full_attention"] * 2}, ([15, 0], [1, 0, 1, 0], 128)),
    # Qwen2-MoE windows the even layers below max_window_layers
    ("qwen2_moe", {**MOE, "shared_expert_intermediate_size": 96, "use_sliding_window": True, "sliding_window": 16,
                   "max_window_layers": 3}, ([15, 0], [1, 0, 1, 0], 128)),
    ("qwen3_moe", {**MOE, "use_sliding_window": True, "sliding_window": 16}, ([15, 0], [1, 1, 1, 1], 128)),
])
def test_config_json_windows_the_layers_transformers_windows(model_type, config, expected):
    assert windows(model_type, **config) == expected


def test_sliding_layers_without_use_sliding_window_are_refused():
    """transformers' Qwen2 then has no window for them and fails to run."""
    with pytest.raises(CheckpointError, match="sliding_attention in layer_types with use_sliding_window false"):
        windows("qwen2", sliding_window=16, layer_types=["sliding_attention", "full_attention"] * 2)


def test_export_writes_the_windows_back_and_refuses_what_a_family_cannot_hold():
    qwen2 = FAMILIES["qwen2"]
    model = qwen2.model_fields({"model_type": "qwen2", **SHAPE, "use_sliding_window": True, "sliding_window": 16,
                                "max_window_layers": 1}, WHERE)
    written = qwen2.hf_config({**model, **EXPORTED})
    assert (written["use_sliding_window"], written["sliding_window"], written["layer_types"]) == (
        True, 16, ["full_attention", "sliding_attention", "sliding_attention", "sliding_attention"])
    assert qwen2.model_fields({**written, "model_type": "qwen2"}, WHERE) == model  # read back, the same model
    # Mistral windows every layer or none; a Llama with a window in every layer is a Mistral
    assert FAMILIES["mistral"].differences({**model, "add_qkv_bias": False}) == [
        "model.window_attn_skip_freq=[0, 1, 1, 1] (a mistral model has its sliding window in every layer or in none)"]
    mistral = FAMILIES["mistral"].model_fields({"model_type": "mistral", **SHAPE, "sliding_window": 16}, WHERE)
    assert for_export(mistral, None, WHERE).model_type == "mistral"
    assert FAMILIES["mistral"].hf_config({**mistral, **EXPORTED})["sliding_window"] == 16
    with pytest.raises(CheckpointError, match="a llama model cannot hold .* model.window_size=\\[15, 0\\]"):
        for_export(mistral, "llama", WHERE)
