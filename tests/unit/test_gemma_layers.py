"""Gemma-style model options (zero-centred RMSNorm, post-sublayer norms, a RoPE base of the sliding-window
layers, scaled embeddings) and the gemma3_text family's reading of config.json. The whole model against
transformers' Gemma 3 is tests/integration/test_convert_hf.py."""

from __future__ import annotations

import types
from pathlib import Path

import pytest
import torch

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.convert.families import FAMILIES
from bridge_cli.models.gpt_model import _scale_by_sqrt_hidden
from bridge_cli.models.norms import ZeroCenteredRMSNorm
from tests.unit.test_cli_errors import assert_user_error

transformers = pytest.importorskip("transformers")

WHERE = Path("gemma/config.json")
# a Gemma 3 1B-shaped config.json as transformers 4.5x saved it
GEMMA3_1B = {"model_type": "gemma3_text", "hidden_size": 1152, "intermediate_size": 6912, "num_hidden_layers": 8,
             "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
             "max_position_embeddings": 32768, "hidden_activation": "gelu_pytorch_tanh", "query_pre_attn_scalar": 256,
             "rms_norm_eps": 1e-06, "rope_local_base_freq": 10000, "rope_scaling": None, "rope_theta": 1000000,
             "sliding_window": 512, "sliding_window_pattern": 6, "attn_logit_softcapping": None,
             "final_logit_softcapping": None, "tie_word_embeddings": True}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rmsnorm_is_gemmas_bit_for_bit(dtype):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm

    theirs = Gemma3RMSNorm(48, eps=1e-6)
    ours = ZeroCenteredRMSNorm(types.SimpleNamespace(sequence_parallel=False), 48, eps=1e-6)
    assert torch.equal(ours.weight, torch.zeros(48))  # a new norm is the identity times rms
    with torch.no_grad():
        theirs.weight.normal_(generator=torch.Generator().manual_seed(0))
        ours.weight.copy_(theirs.weight)
    x = torch.randn(5, 3, 48, generator=torch.Generator().manual_seed(1)).to(dtype)
    assert torch.equal(ours(x), theirs(x))


def test_embeddings_are_scaled_by_sqrt_hidden_rounded_to_their_dtype():
    embedding = types.SimpleNamespace(config=types.SimpleNamespace(hidden_size=3072))
    assert _scale_by_sqrt_hidden(embedding, (), torch.ones(2, dtype=torch.bfloat16)).tolist() == [55.5, 55.5]
    assert _scale_by_sqrt_hidden(embedding, (), torch.ones(1)).item() == pytest.approx(3072 ** 0.5)


def test_transformers_4_keys_give_the_model_fields():
    fields = FAMILIES["gemma3_text"].model_fields(GEMMA3_1B, WHERE)
    assert fields["window_size"] == [511, 0]
    assert fields["window_attn_skip_freq"] == [1, 1, 1, 1, 1, 0, 1, 1]  # every 6th layer global
    assert (fields["rotary_base"], fields["local_rotary_base"], fields["seq_len_interpolation_factor"]) == (
        1000000, 10000, None)
    assert fields["softmax_scale"] == 1 / 16 and fields["kv_channels"] == 256
    assert fields["share_embeddings_and_output_weights"] and fields["activation_func"] == "fast_gelu"
    scaled = FAMILIES["gemma3_text"].model_fields({**GEMMA3_1B, "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
                                                  WHERE)
    assert scaled["seq_len_interpolation_factor"] == 8.0


def test_export_writes_back_what_import_read():
    family = FAMILIES["gemma3_text"]
    fields = family.model_fields(GEMMA3_1B, WHERE)
    model = {"params_dtype": "bfloat16", "rope_scaling": False, **fields}
    config = family.hf_config(model)
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"] + ["sliding_attention"] * 2
    assert (config["sliding_window"], config["query_pre_attn_scalar"], config["rope_local_base_freq"]) == (512, 256, 10000)
    assert config["rope_scaling"] is None and "hidden_act" not in config
    again = family.model_fields(config, WHERE)
    assert {key: again[key] for key in fields if key != "seq_length"} == {
        key: value for key, value in fields.items() if key != "seq_length"}


@pytest.mark.parametrize("change, fragment", [
    ({"final_logit_softcapping": -30.0}, "final_logit_softcapping -30.0: a positive number (or null) is needed"),
    ({"attn_logit_softcapping": "50"}, "attn_logit_softcapping '50'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu': Gemma 3 uses gelu_pytorch_tanh"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 8.0}}, "RoPE scaling 'yarn' in the global layers"),
    ({"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                          "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "RoPE scaling 'linear' in the sliding-window layers"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 4}, "layer_types"),
    ({"sliding_window": None}, "sliding_window None with sliding-window layers"),
])
def test_what_megatron_core_cannot_compute_is_refused(change, fragment):
    """(Soft caps themselves convert: tests/integration/test_convert_hf.py's gemma2.)"""
    with pytest.raises(CheckpointError, match="bridge cannot convert this model") as error:
        FAMILIES["gemma3_text"].model_fields({**GEMMA3_1B, **change}, WHERE)
    assert fragment in str(error.value)


@pytest.mark.parametrize("args, fragments", [
    (["model.post_sublayer_norm=true", "model.spec=te"], ["model.post_sublayer_norm: is built into the local and "
                                                           "torch layer specs only", "model.spec=torch"]),
    (["model.local_rotary_base=10000", "model.spec=te"], ["model.local_rotary_base: is built into"]),
    (["model.layernorm_zero_centered_gamma=true", "model.normalization=LayerNorm"],
     ["model.layernorm_zero_centered_gamma: the torch layer spec has a zero-centred RMSNorm only"]),
    (["model.local_rotary_base=10000", "model.position_embedding_type=learned_absolute"],
     ["model.local_rotary_base: sets the RoPE base of the sliding-window layers"]),
])
def test_options_a_spec_cannot_build_are_refused(cli, args, fragments):
    assert_user_error(cli("config", "validate", "recipe=tiny", *args), *fragments)
