"""The GPU path of the torch spec's attention (compiled FlexAttention with block masks) against the CPU
path (explicit masks), forward and backward, and a pretraining run with per-document masks."""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import bridge
from tests.unit.test_core_attention import HEADS, LENGTHS, SEQ, attention, document_ids, inputs

pytestmark = pytest.mark.gpu


def run_attention(module, qkv, **kwargs):
    out = module(*qkv, **kwargs)
    params = [*qkv] + ([module.softmax_offset] if isinstance(module.softmax_offset, torch.nn.Parameter) else [])
    return out.detach(), torch.autograd.grad(out.square().sum(), params)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("softmax_type", ["vanilla", "learnable"])
@pytest.mark.parametrize("documents", [False, True])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_flex_on_the_gpu_equals_the_cpu_path(window, softmax_type, documents, softcap):
    from bridge_cli.models.attention.masks import document_params

    fields = dict(softmax_type=softmax_type, **({"window_size": (window, 0)} if window else {}),
                  **({"attn_logit_softcapping": softcap} if softcap else {}))
    cpu = attention(**fields).cpu()  # the sink parameter is built on the GPU where there is one
    if softmax_type == "learnable":
        with torch.no_grad():
            cpu.softmax_offset.copy_(torch.randn(HEADS, generator=torch.Generator().manual_seed(2)))
    gpu = attention(**fields).cuda()
    gpu.load_state_dict(cpu.state_dict())
    qkv = inputs()
    kwargs = lambda device: ({"packed_seq_params": document_params(document_ids().to(device))} if documents else {})
    expected, expected_grads = run_attention(cpu, qkv, **kwargs("cpu"))
    got, got_grads = run_attention(gpu, [t.detach().cuda().requires_grad_() for t in qkv], **kwargs("cuda"))
    torch.testing.assert_close(got.cpu(), expected, rtol=2e-4, atol=2e-4)
    for a, b in zip(got_grads, expected_grads):
        torch.testing.assert_close(a.cpu(), b, rtol=2e-3, atol=2e-3)


def test_documents_in_bf16_match_each_document_alone():
    from bridge_cli.models.attention.masks import document_params

    module = attention().cuda()
    qkv = [t.detach().cuda().bfloat16().requires_grad_() for t in inputs()]
    out, _ = run_attention(module, qkv, packed_seq_params=document_params(document_ids().cuda()))
    for row, lengths in enumerate(LENGTHS):
        start = 0
        for length in lengths:
            part = [t[start:start + length, row:row + 1].detach().requires_grad_() for t in qkv]
            alone, _ = run_attention(module, part)
            torch.testing.assert_close(out[start:start + length, row:row + 1], alone, rtol=2e-2, atol=2e-2)
            start += length
    assert out.shape[0] == SEQ


def test_pretraining_with_document_masks_trains(tmp_path):
    result = bridge("pretrain", "recipe=gpt2_124m", "model.spec=torch", "train.train_iters=20",
                    "train.micro_batch_size=8", "train.global_batch_size=16", "logger.log_interval=10", "train.eval_iters=0",
                    "dataset.reset_attention_mask=true", "dataset.reset_position_ids=true")
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"lm loss ([0-9.]+)", result.stdout)]
    assert len(losses) >= 2 and losses[-1] < losses[0], result.stdout[-2000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_context_parallel_on_two_gpus_follows_one(tmp_path):
    """CP=2 without Transformer Engine (NCCL all-gather of keys and values, FlexAttention with the row
    places) follows the one-GPU loss curve, with per-document masks and a sliding window."""
    from tests.conftest import torchrun
    from tests.integration.test_pretrain_cpu import losses

    args = ["recipe=tiny", "model.spec=torch", "train.train_iters=10", "logger.log_interval=1", "train.eval_iters=0",
            "dataset.reset_attention_mask=true", "dataset.reset_position_ids=true", "model.window_size=[16,0]",
            "model.window_attn_skip_freq=2"]
    one = bridge("pretrain", *args)
    two = torchrun(2, "pretrain", *args, "model.context_parallel_size=2")
    assert one.returncode == 0 and two.returncode == 0, one.stderr[-2000:] + two.stderr[-2000:]
    assert losses(two.stdout) == pytest.approx(losses(one.stdout), rel=1e-3)
