"""Every field of a family's transformers config class is accounted for: mapped onto the model, assumed (another
value refused) or inert (the logits do not depend on it), in the family's tables (mapped_keys, assumed, inert_keys);
and a key config.json lacks means its class's default (bridge_cli/convert/families/hf_defaults.py). Logits of folders
whose config.json leaves keys out: test_convert_hf.py's test_a_key_config_json_leaves_out_means_transformers_default.
"""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path

import pytest

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.convert.families import FAMILIES
from bridge_cli.convert.families.hf_defaults import ALIASES, DEFAULTS, PER_LAYER_ROPE, ROPE_DEFAULTS

transformers = pytest.importorskip("transformers")

WHERE = Path("hf/config.json")
SHAPE = {"hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 128}


def config_class(model_type: str):
    return type(transformers.AutoConfig.for_model(model_type))


def class_defaults(cls) -> dict:
    base = {field.name for field in dataclasses.fields(transformers.PreTrainedConfig)}
    return {field.name: field.default if field.default is not dataclasses.MISSING else field.default_factory()
            for field in dataclasses.fields(cls) if field.name not in base}


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_each_family_reads_an_absent_key_at_its_transformers_default(model_type):
    cls = config_class(model_type)
    assert DEFAULTS[model_type] == class_defaults(cls)
    assert ALIASES.get(model_type, {}) == cls.attribute_map
    if model_type == "gpt2" or model_type in PER_LAYER_ROPE:
        return
    theta, partial, scaling = ROPE_DEFAULTS[model_type]
    rope = cls().rope_parameters
    assert (theta, partial) == (cls.default_theta, rope.get("partial_rotary_factor"))
    assert {key: value for key, value in rope.items() if key not in ("rope_theta", "partial_rotary_factor")} == (
        scaling or {"rope_type": "default"})


@pytest.mark.parametrize("model_type", list(FAMILIES))
def test_every_field_of_the_config_class_is_mapped_assumed_or_inert(model_type):
    family = FAMILIES[model_type]
    tables = {"mapped_keys": set(family.mapped_keys), "assumed": set(family.assumed),
              "inert_keys": set(family.inert_keys)}
    for (one, keys), (other, more) in itertools.combinations(tables.items(), 2):
        assert not keys & more, f"{model_type}: {keys & more} in both {one} and {other}"
    defaults = class_defaults(config_class(model_type))
    unaccounted = [key for key in defaults if not any(key in keys for keys in tables.values())]
    assert unaccounted == [], f"{model_type}: fields of its config class in none of its tables"
    for key, value in family.assumed.items():  # a config.json without the key must not be refused
        if key in defaults:
            assert (bool(defaults[key]) == value) if isinstance(value, bool) else defaults[key] == value, key


@pytest.mark.parametrize("model_type, change", [
    ("qwen2_moe", {"qkv_bias": False}), ("qwen3", {"attention_bias": True}), ("starcoder2", {"use_bias": False}),
    ("gpt_oss", {"swiglu_alpha": 1.0}), ("mixtral", {"router_jitter_noise": 0.1}), ("olmoe", {"clip_qkv": 8.0}),
    ("gemma", {"use_bidirectional_attention": True}), ("stablelm", {"use_parallel_residual": True}),
    ("seed_oss", {"attention_out_bias": True}), ("gpt2", {"add_cross_attention": True}),
    ("ernie4_5", {"use_bias": True}),
])
def test_an_assumed_field_with_another_value_is_refused_naming_it_and_the_file(model_type, change):
    config = {"model_type": model_type, **SHAPE, "num_local_experts": 4, "num_experts": 4, "head_dim": 16, **change}
    with pytest.raises(CheckpointError, match="bridge cannot convert this model") as error:
        FAMILIES[model_type].model_fields(config, WHERE)
    assert str(error.value).startswith(f"{WHERE}: ") and next(iter(change)) in str(error.value)


@pytest.mark.parametrize("model_type, config, field, expected", [
    ("starcoder2", {}, "share_embeddings_and_output_weights", True),  # tie_word_embeddings left out: tied
    ("gemma", {}, "share_embeddings_and_output_weights", True),
    ("llama", {}, "share_embeddings_and_output_weights", False),
    ("glm4", {"head_dim": 16}, "rotary_percent", 0.5),  # partial_rotary_factor left out
    ("stablelm", {}, "rotary_percent", 0.25),
    ("phi3", {}, "rotary_percent", 1.0),
    ("stablelm", {"partial_rotary_factor": 0.5}, "rotary_percent", 0.5),  # transformers 4.x's top-level key
    ("glm4", {"head_dim": 16, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 1.0}},
     "rotary_percent", 1.0),
    ("mixtral", {"num_local_experts": 4}, "rotary_base", 1_000_000),  # rope_theta left out
    ("mistral", {}, "rotary_base", 10_000),
    ("llama", {"rope_theta": 500000.0}, "rotary_base", 500_000),  # 4.x's top-level key
    ("llama", {"rope_parameters": {"rope_type": "default", "rope_theta": 500000.0}, "rope_theta": 10.0},
     "rotary_base", 500_000),  # rope_parameters first, as transformers reads them
    ("mixtral", {"num_local_experts": 4}, "layernorm_epsilon", 1e-5),  # rms_norm_eps left out
    ("glm4", {"head_dim": 16}, "layernorm_epsilon", 1.5625e-07),
    ("qwen3", {}, "kv_channels", 128),  # head_dim left out: Qwen3Config's 128, not hidden / heads
    ("qwen2", {}, "kv_channels", 16),
    ("starcoder2", {}, "layernorm_epsilon", 1e-5),
    ("ernie4_5", {}, "share_embeddings_and_output_weights", True),
    ("ernie4_5", {}, "rotary_base", 500_000),
    ("ernie4_5", {}, "kv_channels", 128),
    ("ernie4_5", {"attention_dropout": 0.1}, "attention_dropout", 0.0),  # transformers' ERNIE 4.5 ignores it
])
def test_a_key_config_json_leaves_out_means_what_transformers_makes_of_it(model_type, config, field, expected):
    fields = FAMILIES[model_type].model_fields({"model_type": model_type, **SHAPE, **config}, WHERE)
    assert fields[field] == expected


