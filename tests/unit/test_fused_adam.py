"""optimizer.adam_kernel=fused: torch's AdamW, switched to its fused kernel, steps as before."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch

from bridge_cli.runtime.optimizer import use_fused_adam


def twin_adamw() -> tuple[torch.optim.AdamW, torch.optim.AdamW]:
    """Two AdamW, built as megatron-core builds torch's (default kernel choice), on equal weights."""
    weights = [torch.randn(64, 32, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    return tuple(torch.optim.AdamW([torch.nn.Parameter(w.clone()) for w in weights], lr=1e-2,
                                   betas=(0.9, 0.95), weight_decay=0.1) for _ in range(2))


def params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def step(optimizer, seed: int) -> set[str]:
    """One step on seeded grads; returns the names of the kernels it ran."""
    generator = torch.Generator().manual_seed(seed)
    for p in params(optimizer):
        p.grad = torch.randn(p.shape, generator=generator)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        optimizer.step()
    return {event.name for event in profile.events()}


def test_fused_adamw_runs_the_fused_kernel_and_matches_the_default():
    default, fused = twin_adamw()
    use_fused_adam(SimpleNamespace(optimizer=fused))  # megatron-core's wrapper holds torch's as .optimizer
    for seed in range(10):
        assert "aten::_fused_adamw_" not in step(default, seed)
        assert "aten::_fused_adamw_" in step(fused, seed)
    for a, b in zip(params(default), params(fused)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_applying_again_after_a_load_restores_the_fused_kernel():
    """A loaded state brings the checkpoint's param-group flags (here: not fused) back with it."""
    default, fused = twin_adamw()
    wrapper = SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=fused)])
    use_fused_adam(wrapper)
    step(default, 0), step(fused, 0)
    fused.load_state_dict(copy.deepcopy(default.state_dict()))  # torch's load keeps the tensors it is given
    step(default, 1)
    assert "aten::_fused_adamw_" not in step(fused, 1)
    use_fused_adam(wrapper)
    step(default, 2)
    assert "aten::_fused_adamw_" in step(fused, 2)
    for a, b in zip(params(default), params(fused)):
        torch.testing.assert_close(b, a, rtol=0, atol=1e-6)


def test_other_optimizers_are_left_alone():
    """Transformer Engine's and Apex's FusedAdam, like SGD here, are no torch Adam."""
    sgd = torch.optim.SGD([torch.nn.Parameter(torch.ones(3))], lr=0.1, momentum=0.9)
    before = [dict(group) for group in sgd.param_groups]
    use_fused_adam(SimpleNamespace(chained_optimizers=[SimpleNamespace(optimizer=sgd), SimpleNamespace()]))
    assert [dict(group) for group in sgd.param_groups] == before
