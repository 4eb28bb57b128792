"""bridge's fused QKV split and RoPE (``model.fused_single_qkv_rope`` without Transformer Engine) against
megatron-core's own split and ``apply_rotary_pos_emb``, the registration torch.compile relies on, and the
settings it refuses. Its Triton kernels are checked on the GPU (tests/gpu/test_gpu_perf_options.py)."""

from __future__ import annotations

import pytest
import torch

from bridge_cli.models import qkv_rope
from tests.unit.test_cli_errors import assert_user_error


class _Config:
    """What megatron-core's unfused RoPE reads from a TransformerConfig."""

    apply_rope_fusion = False
    rotary_interleaved = False
    multi_latent_attention = False


def megatron_split_and_rope(mixed, freqs, q_per_group):
    """megatron-core's get_query_key_value_tensors split, then its RoPE on query and key."""
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    head = mixed.shape[-1] // (q_per_group + 2)
    query, key, value = torch.split(mixed, [q_per_group * head, head, head], dim=3)
    query = query.reshape(query.size(0), query.size(1), -1, head)
    # one context-parallel rank (megatron-core looks its group up in parallel_state when given none)
    rotate = [apply_rotary_pos_emb(t, freqs, config=_Config(), cp_group=_NoGroup()) for t in (query, key)]
    return (*rotate, value)


class _NoGroup:
    def size(self):
        return 1

    def rank(self):
        return 0


SHAPES = {
    "gqa": (5, 2, 2, 3, 16, 16, False),  # seq, batch, groups, query heads per group, head, rotary dim, angles per token
    "mha_partial": (4, 3, 4, 1, 12, 8, False),
    "per_token": (6, 2, 1, 2, 8, 8, True),
}


@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_forward_and_backward_equal_megatron_cores_split_and_rope(shape):
    seq, batch, groups, per_group, head, rotary, per_token = SHAPES[shape]
    generator = torch.Generator().manual_seed(0)
    mixed = torch.randn(seq, batch, groups, (per_group + 2) * head, dtype=torch.float64, generator=generator)
    angles = torch.rand(seq, batch if per_token else 1, 1, rotary // 2, dtype=torch.float64, generator=generator) * 9
    freqs = torch.cat([angles, angles], dim=-1)
    upstream = None
    results = []
    for split in (megatron_split_and_rope, lambda *args: qkv_rope.apply_fused_qkv_rotary_pos_emb(
            args[0], args[1], args[1], [args[2] * head, head, head])):
        x = mixed.clone().requires_grad_()
        outputs = split(x, freqs, per_group)
        upstream = upstream or [torch.randn(o.shape, dtype=o.dtype, generator=generator) for o in outputs]
        torch.autograd.backward(outputs, upstream)
        results.append(([o.detach() for o in outputs], x.grad))
    (want, want_grad), (got, got_grad) = results
    assert [o.shape for o in got] == [o.shape for o in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-12, atol=1e-12)


def test_the_ops_are_registered_for_torch_compile():
    """Schema, fake tensors, autograd and AOTAutograd tracing, as compiled layers use them."""
    mixed = torch.randn(4, 2, 2, 5 * 8, requires_grad=True)
    freqs = torch.rand(4, 1, 1, 8)
    torch.library.opcheck(torch.ops.bridge.qkv_rope.default, (mixed, freqs, 3))
    grads = [torch.randn(4, 2, 6, 8), torch.randn(4, 2, 2, 8), torch.randn(4, 2, 2, 8)]
    torch.library.opcheck(torch.ops.bridge.qkv_rope_backward.default, (*grads, freqs))


REFUSED = [
    (["model.qk_layernorm=true"], "q/k norms"),
    (["model.position_embedding_type=learned_absolute"], "model.position_embedding_type=learned_absolute"),
    (["model.rotary_interleaved=true"], "model.rotary_interleaved=true"),
    (["dataset.reset_attention_mask=true"], "dataset.reset_attention_mask"),
]


@pytest.mark.parametrize("args, fragment", REFUSED)
def test_settings_megatron_cores_fused_path_does_not_take_are_refused(cli, args, fragment):
    assert_user_error(cli("config", "validate", "recipe=tiny", "model.fused_single_qkv_rope=true", *args),
                      "model.fused_single_qkv_rope", fragment, "model.fused_single_qkv_rope=false")