@pytest.mark.parametrize("model_type, key", [("qwen3_moe", "num_local_experts"), ("qwen3_moe", "num_experts"),
                                             ("olmoe", "num_local_experts"), ("mixtral", "num_experts")])
def test_either_name_of_the_expert_count_sets_it(model_type, key):
    config = {"model_type": model_type, **SHAPE, key: 4, "num_experts_per_tok": 2, "moe_intermediate_size": 48}
    assert FAMILIES[model_type].model_fields(config, WHERE)["num_moe_experts"] == 4


def test_gpt_oss_without_rope_settings_has_its_class_default_yarn():
    fields = FAMILIES["gpt_oss"].model_fields({"model_type": "gpt_oss", **SHAPE, "num_local_experts": 4}, WHERE)
    assert (fields["position_embedding_type"], fields["rotary_base"], fields["yarn_rotary_scaling_factor"],
            fields["yarn_original_max_position_embeddings"], fields["yarn_correction_range_round_to_int"]) == (
        "yarn", 150_000, 32.0, 4096, False)


PART_OF_EACH_HEAD = ("phi3", "glm4", "stablelm", "gpt2", "glm4_moe")
"""Families whose RoPE may rotate part of each head (GPT-2 has none to refuse)."""


@pytest.mark.parametrize("model_type", [name for name in FAMILIES if name not in PART_OF_EACH_HEAD])
def test_partial_rotary_factor_is_refused_where_the_family_rotates_whole_heads(model_type):
    config = {"model_type": model_type, **SHAPE, "num_local_experts": 4, "num_experts": 4, "head_dim": 16,
              "partial_rotary_factor": 0.5}
    with pytest.raises(CheckpointError, match="partial_rotary_factor 0.5") as error:
        FAMILIES[model_type].model_fields(config, WHERE)
    assert "bridge cannot convert this model" in str(error.value)


