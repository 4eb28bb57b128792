"""model.fused_linear_cross_entropy's chunked projection and loss against the plain one, in float64:
the loss and both gradients, with chunks that do not divide the tokens, with and without a soft cap."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from bridge_cli.models.linear_cross_entropy import EAGER, LinearCrossEntropy, compiled_chunk_math


@pytest.mark.parametrize("chunk", [1, 8, 37, 100])
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_chunks_give_the_unfused_loss_and_gradients(chunk, softcap):
    torch.manual_seed(0)
    hidden = torch.randn(37, 16, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.float64, requires_grad=True)
    labels, upstream = torch.randint(0, 50, (37,)), torch.randn(37, dtype=torch.float64)

    logits = hidden @ weight.t()
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    expected = F.cross_entropy(logits, labels, reduction="none")
    expected_grads = torch.autograd.grad((expected * upstream).sum(), (hidden, weight))

    losses = LinearCrossEntropy.apply(hidden, weight, labels, None, chunk, softcap, EAGER)
    grads = torch.autograd.grad((losses * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(losses, expected, rtol=1e-12, atol=1e-12)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_bf16_weights_get_bf16_gradients_summed_in_fp32():
    torch.manual_seed(0)
    hidden = torch.randn(64, 32, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(96, 32, dtype=torch.bfloat16, requires_grad=True)
    labels = torch.randint(0, 96, (64,))
    losses = LinearCrossEntropy.apply(hidden, weight, labels, None, 16, None, EAGER)
    assert losses.dtype == torch.float32
    losses.sum().backward()
    assert hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    expected = F.cross_entropy((hidden.detach() @ weight.detach().t()).float(), labels, reduction="none")
    torch.testing.assert_close(losses, expected)



@pytest.mark.slow
@pytest.mark.parametrize("softcap", [None, 3.0])
def test_compiled_chunk_passes_give_the_eager_loss_and_gradients(softcap):
    """model.compile_layers compiles the passes between the GEMMs; bf16 logits, fp32 math, as on the GPU."""
    torch.manual_seed(0)
    hidden = torch.randn(40, 16, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.randn(50, 16, dtype=torch.bfloat16, requires_grad=True)
    labels, upstream = torch.randint(0, 50, (40,)), torch.randn(40)
    results = []
    for math in (EAGER, compiled_chunk_math()):
        losses = LinearCrossEntropy.apply(hidden, weight, labels, None, 16, softcap, math)
        results.append((losses, *torch.autograd.grad((losses * upstream).sum(), (hidden, weight))))
    for got, want in zip(results[1], results[0]):
        torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)

def build(fused: bool):
    from megatron.core.tensor_parallel import model_parallel_cuda_manual_seed

    from bridge_cli.models.provider import GPTModelProvider

    torch.manual_seed(0)
    model_parallel_cuda_manual_seed(0)
    return GPTModelProvider(
        num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=128, seq_length=16,
        position_embedding_type="rope", normalization="RMSNorm", add_bias_linear=False, hidden_dropout=0.0,
        attention_dropout=0.0, spec="torch", share_embeddings_and_output_weights=False,
        fused_linear_cross_entropy=fused, linear_cross_entropy_chunk=7).provide()


def test_a_gpt_model_never_projects_every_token_when_it_has_labels(one_process):
    fused, plain = build(True), build(False)
    fused.load_state_dict(plain.state_dict())
    projected = []
    fused.output_layer.register_forward_hook(lambda module, inputs, output: projected.append(output[0].shape[-1]))
    tokens = torch.randint(0, 128, (3, 16), generator=torch.Generator().manual_seed(1))
    positions, labels = torch.arange(16).expand(3, 16), torch.roll(tokens, -1, dims=1)

    loss = fused(tokens, positions, None, labels=labels)
    assert projected == [32]  # the output layer handed on the hidden states: no [tokens x vocabulary] logits
    expected = plain(tokens, positions, None, labels=labels)
    torch.testing.assert_close(loss, expected)
    loss.sum().backward()
    expected.sum().backward()
    for (name, got), want in zip(fused.named_parameters(), plain.parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)

    logits = fused(tokens, positions, None)  # asked for logits, it projects them as usual
    assert projected[-1] == 128
    torch.testing.assert_close(logits, plain(tokens, positions, None))
