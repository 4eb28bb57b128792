"""The torch spec's core attention: packed documents, sliding windows and sinks against references.

References: each document run alone through the causal path; megatron-core's own
``reset_attention_mask`` mask and THD ``PackedSeqParams``; transformers' GPT-OSS attention
(sinks, sliding window). The FlexAttention path (the GPU's) is compared with the CPU path here in
its forward (torch runs FlexAttention's backward on the GPU only; tests/gpu covers both).
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.transformer.enums import AttnMaskType

from bridge_cli.data.documents import documents_from_eod
from bridge_cli.models.attention import kernels
from bridge_cli.models.attention.core import TorchAttention
from bridge_cli.models.attention.masks import MaskInputs, build_mask, document_params, layer_window
from bridge_cli.models.provider import GPTModelProvider

HEADS, GROUPS, DIM = 4, 2, 16
LENGTHS = [(7, 12, 1, 12), (20, 5, 7)]  # documents of each of two rows of 32 tokens
SEQ = 32


def attention(**fields) -> TorchAttention:
    base = dict(num_layers=4, hidden_size=HEADS * DIM, num_attention_heads=HEADS, num_query_groups=GROUPS,
                attention_dropout=0.0)
    config = GPTModelProvider(**{**base, **fields})
    return TorchAttention(config, layer_number=1, attn_mask_type=AttnMaskType.causal, attention_type="self")


def inputs(seq: int = SEQ, batch: int = 2, seed: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(seq, batch, HEADS, DIM, generator=generator)
    k, v = (torch.randn(seq, batch, GROUPS, DIM, generator=generator) for _ in range(2))
    return [t.requires_grad_() for t in (q, k, v)]


def document_ids() -> torch.Tensor:
    return torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in LENGTHS])


def forward_backward(module, qkv, **kwargs):
    out = module(*qkv, **kwargs)
    grads = torch.autograd.grad(out.square().sum(), qkv)
    return out.detach(), grads


def test_documents_match_each_document_run_alone():
    module, qkv = attention(), inputs()
    out, grads = forward_backward(module, qkv, packed_seq_params=document_params(document_ids()))
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            part = [t[start:start + length, row:row + 1].detach().requires_grad_() for t in qkv]
            alone, alone_grads = forward_backward(module, part)  # the plain causal path
            torch.testing.assert_close(out[start:start + length, row:row + 1], alone, rtol=1e-5, atol=1e-5)
            for grad, alone_grad in zip(grads, alone_grads):
                torch.testing.assert_close(grad[start:start + length, row:row + 1], alone_grad, rtol=1e-5, atol=1e-5)
            start += length
    whole, _ = forward_backward(module, qkv)
    assert not torch.allclose(whole, out, atol=1e-3), "documents did not change the attention"


def test_thd_cu_seqlens_match_documents():
    """megatron-core's packed format: one row of all tokens, [t, heads, d], boundaries in cu_seqlens."""
    lengths = LENGTHS[0]
    cu_seqlens = torch.cumsum(torch.tensor([0, *lengths]), 0).to(torch.int32)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                          max_seqlen_q=max(lengths), max_seqlen_kv=max(lengths))
    module, qkv = attention(), inputs(batch=1)
    packed, _ = forward_backward(module, [t.detach()[:, 0].requires_grad_() for t in qkv], packed_seq_params=thd)
    rows, _ = forward_backward(module, qkv, packed_seq_params=document_params(document_ids()[:1]))
    torch.testing.assert_close(packed.view_as(rows), rows, rtol=1e-6, atol=1e-6)


