"""Multi-latent attention on the torch spec (bridge_cli/models/mla.py): megatron-core's MLASelfAttention builds
without Transformer Engine, rows of several documents attend and rotate per document, checkpoints carry
Transformer Engine's keys, and what it cannot do is refused naming the field. Logits against transformers'
DeepSeek-V3 (q_lora_rank set and null, YaRN with mscale/mscale_all_dim, TP=1 and TP=2):
tests/integration/test_convert_hf.py."""

from __future__ import annotations

import pytest
import torch

from bridge_cli.runtime.errors import RuntimeUnavailable

MLA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=32, ffn_hidden_size=96,
           normalization="RMSNorm", gated_linear_unit=True, add_bias_linear=False, position_embedding_type="rope",
           spec="torch", use_cpu_initialization=True, multi_latent_attention=True, qk_layernorm=True,
           kv_lora_rank=16, qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=24, rope_type="yarn",
           rotary_scaling_factor=4.0, original_max_position_embeddings=16, mscale=0.707, mscale_all_dim=1.0,
           hidden_dropout=0.0, attention_dropout=0.0)


def mla_model(**changes):
    from bridge_cli.models.provider import GPTModelProvider

    torch.manual_seed(0)
    config = GPTModelProvider(**{**MLA, "activation_func": torch.nn.functional.silu, **changes})
    return config.provide().eval()


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_megatron_core_mla_builds_on_the_torch_spec_with_two_head_sizes(one_process, q_lora_rank):
    from megatron.core.transformer.multi_latent_attention import MLASelfAttention

    from bridge_cli.models.attention.core import TorchAttention

    model = mla_model(q_lora_rank=q_lora_rank)
    attention = model.decoder.layers[0].self_attention
    assert isinstance(attention, MLASelfAttention) and isinstance(attention.core_attention, TorchAttention)
    assert hasattr(attention, "linear_q_proj") == (q_lora_rank is None)
    logits = model(torch.randint(0, 128, (2, 16)), torch.arange(16).expand(2, -1), None)
    assert logits.shape == (2, 16, 128) and torch.isfinite(logits).all()


QUERY_KEYS = {24: {"self_attention.linear_q_down_proj.weight", "self_attention.linear_q_up_proj.layer_norm_weight",
                   "self_attention.linear_q_up_proj.weight"},
              None: {"self_attention.linear_q_proj.weight"}}


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_checkpoint_keys_are_transformer_engines(one_process, q_lora_rank):
    """The latent norms as Transformer Engine's fused up projections hold them, the dense MLP's norm in linear_fc1:
    a checkpoint written on the torch spec loads in a Transformer Engine (Megatron-LM) run. Without a query latent
    the query has one projection and no norm (DeepSeek-V2-Lite's q_proj), on every megatron-core version."""
    state = mla_model(q_lora_rank=q_lora_rank).sharded_state_dict()  # module names -> tensors under checkpoint keys
    keys = {state[name].key.removeprefix("decoder.layers.") for name in state
            if name.startswith("decoder.layers.0.") and not name.endswith("_extra_state")}
    assert keys == {"input_layernorm.weight", *QUERY_KEYS[q_lora_rank], "self_attention.linear_kv_down_proj.weight",
                    "self_attention.linear_kv_up_proj.layer_norm_weight", "self_attention.linear_kv_up_proj.weight",
                    "self_attention.linear_proj.weight", "mlp.linear_fc1.layer_norm_weight", "mlp.linear_fc1.weight",
                    "mlp.linear_fc2.weight"}


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_without_a_query_latent_the_spec_has_no_query_norm(q_lora_rank):
    """megatron-core 0.19 refuses to build an MLA layer whose spec has a q_layernorm that q_lora_rank=null leaves
    unused ("`q_layernorm=...WrappedTorchNorm` is non-trivial, but `q_lora_rank is None`"); 0.16 to 0.18 skip it."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from bridge_cli.models.provider import GPTModelProvider
    from bridge_cli.models.specs import layer_spec

    config = GPTModelProvider(**{**MLA, "q_lora_rank": q_lora_rank})
    attention = layer_spec("torch", config).submodules.self_attention.submodules
    assert attention.q_layernorm is (IdentityOp if q_lora_rank is None else WrappedTorchNorm)
    assert attention.kv_layernorm is WrappedTorchNorm


def test_a_row_of_two_documents_computes_each_as_if_alone(one_process):
    """Per-document masks (the core attention) and RoPE from 0 in each document (the attention's own table,
    gathered at the document positions): the second document's logits equal those of it alone."""
    from bridge_cli.models.attention.masks import document_params

    model = mla_model(q_lora_rank=24)
    tokens = torch.randint(0, 128, (1, 16), generator=torch.Generator().manual_seed(1))
    documents = torch.tensor([[0] * 6 + [1] * 10])
    positions = torch.cat([torch.arange(6), torch.arange(10)]).unsqueeze(0)
    with torch.no_grad():
        packed = model(tokens, positions, None, packed_seq_params=document_params(documents, positions))
        first = model(tokens[:, :6], torch.arange(6).unsqueeze(0), None)
        second = model(tokens[:, 6:], torch.arange(10).unsqueeze(0), None)
        unmasked = model(tokens, torch.arange(16).unsqueeze(0), None)
    torch.testing.assert_close(packed[:, :6], first, rtol=0, atol=1e-5)
    torch.testing.assert_close(packed[:, 6:], second, rtol=0, atol=1e-5)
    assert (unmasked[:, 6:] - second).abs().max() > 1e-3


