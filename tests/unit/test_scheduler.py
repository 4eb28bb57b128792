"""Each learning-rate schedule, as configured through a recipe, against its formula."""

from __future__ import annotations

import math

import pytest
import torch

from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer
from bridge_cli.training.setup import build_scheduler

ITERS, WARMUP, MAX_LR, MIN_LR, GBS = 40, 5, 1.0e-2, 1.0e-3, 8


def lr_curve(style: str, *extra: str) -> list[float]:
    cfg = ConfigContainer.from_yaml_dict(compose("tiny", [
        f"train.train_iters={ITERS}", f"scheduler.lr_decay_style={style}", "scheduler.lr_warmup_fraction=null",
        f"scheduler.lr_warmup_iters={WARMUP}", f"optimizer.lr={MAX_LR}", f"optimizer.min_lr={MIN_LR}", *extra]))
    cfg.validate(1)
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.0)
    scheduler = build_scheduler(cfg, optimizer)
    curve = []
    for _ in range(ITERS):
        curve.append(optimizer.param_groups[0]["lr"])
        scheduler.step(increment=GBS)
    return curve


def expected(style: str, it: int, wsd_iters: int = 10, wsd_style: str = "linear") -> float:
    if it <= WARMUP:
        return MAX_LR * it / WARMUP
    ratio = (it - WARMUP) / (ITERS - WARMUP)
    if style == "constant":
        return MAX_LR
    if style == "linear":
        return MIN_LR + (MAX_LR - MIN_LR) * (1 - ratio)
    if style == "cosine":
        return MIN_LR + (MAX_LR - MIN_LR) * 0.5 * (1 + math.cos(math.pi * ratio))
    if style == "inverse-square-root":
        return max(MIN_LR, MAX_LR * math.sqrt(WARMUP) / math.sqrt(it))
    if style == "WSD":
        anneal_start = ITERS - wsd_iters
        if it <= anneal_start:
            return MAX_LR
        return MIN_LR + (MAX_LR - MIN_LR) * (1 - (it - anneal_start) / wsd_iters)
    raise ValueError(style)


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_lr_curve_matches_formula(style):
    assert lr_curve(style) == pytest.approx([expected(style, i) for i in range(ITERS)], rel=1e-9, abs=1e-12)


def test_wsd_curve_matches_formula():
    curve = lr_curve("WSD", "scheduler.lr_wsd_decay_iters=10", "scheduler.lr_wsd_decay_style=linear")
    assert curve == pytest.approx([expected("WSD", i) for i in range(ITERS)], rel=1e-9, abs=1e-12)


def test_warmup_fraction_counts_from_decay_iterations():
    curve = lr_curve("linear", "scheduler.lr_warmup_iters=0", "scheduler.lr_warmup_fraction=0.25")
    assert curve[10] == pytest.approx(MAX_LR)  # 0.25 x 40 iterations of warmup
    assert curve[5] == pytest.approx(MAX_LR / 2)
