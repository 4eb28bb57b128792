"""GPT-OSS's pieces: megatron-core's YaRN RoPE (model.position_embedding_type=yarn) against transformers',
the gpt_oss family's reading and writing of config.json, its stacked-expert tensor layouts, and what it
refuses. The whole model against transformers' is tests/integration/test_convert_hf.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.convert.families import FAMILIES
from bridge_cli.convert.hf_weights import Architecture, to_hf, to_mcore
from tests.unit.test_cli_errors import assert_user_error

transformers = pytest.importorskip("transformers")

WHERE = Path("gpt-oss/config.json")
# openai/gpt-oss-20b's config.json (transformers 4.55's keys), less its 24 layer_types and MXFP4 quantization
GPT_OSS_20B = {"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "attention_bias": True,
               "attention_dropout": 0.0, "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
               "initializer_range": 0.02, "intermediate_size": 2880, "max_position_embeddings": 131072,
               "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
               "num_key_value_heads": 8, "num_local_experts": 32, "rms_norm_eps": 1e-05,
               "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                                "original_max_position_embeddings": 4096, "rope_type": "yarn", "truncate": False},
               "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
               "tie_word_embeddings": False, "vocab_size": 201088}
FAMILY = FAMILIES["gpt_oss"]


def yarn_model(rope: dict):
    """A one-layer megatron-core GPTModel whose RoPE is what the gpt_oss family makes of ``rope``."""
    from bridge_cli.models.provider import GPTModelProvider

    fields = FAMILY.rope_fields({"rope_scaling": rope, "rope_theta": 150000}, WHERE)
    config = GPTModelProvider(num_layers=1, hidden_size=64, num_attention_heads=2, kv_channels=64, vocab_size=128,
                              seq_length=8192, normalization="RMSNorm",
                              spec="torch", use_cpu_initialization=True, **fields)
    return config.provide()


def transformers_rope(rope: dict, positions: torch.Tensor):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssConfig, GptOssRotaryEmbedding

    config = GptOssConfig(head_dim=64, max_position_embeddings=131072,
                          rope_parameters={**rope, "rope_theta": 150000.0})
    rotary = GptOssRotaryEmbedding(config)
    return (*rotary(torch.zeros(1, dtype=torch.float32), positions[None]), rotary.attention_scaling)


YARN = GPT_OSS_20B["rope_scaling"]


@pytest.mark.parametrize("rope", [YARN, {**YARN, "truncate": True}, {**YARN, "factor": 4.0, "beta_fast": 16.0},
                                  {**YARN, "mscale": 0.707, "mscale_all_dim": 1.0}])
def test_yarn_rotates_queries_and_keys_as_transformers(one_process, rope):
    """The same frequencies bit for bit, and cos/sin scaled by the same attention factor (GPT-OSS's
    0.1 * ln(32) + 1, or the mscale ratio): megatron-core reads that factor from the config in every
    layer. Both rotate the two halves of each head, so a rotated query matches too."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
    from megatron.core.models.common.embeddings.yarn_rotary_pos_embedding import \
        _yarn_get_concentration_factor_from_config
    from transformers.models.gpt_oss.modeling_gpt_oss import apply_rotary_pos_emb as transformers_apply

    model = yarn_model(rope)
    positions = torch.arange(8192)
    emb, _ = model.rotary_pos_emb(8192)  # [s, 1, 1, d]: the frequencies twice
    scale = _yarn_get_concentration_factor_from_config(model.config)
    cos, sin, their_scale = transformers_rope(rope, positions)  # [1, s, d/2]
    assert scale == their_scale and (scale > 1 or "mscale" in rope)
    freqs = emb[:, 0, 0]
    assert torch.equal(freqs[:, :32], freqs[:, 32:])
    torch.testing.assert_close(freqs[:, :32].cos() * scale, cos[0], rtol=0, atol=0)
    torch.testing.assert_close(freqs[:, :32].sin() * scale, sin[0], rtol=0, atol=0)

    q = torch.randn(8192, 1, 2, 64, generator=torch.Generator().manual_seed(0))  # [s, b, heads, d]
    ours = apply_rotary_pos_emb(q, emb, config=model.config, mscale=scale)
    theirs, _ = transformers_apply(q.permute(1, 2, 0, 3), q.permute(1, 2, 0, 3), cos, sin)  # [b, heads, s, d]
    torch.testing.assert_close(ours, theirs.permute(2, 0, 1, 3), rtol=0, atol=1e-6)