def test_megatron_dataset_mask_matches_document_ids():
    """The [s, s] mask megatron-core's GPT dataset builds with reset_attention_mask=true, given as attention_mask."""
    eod = 0
    tokens = torch.tensor([[5, 3, 0, 4, 4, 4, 0, 0, 9] + [7] * 23, [2] * 20 + [0] + [3] * 11])
    masks = [_get_ltor_masks_and_position_ids(row, eod, False, True, False, True)[0] for row in tokens]
    module, qkv = attention(), inputs()
    given, given_grads = forward_backward(module, qkv, attention_mask=torch.stack(masks))
    ours, our_grads = forward_backward(module, qkv, packed_seq_params=document_params(documents_from_eod(tokens, eod)))
    torch.testing.assert_close(given, ours, rtol=1e-6, atol=1e-6)
    for a, b in zip(given_grads, our_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("skip, windowed", [(None, [1, 2, 3, 4]), (2, [1, 3]), ([1, 1, 0, 1], [1, 2, 4])])
def test_window_layers_follow_window_attn_skip_freq(skip, windowed):
    config = GPTModelProvider(num_layers=4, hidden_size=64, num_attention_heads=4, window_size=(8, 0),
                              window_attn_skip_freq=skip)
    assert [n for n in range(1, 5) if layer_window(config, n) == 8] == windowed
    assert all(layer_window(config, n) is None for n in range(1, 5) if n not in windowed)


def gpt_oss_attention(qkv, sinks: torch.Tensor, window: int | None):
    """transformers' GPT-OSS eager attention on [b, heads, s, d] tensors, with its additive mask."""
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    q, k, v = (t.permute(1, 2, 0, 3) for t in qkv)
    seq = q.shape[2]
    position = torch.arange(seq)
    allowed = position[None, :] <= position[:, None]
    if window is not None:  # GPT-OSS's sliding_window W keeps the W most recent keys, the query's own included
        allowed &= position[:, None] - position[None, :] < window
    additive = torch.zeros(seq, seq).masked_fill(~allowed, float("-inf"))
    module = torch.nn.Module()
    module.sinks, module.num_key_value_groups = sinks, HEADS // GROUPS
    out, _ = eager_attention_forward(module, q, k, v, additive, scaling=DIM ** -0.5)
    return out.permute(1, 0, 2, 3).reshape(seq, q.shape[0], -1)  # [b, s, h, d] -> [s, b, h*d]


@pytest.mark.parametrize("window", [None, 6])
def test_learnable_sinks_match_gpt_oss(window):
    pytest.importorskip("transformers")
    module = attention(softmax_type="learnable", **({"window_size": (window - 1, 0)} if window else {}))
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        module.softmax_offset.copy_(sinks)
    qkv = inputs()
    ours = module(*qkv)
    reference_sinks = sinks.clone().requires_grad_()
    theirs = gpt_oss_attention(qkv, reference_sinks, window)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)
    our_grads = torch.autograd.grad(ours.square().sum(), [*qkv, module.softmax_offset])
    their_grads = torch.autograd.grad(theirs.square().sum(), [*qkv, reference_sinks])
    for a, b in zip(our_grads, their_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert "softmax_offset" in module.state_dict()


def test_off_by_one_is_a_zero_sink():
    module, reference = attention(softmax_type="off-by-one"), attention(softmax_type="learnable")
    with torch.no_grad():
        reference.softmax_offset.zero_()
    qkv = inputs()
    torch.testing.assert_close(module(*qkv), reference(*qkv), rtol=1e-6, atol=1e-6)
    assert "softmax_offset" not in module.state_dict()  # megatron-core keeps it out of checkpoints too


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("softcap", [None, 0.5])
def test_flex_path_matches_the_cpu_path(window, with_sinks, softcap):
    q, k, v = (t.detach().permute(1, 2, 0, 3) for t in inputs())
    documents = document_ids()
    sinks = torch.randn(HEADS) if with_sinks else None
    tokens = MaskInputs(SEQ, SEQ, torch.device("cpu"), documents, documents)
    dense = kernels.dense(q, k, v, build_mask(tokens, window, flex=False), 0.25, sinks, 0.0, softcap)
    flex = kernels.flex(q, k, v, build_mask(tokens, window, flex=True), 0.25, sinks, softcap)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-5)


def test_soft_capped_scores_follow_the_formula():
    """Gemma 2: each scaled score s becomes c * tanh(s / c) before the causal mask and the softmax."""
    qkv = inputs()
    ours = attention(attn_logit_softcapping=0.5)(*qkv)
    q, k, v = (t.detach().permute(1, 2, 0, 3) for t in qkv)
    k, v = (t.repeat_interleave(HEADS // GROUPS, dim=1) for t in (k, v))
    scores = 0.5 * torch.tanh(q @ k.transpose(-2, -1) / DIM ** 0.5 / 0.5)
    scores = scores.masked_fill(~torch.ones(SEQ, SEQ, dtype=torch.bool).tril(), float("-inf"))
    expected = (scores.softmax(-1) @ v).permute(2, 0, 1, 3).reshape(SEQ, 2, HEADS * DIM)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ours, attention()(*qkv), atol=1e-2)  # the cap changed the result


def test_a_window_right_of_the_query_is_refused():
    from bridge_cli.runtime.errors import RuntimeUnavailable

    with pytest.raises(RuntimeUnavailable, match=r"model.window_size=\[4, 2\].*right side must be 0"):
        attention(window_size=(4, 2))
