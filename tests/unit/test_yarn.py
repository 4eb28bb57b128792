"""YaRN RoPE in the Llama-layout families (bridge_cli/convert/yarn.py): config.json's rope_type yarn becomes
megatron-core's position_embedding_type=yarn and back, and what megatron-core's YaRN cannot compute is refused.
Logits against transformers': the qwen3 row of tests/integration/test_convert_hf.py; megatron-core's YaRN table
against transformers': tests/unit/test_gpt_oss.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.config.errors import ConfigError
from bridge_cli.convert.families import FAMILIES
from bridge_cli.convert.yarn import attention_factor

WHERE = Path("hf/config.json")
# Qwen3-8B's config.json with the rope_scaling Qwen's model card gives for contexts beyond 32,768 tokens
QWEN3_YARN = {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 4096, "head_dim": 128,
              "intermediate_size": 12288, "num_hidden_layers": 36, "num_attention_heads": 32,
              "num_key_value_heads": 8, "vocab_size": 151936, "max_position_embeddings": 40960,
              "rms_norm_eps": 1e-6, "rope_theta": 1000000, "tie_word_embeddings": False,
              "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}


def test_a_qwen3_with_yarn_converts_to_megatron_cores_yarn_and_back():
    family = FAMILIES["qwen3"]
    model = family.model_fields(QWEN3_YARN, WHERE)
    assert (model["position_embedding_type"], model["rotary_base"], model["rope_scaling"]) == ("yarn", 1000000, False)
    assert (model["yarn_rotary_scaling_factor"], model["yarn_original_max_position_embeddings"],
            model["yarn_beta_fast"], model["yarn_beta_slow"], model["yarn_correction_range_round_to_int"]) == (
        4.0, 32768, 32.0, 1.0, True)
    assert (model["yarn_mscale"], model["yarn_mscale_all_dim"]) == (1.0, 0.0)  # transformers: 0.1 ln(factor) + 1
    assert family.differences(model) == []
    written = family.hf_config({**model, "params_dtype": "bfloat16", "attention_dropout": 0.0,
                                "init_method_std": 0.02})
    assert written["rope_scaling"] == {**QWEN3_YARN["rope_scaling"], "beta_fast": 32.0, "beta_slow": 1.0,
                                       "truncate": True}
    assert family.model_fields({**QWEN3_YARN, **written}, WHERE) == model  # read back, the same model


def test_a_yarn_model_takes_sequences_up_to_factor_times_its_original_length():
    """Qwen3's config keeps max_position_embeddings at 40,960 when YaRN takes it to 4 x 32,768."""
    family = FAMILIES["qwen3"]
    assert family.model_fields(QWEN3_YARN, WHERE)["seq_length"] == 4096  # the default cap
    assert family.model_fields(QWEN3_YARN, WHERE, seq_length=131072)["seq_length"] == 131072
    with pytest.raises(ConfigError, match="131073 is longer than the model supports \\(131072: YaRN's factor x "
                                          "original_max_position_embeddings"):
        family.model_fields(QWEN3_YARN, WHERE, seq_length=131073)
    plain = {key: value for key, value in QWEN3_YARN.items() if key != "rope_scaling"}
    with pytest.raises(ConfigError, match="40960: max_position_embeddings"):
        family.model_fields(plain, WHERE, seq_length=131072)


def test_yarn_reads_transformers_5_keys_and_its_defaults():
    """rope_parameters (transformers 5) in place of rope_scaling and rope_theta; without
    original_max_position_embeddings transformers takes max_position_embeddings."""
    config = {key: value for key, value in QWEN3_YARN.items() if key not in ("rope_scaling", "rope_theta")}
    model = FAMILIES["llama"].model_fields({**config, "model_type": "llama", "rope_parameters": {
        "rope_type": "yarn", "factor": 2.0, "rope_theta": 500000.0, "beta_fast": 16, "truncate": False}}, WHERE)
    assert (model["rotary_base"], model["yarn_rotary_scaling_factor"], model["yarn_original_max_position_embeddings"],
            model["yarn_beta_fast"], model["yarn_correction_range_round_to_int"]) == (500000, 2.0, 40960, 16.0, False)


def test_a_family_of_plain_rope_exports_a_yarn_model_and_still_refuses_other_differences():
    family = FAMILIES["qwen2"]
    model = family.model_fields({**QWEN3_YARN, "model_type": "qwen2"}, WHERE)
    assert family.differences(model) == []
    assert family.differences({**model, "yarn_mscale": 2.0}) == [
        "model.yarn_mscale=2.0 with model.yarn_mscale_all_dim=0.0"]
    assert family.differences({**model, "position_embedding_type": "learned_absolute"}) == [
        "model.position_embedding_type=learned_absolute"]


@pytest.mark.parametrize("name, change, fragment", [
    ("phi3", {"partial_rotary_factor": 0.5}, "yarn with RoPE on 0.5 of each head: megatron-core's YaRN rotates whole"),
    ("glm4", {"partial_rotary_factor": 1.0}, "yarn with the glm4 family's interleaved RoPE"),
    ("qwen3", {"rope_scaling": {**QWEN3_YARN["rope_scaling"], "attention_factor": 1.0}}, "yarn attention_factor 1.0"),
    ("qwen3", {"rope_scaling": {**QWEN3_YARN["rope_scaling"], "factor": "4"}}, "yarn factor '4'"),
    ("qwen3", {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}}, "RoPE scaling 'dynamic'"),
])
def test_what_megatron_cores_yarn_cannot_compute_is_refused(name, change, fragment):
    with pytest.raises(CheckpointError, match="bridge cannot convert this model") as error:
        FAMILIES[name].model_fields({**QWEN3_YARN, "model_type": name, **change}, WHERE)
    assert fragment in str(error.value)


def test_attention_factor_is_transformers_default():
    assert attention_factor(32.0, 1.0, 0.0) == 0.1 * math.log(32.0) + 1.0
    assert attention_factor(1.0, 1.0, 0.0) == 1.0