def test_config_json_gives_the_model_fields():
    fields = FAMILY.model_fields(GPT_OSS_20B, WHERE)
    assert (fields["position_embedding_type"], fields["rotary_base"], fields["yarn_rotary_scaling_factor"],
            fields["yarn_original_max_position_embeddings"], fields["yarn_beta_fast"], fields["yarn_beta_slow"],
            fields["yarn_correction_range_round_to_int"]) == ("yarn", 150000, 32.0, 4096, 32.0, 1.0, False)
    assert (fields["yarn_mscale"], fields["yarn_mscale_all_dim"]) == (1.0, 0.0)  # factor 0.1 * ln(32) + 1
    assert fields["window_size"] == [127, 0] and fields["window_attn_skip_freq"] == [1, 0] * 12
    assert (fields["add_bias_linear"], fields["add_qkv_bias"], fields["softmax_type"]) == (True, True, "learnable")
    assert (fields["activation_func"], fields["glu_linear_offset"], fields["activation_func_clamp_value"]) == (
        "quick_gelu", 1.0, 7.0)
    assert (fields["num_moe_experts"], fields["moe_router_topk"], fields["moe_ffn_hidden_size"]) == (32, 4, 2880)
    assert fields["moe_router_pre_softmax"] is False and fields["moe_layer_freq"] == 1
    assert (fields["expert_tensor_parallel_size"], fields["moe_grouped_gemm"]) == (1, False)
    assert (fields["kv_channels"], fields["seq_length"], fields["moe_aux_loss_coeff"]) == (64, 4096, 0.9)
    # transformers 5's keys say the same
    rope = {**GPT_OSS_20B["rope_scaling"], "rope_theta": 150000.0}
    newer = {key: value for key, value in GPT_OSS_20B.items() if key not in ("rope_scaling", "rope_theta")}
    assert FAMILY.model_fields({**newer, "rope_parameters": rope}, WHERE) == fields


def test_export_writes_back_what_import_read():
    fields = FAMILY.model_fields(GPT_OSS_20B, WHERE)
    model = {"params_dtype": "bfloat16", **fields}
    assert not FAMILY.differences(model)
    config = FAMILY.hf_config(model)
    assert config["rope_scaling"] == {**GPT_OSS_20B["rope_scaling"], "truncate": False}
    assert config["layer_types"] == ["sliding_attention", "full_attention"] * 12 and config["sliding_window"] == 128
    assert (config["swiglu_limit"], config["swiglu_alpha"], config["attention_bias"]) == (7.0, 1.702, True)
    assert (config["intermediate_size"], config["num_local_experts"]) == (2880, 32)
    again = FAMILY.model_fields(config, WHERE)
    assert {key: again[key] for key in fields if key != "seq_length"} == {
        key: value for key, value in fields.items() if key != "seq_length"}
    unclamped = FAMILY.differences({**model, "activation_func_clamp_value": None, "yarn_mscale": 2.0})
    assert unclamped == ["model.yarn_mscale=2.0 with model.yarn_mscale_all_dim=0.0",
                         "model.activation_func_clamp_value=None"]