@pytest.mark.parametrize("bias, norm", [(False, False), (True, True), (True, False)])
def test_glm4_moe_takes_its_biases_and_qk_norms_from_config_json_and_writes_them_back(bias, norm):
    """GLM-4.5's q/k/v biases and per-head q/k norms are switches of config.json (absent: off, transformers'
    defaults), not fixed as in the other families: the model's fields follow them, and export writes them back."""
    family = FAMILIES["glm4_moe"]
    config = {"model_type": "glm4_moe", **SHAPE, "n_routed_experts": 4, "num_experts_per_tok": 2, "head_dim": 16,
              **({"attention_bias": True} if bias else {}), **({"use_qk_norm": True} if norm else {})}
    fields = family.model_fields(config, WHERE)
    assert (fields["add_qkv_bias"], fields["qk_layernorm"], fields["rotary_percent"]) == (bias, norm, 0.5)
    model = {**fields, "params_dtype": "float32"}
    assert family.differences(model) == []
    written = family.hf_config(model)
    assert (written["attention_bias"], written["use_qk_norm"], written["partial_rotary_factor"]) == (bias, norm, 0.5)


def test_glm4_moe_export_refuses_a_scaled_rope():
    """transformers' GLM-4.5 family is converted with plain RoPE only: a model trained with Llama 3.1's or YaRN's
    scaling has no glm4_moe config.json that computes the same."""
    family = FAMILIES["glm4_moe"]
    config = {"model_type": "glm4_moe", **SHAPE, "n_routed_experts": 4, "num_experts_per_tok": 2, "head_dim": 16}
    model = {**family.model_fields(config, WHERE), "params_dtype": "float32"}
    assert family.differences({**model, "rope_scaling": True}) == ["model.rope_scaling=True"]
    assert "model.position_embedding_type=yarn" in family.differences({**model, "position_embedding_type": "yarn"})


def test_the_released_ernie_4_5_config_converts_as_transformers_reads_it():
    """ERNIE-4.5-0.3B's config.json as released (its -PT and -Base-PT folders; the first releases' remote-code
    ``Ernie4_5_ForCausalLM`` with ``auto_map`` read the same keys): GQA with 128-wide heads, tied embeddings, RoPE
    on interleaved pairs with base 500000, no biases."""
    config = {"architectures": ["Ernie4_5ForCausalLM"], "model_type": "ernie4_5", "bos_token_id": 1, "eos_token_id": 2,
              "pad_token_id": 0, "head_dim": 128, "hidden_act": "silu", "hidden_size": 1024, "intermediate_size": 3072,
              "max_position_embeddings": 131072, "num_attention_heads": 16, "num_hidden_layers": 18,
              "num_key_value_heads": 2, "rms_norm_eps": 1e-05, "rope_theta": 500000, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16", "use_bias": False, "use_cache": False, "vocab_size": 103424}
    fields = FAMILIES["ernie4_5"].model_fields(config, WHERE)
    assert {key: fields[key] for key in ("num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
                                         "num_query_groups", "kv_channels", "share_embeddings_and_output_weights",
                                         "rotary_base", "rotary_interleaved", "rope_scaling", "add_qkv_bias",
                                         "add_bias_linear", "layernorm_epsilon")} == {
        "num_layers": 18, "hidden_size": 1024, "ffn_hidden_size": 3072, "num_attention_heads": 16,
        "num_query_groups": 2, "kv_channels": 128, "share_embeddings_and_output_weights": True, "rotary_base": 500_000,
        "rotary_interleaved": True, "rope_scaling": False, "add_qkv_bias": False, "add_bias_linear": False,
        "layernorm_epsilon": 1e-05}
