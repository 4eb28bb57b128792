"""The word embedding's gradient added into main_grad by its backward (bridge_cli/models/embedding_wgrad.py)."""

from __future__ import annotations

import pytest
import torch

VOCAB, HIDDEN = 50, 8


def embedding():
    """A one-rank VocabParallelEmbedding made a MainGradEmbedding (needs the one_process fixture)."""
    from megatron.core.tensor_parallel import VocabParallelEmbedding
    from megatron.core.transformer import TransformerConfig

    from bridge_cli.models.embedding_wgrad import use_main_grad_embedding

    config = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=1, use_cpu_initialization=True)
    module = VocabParallelEmbedding(VOCAB, HIDDEN, init_method=torch.nn.init.normal_, config=config)
    use_main_grad_embedding(module)
    return module


@pytest.fixture
def tokens_and_grad():
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (4, 16), generator=generator)
    tokens[0, :5] = 7  # repeated rows add up
    return tokens, torch.randn(4, 16, HIDDEN, generator=generator)


def test_the_rows_go_into_main_grad_as_autograd_would_put_them_into_grad(one_process, tokens_and_grad):
    tokens, grad = tokens_and_grad
    module = embedding()
    leaf = module.weight.detach().clone().requires_grad_()
    torch.nn.functional.embedding(tokens, leaf).backward(grad)
    module.weight.main_grad = torch.full((VOCAB, HIDDEN), 0.5)  # what earlier micro-batches added
    module.weight.grad_added_to_main_grad = False
    module(tokens).backward(grad)
    torch.testing.assert_close(module.weight.main_grad, leaf.grad + 0.5, rtol=1e-6, atol=1e-6)
    assert module.weight.grad_added_to_main_grad


@pytest.mark.parametrize("why", ["no main_grad", "shared with the output layer", "frozen"])
def test_megatron_cores_lookup_where_the_gradient_cannot_go_into_main_grad(one_process, tokens_and_grad, why):
    tokens, grad = tokens_and_grad
    module = embedding()
    if why != "no main_grad":
        module.weight.main_grad = torch.zeros(VOCAB, HIDDEN)
    if why == "shared with the output layer":
        module.weight.zero_out_wgrad = True
    if why == "frozen":
        module.weight.requires_grad_(False)
        assert module(tokens).grad_fn is None
        return
    module(tokens).backward(grad)
    assert module.weight.grad is not None and module.weight.grad.abs().sum() > 0
    assert not getattr(module.weight, "grad_added_to_main_grad", False)
    if why != "no main_grad":
        assert module.weight.main_grad.abs().sum() == 0


def test_the_checkpoint_keys_are_megatron_cores(one_process):
    assert list(embedding().state_dict()) == ["weight"]
