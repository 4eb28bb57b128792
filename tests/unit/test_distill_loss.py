"""Knowledge distillation's loss against the formula, written here per token in plain Python (fp32, CPU): the
forward KL of softened distributions over the tokenizer's vocabulary (padding left out), T^2, the mix with
the cross entropy, and the gradient (q - p) / T."""

from __future__ import annotations

import math

import pytest
import torch

from bridge_cli.training.distill_loss import distill_loss, vocab_parallel_kl

pytestmark = pytest.mark.usefixtures("leaves_no_rerun_state_machine")

VOCAB, PADDED = 7, 10  # three padding columns, as a padded embedding has


def logits():
    torch.manual_seed(0)
    student = torch.randn(2, 3, PADDED) * 3
    teacher = torch.randn(2, 3, PADDED) * 3
    labels = torch.randint(0, VOCAB, (2, 3))
    mask = torch.tensor([[1.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    return student, teacher, labels, mask


def softmax(row: list[float], temperature: float) -> list[float]:
    exps = [math.exp(x / temperature) for x in row]
    return [e / sum(exps) for e in exps]


def kl_by_hand(student_row, teacher_row, temperature: float) -> float:
    """sum_v p_v (log p_v - log q_v), p the teacher's softmax(logits / T), q the model's, over the vocabulary."""
    p = softmax([float(x) for x in teacher_row[:VOCAB]], temperature)
    q = softmax([float(x) for x in student_row[:VOCAB]], temperature)
    return sum(pv * (math.log(pv) - math.log(qv)) for pv, qv in zip(p, q))


def ce_by_hand(student_row, label: int) -> float:
    """-log softmax(logits)[label] over the padded columns too, as the model's lm loss counts them."""
    row = [float(x) for x in student_row]
    return math.log(sum(math.exp(x) for x in row)) - row[label]


@pytest.mark.parametrize("temperature", [1.0, 2.5])
def test_kl_per_token_and_its_gradient_follow_the_formula(temperature):
    student, teacher, _, _ = logits()
    student.requires_grad_()
    kl = vocab_parallel_kl(student, teacher, temperature, VOCAB)
    for b in range(2):
        for s in range(3):
            assert float(kl[b, s]) == pytest.approx(kl_by_hand(student[b, s], teacher[b, s], temperature), abs=1e-6)
    upstream = torch.rand(2, 3)
    (grad,) = torch.autograd.grad((kl * upstream).sum(), student)
    for b in range(2):
        for s in range(3):
            p = softmax([float(x) for x in teacher[b, s, :VOCAB]], temperature)
            q = softmax([float(x) for x in student[b, s, :VOCAB]], temperature)
            expected = [(qv - pv) / temperature * float(upstream[b, s]) for pv, qv in zip(p, q)] + [0.0] * 3
            assert grad[b, s].tolist() == pytest.approx(expected, abs=1e-6)


def test_a_teacher_equal_to_the_model_has_zero_kl():
    student, _, _, _ = logits()
    assert vocab_parallel_kl(student, student.clone(), 3.0, VOCAB).abs().max() < 1e-6


@pytest.mark.parametrize("temperature, weight", [(1.0, 0.0), (2.0, 0.0), (2.0, 0.3), (1.0, 1.0)])
def test_loss_mixes_t_squared_kl_and_cross_entropy_over_the_loss_tokens(temperature, weight):
    student, teacher, labels, mask = logits()
    student.requires_grad_()
    loss, tokens, report = distill_loss(mask, labels, teacher, student, temperature=temperature, ce_weight=weight,
                                        vocab_size=VOCAB)
    kl = ce = total = 0.0
    for b in range(2):
        for s in range(3):
            if mask[b, s]:
                k, c = kl_by_hand(student[b, s], teacher[b, s], temperature), ce_by_hand(student[b, s], labels[b, s])
                kl, ce, total = kl + k, ce + c, total + (1 - weight) * temperature ** 2 * k + weight * c
    assert int(tokens) == 4 and float(loss) == pytest.approx(total, rel=1e-6)
    assert sorted(report) == ["distill loss", "kl loss", "lm loss"]
    for key, expected in (("distill loss", total), ("kl loss", kl), ("lm loss", ce)):
        assert report[key].tolist() == pytest.approx([expected, 4.0], rel=1e-6), key
    loss.backward()
    assert student.grad[mask == 0].abs().max() == 0  # tokens outside the loss mask take no gradient
    assert (student.grad[..., VOCAB:].abs().max() == 0) == (weight == 0)  # padding: the cross entropy's only