@pytest.mark.parametrize("change, fragment", [
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quantization_config (mxfp4)"),
    ({"attention_bias": False}, "attention_bias false"),
    ({"swiglu_alpha": 1.5}, "swiglu_alpha 1.5: megatron-core's quick_gelu"),
    ({"swiglu_limit": None}, "swiglu_limit None"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok 1"),
    ({"rope_scaling": {"rope_type": "default"}}, "RoPE 'default'"),
    ({"rope_scaling": {**YARN, "attention_factor": 1.0}}, "yarn attention_factor 1.0"),
    ({"rope_scaling": {**YARN, "partial_rotary_factor": 0.5}}, "partial_rotary_factor 0.5"),
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 12}, "layer_types"),
    ({"sliding_window": None}, "sliding_window None with sliding-window layers"),
])
def test_what_megatron_core_cannot_compute_is_refused(change, fragment):
    with pytest.raises(CheckpointError, match="bridge cannot convert this model") as error:
        FAMILY.model_fields({**GPT_OSS_20B, **change}, WHERE)
    assert fragment in str(error.value)


def test_stacked_experts_split_and_stack_again_bit_for_bit():
    """gate_up_proj [experts, hidden, 2 * ffn], gate and up interleaved, -> each expert's [gate; up] rows."""
    arch = Architecture.of(type("M", (), dict(
        num_layers=1, hidden_size=6, ffn_hidden_size=4, num_attention_heads=2, num_query_groups=2, kv_channels=3,
        vocab_size=8, share_embeddings_and_output_weights=False, add_qkv_bias=True, qk_layernorm=False,
        num_moe_experts=3, moe_ffn_hidden_size=4, moe_layer_freq=1, moe_shared_expert_intermediate_size=None,
        moe_router_enable_expert_bias=False))())
    pairs = {pair.hf_names[0].removeprefix("p.experts."): pair
             for pair in FAMILY.feed_forward_pairs(arch, 0, "m.", "p.")}
    gate_up = torch.randn(3, 6, 8)
    fc1 = to_mcore(pairs["gate_up_proj"], [gate_up], arch)
    assert pairs["gate_up_proj"].mcore_names == tuple(f"m.experts.local_experts.{j}.linear_fc1.weight"
                                                      for j in range(3))
    assert len(fc1) == 3 and fc1[1].shape == (8, 6)
    assert torch.equal(fc1[1][:4], gate_up[1, :, 0::2].t()) and torch.equal(fc1[1][4:], gate_up[1, :, 1::2].t())
    (back,) = to_hf(pairs["gate_up_proj"], fc1, arch)
    assert torch.equal(back, gate_up) and back.is_contiguous()
    down = torch.randn(3, 4, 6)
    fc2 = to_mcore(pairs["down_proj"], [down], arch)
    assert torch.equal(fc2[2], down[2].t()) and torch.equal(to_hf(pairs["down_proj"], fc2, arch)[0], down)
    for name, shape in (("gate_up_proj_bias", (3, 8)), ("down_proj_bias", (3, 6))):
        bias = torch.randn(shape)
        per_expert = to_mcore(pairs[name], [bias], arch)
        assert torch.equal(to_hf(pairs[name], per_expert, arch)[0], bias)
    assert torch.equal(per_expert[0], bias[0])
    assert torch.equal(to_mcore(pairs["gate_up_proj_bias"], [gate_up[:, 0]], arch)[2], fc1[2][:, 0])


@pytest.mark.parametrize("args, fragments", [
    (["model.yarn_rotary_scaling_factor=32"],
     ["yarn_rotary_scaling_factor applies to position_embedding_type=yarn only"]),
    (["model.position_embedding_type=yarn", "model.rotary_percent=0.5"],
     ["position_embedding_type=yarn needs rotary_percent=1.0"]),
    (["model.position_embedding_type=yarn", "model.rope_scaling=true"], ["needs rope_scaling=False"]),
])
def test_yarn_settings_megatron_core_would_not_honour_are_refused(cli, args, fragments):
    assert_user_error(cli("config", "validate", "recipe=tiny", *args), *fragments)