def test_what_the_torch_spec_cannot_do_is_refused_naming_the_field(one_process):
    with pytest.raises(RuntimeUnavailable, match="model.multi_latent_attention=true needs model.spec=torch"):
        mla_model(spec="local")
    with pytest.raises(RuntimeUnavailable, match=r"model.fp8=e4m3 with model.multi_latent_attention"):
        mla_model(fp8="e4m3")


def test_latents_that_do_not_split_over_the_tensor_parallel_ranks_are_refused():
    from types import SimpleNamespace

    from bridge_cli.models.mla import check_config

    config = SimpleNamespace(fp8=None, cache_mla_latents=False, apply_rope_fusion=False, tensor_model_parallel_size=4,
                             q_lora_rank=24, kv_lora_rank=14, qk_pos_emb_head_dim=8)
    with pytest.raises(RuntimeUnavailable, match=r"model.kv_lora_rank \+ model.qk_pos_emb_head_dim = 22 is not a "
                                                 "multiple of model.tensor_model_parallel_size=4"):
        check_config(config, "torch")


def test_the_fused_down_projection_is_refused_on_the_torch_spec():
    """megatron-core 0.19's model.mla_down_proj_fusion builds a fused down projection on the te spec only; the
    torch spec's local layer spec would leave it out without a word."""
    from types import SimpleNamespace

    from bridge_cli.models.mla import check_config

    config = SimpleNamespace(fp8=None, cache_mla_latents=False, apply_rope_fusion=False, mla_down_proj_fusion=True,
                             tensor_model_parallel_size=1, q_lora_rank=24, kv_lora_rank=16, qk_pos_emb_head_dim=8)
    with pytest.raises(RuntimeUnavailable, match="model.mla_down_proj_fusion=true .* set it to false or model.spec=te"):
        check_config(config, "torch")


def test_the_masked_kernels_take_value_heads_of_another_size():
    """FlexAttention (the GPU's masked path; torch's reference here) and the dense path agree with causal SDPA
    when the values' head size (MLA's v_head_dim) differs from the queries' and keys'."""
    from torch.nn.attention.flex_attention import create_block_mask

    from bridge_cli.models.attention import kernels

    generator = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 16, 24, generator=generator) for _ in range(2))
    v = torch.randn(1, 2, 16, 16, generator=generator)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.3)
    block = create_block_mask(lambda b, h, query, key: query >= key, None, None, 16, 16, device="cpu")
    flex = kernels.flex(q, k, v, block, 0.3, None)
    dense = kernels.dense(q, k, v, torch.ones(16, 16, dtype=torch.bool).tril(), 0.3, torch.zeros(2), 0.0)
    assert flex.shape == dense.shape == (1, 2, 16, 16)
    torch.testing.assert_close(flex, expected, rtol=0, atol=1e-5)
    # a sink of -inf weighs nothing: the written-out softmax with sinks is the plain one
    sinkless = kernels.dense(q, k, v, torch.ones(16, 16, dtype=torch.bool).tril(), 0.3, torch.full((2,), -1e9), 0.0)
    torch.testing.assert_close(sinkless, expected, rtol=0, atol=1e-5)


@pytest.mark.slow  # inductor compiles two layers: 5 s on 2 cores
def test_compiled_layers_equal_eager_on_the_cpu(one_process):
    """model.compile_layers with MLA on the CPU, where SDPA is traced as its math: inductor's attention-fusion
    pattern assumes one head size and failed to trace MLA's two (regional_compile turns it off there)."""
    from bridge_cli.models.regional_compile import compile_layers

    tokens = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    positions = torch.arange(16).expand(2, -1)
    runs = []
    for compiled in (False, True):
        model = mla_model(q_lora_rank=24, v_head_dim=16).train()
        if compiled:
            torch._dynamo.reset()
            compile_layers([model])
        logits = model(tokens, positions, None)
        logits.log_softmax(-1).mean().backward()
        runs.append((logits.detach(), [p.grad for p in model.parameters()]))
    (eager, eager_grads), (got, grads) = runs
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(grads, eager_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
