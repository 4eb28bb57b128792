"""optimizer.adam_kernel=triton: torch's Adam update, stepped by bridge (here its torch-op path, which the GPU tests
compare the Triton kernel with), writing the model weights megatron-core would copy."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

from bridge_cli.runtime.grad_norm import multi_tensor_scale
from bridge_cli.runtime.triton_adam import TritonAdamStep, adam_update, use_triton_adam

SHAPES = [(64, 32), (7,), (3, 5, 2)]


def twins(cls=torch.optim.AdamW, weight_decay=0.1) -> tuple[torch.optim.Adam, torch.optim.Adam]:
    """Two torch Adams, built as megatron-core builds them (a group with weight decay, one without), on equal
    weights."""
    weights = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(SHAPES)]

    def build():
        params = [torch.nn.Parameter(w.clone()) for w in weights]
        groups = [{"params": params[:2], "weight_decay": weight_decay}, {"params": params[2:], "weight_decay": 0.0}]
        return cls(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)

    return build(), build()


def params(optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def set_grads(optimizer, seed: int, scale: float = 1.0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params(optimizer):
        p.grad = torch.randn(p.shape, generator=generator) * scale


def assert_same_weights(a, b, atol=1e-6) -> None:
    for x, y in zip(params(a), params(b)):
        torch.testing.assert_close(y, x, rtol=0, atol=atol)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam])
def test_steps_like_torchs_adam(cls):
    """Decoupled (AdamW) and L2 (Adam) weight decay, bias-corrected moments, over ten steps."""
    torch_adam, ours = twins(cls)
    use_triton_adam(SimpleNamespace(optimizer=ours))  # megatron-core's wrapper holds torch's as .optimizer
    assert isinstance(ours.step, TritonAdamStep)
    for seed in range(10):
        set_grads(torch_adam, seed), set_grads(ours, seed)
        torch_adam.step(), ours.step()
    assert_same_weights(torch_adam, ours)
    for p, q in zip(params(torch_adam), params(ours)):
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(ours.state[q][key], torch_adam.state[p][key], rtol=1e-5, atol=1e-6)
        assert float(ours.state[q]["step"]) == float(torch_adam.state[p]["step"]) == 10


def test_its_state_dict_is_torchs_both_ways():
    """Checkpoints do not depend on the kernel: either optimizer loads the other's state and steps on alike."""
    torch_adam, ours = twins()
    use_triton_adam(SimpleNamespace(optimizer=ours))
    for seed in range(3):
        set_grads(torch_adam, seed), set_grads(ours, seed)
        torch_adam.step(), ours.step()
    assert ours.state_dict().keys() == torch_adam.state_dict().keys()
    ours.load_state_dict(copy.deepcopy(torch_adam.state_dict()))
    torch_adam.load_state_dict(copy.deepcopy(ours.state_dict()))
    for seed in range(3, 6):
        set_grads(torch_adam, seed), set_grads(ours, seed)
        torch_adam.step(), ours.step()
    assert_same_weights(torch_adam, ours)


def test_a_step_counter_shared_by_every_state_is_split():
    """megatron-core's distributed optimizer loads one step tensor into every parameter's state; stepping it once
    per parameter would count the steps as many times over (and bias-correct the moments wrongly)."""
    torch_adam, ours = twins()
    for seed in range(4):
        set_grads(torch_adam, seed), set_grads(ours, seed)
        torch_adam.step(), ours.step()
    shared = torch.tensor(4.0)
    for state in ours.state.values():
        state["step"] = shared
    use_triton_adam(SimpleNamespace(optimizer=ours))
    set_grads(torch_adam, 4), set_grads(ours, 4)
    torch_adam.step(), ours.step()
    assert [float(s["step"]) for s in ours.state.values()] == [5.0] * len(SHAPES)
    assert_same_weights(torch_adam, ours)


def test_the_clip_coefficient_is_applied_by_the_step_not_before_it():
    torch_adam, ours = twins()
    use_triton_adam(SimpleNamespace(optimizer=ours))
    set_grads(torch_adam, 0, scale=0.25), set_grads(ours, 0)
    grads = [p.grad for p in params(ours)]
    before = [g.clone() for g in grads]
    multi_tensor_scale(2048 * 32, None, [grads, grads], 0.25)  # as megatron-core's clip_grads calls it
    assert all(torch.equal(g, b) for g, b in zip(grads, before))
    torch_adam.step(), ours.step()
    assert_same_weights(torch_adam, ours)


class Float16Wrapper:
    """megatron-core's mixed-precision optimizer as far as this module uses it: the torch Adam over fp32 main
    weights, the (model, main) pairs it copies after each step, and that copy."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.model = [p.detach().to(torch.bfloat16) for p in params(optimizer)]
        self.copies = 0

    def _get_model_and_main_params_data_float16(self):
        return self.model, [p.data for p in params(self.optimizer)]

    def _copy_main_params_to_model_params(self):
        self.copies += 1
        for model, main in zip(*self._get_model_and_main_params_data_float16()):
            model.copy_(main)


def test_the_step_writes_the_model_weights_and_megatron_cores_copy_is_skipped():
    torch_adam, ours = twins()
    wrapper = Float16Wrapper(ours)
    use_triton_adam(wrapper)
    set_grads(torch_adam, 0), set_grads(ours, 0)
    torch_adam.step(), ours.step()
    wrapper._copy_main_params_to_model_params()  # what megatron-core calls after the step
    assert wrapper.copies == 0
    for model, main in zip(wrapper.model, params(torch_adam)):
        assert torch.equal(model, main.detach().to(torch.bfloat16))
    with torch.no_grad():
        params(ours)[0].add_(1.0)  # a change that is no step's (a checkpoint load writes the main weights)
    wrapper._copy_main_params_to_model_params()
    assert wrapper.copies == 1 and torch.equal(wrapper.model[0], params(ours)[0].detach().to(torch.bfloat16))


def test_installing_again_after_a_load_keeps_one_copy_to_skip():
    """The load path applies the kernel choice again; the copy it wraps is still megatron-core's."""
    _, ours = twins()
    wrapper = Float16Wrapper(ours)
    use_triton_adam(wrapper)
    use_triton_adam(wrapper)
    wrapper._copy_main_params_to_model_params()
    assert wrapper.copies == 1
    set_grads(ours, 0)
    ours.step()
    wrapper._copy_main_params_to_model_params()
    assert wrapper.copies == 1


def test_a_bf16_model_weight_is_the_fp32_weight_rounded():
    generator = torch.Generator().manual_seed(0)
    param, grad = torch.randn(1000, generator=generator), torch.randn(1000, generator=generator)
    exp_avg, exp_avg_sq, model = torch.zeros(1000), torch.zeros(1000), torch.empty(1000, dtype=torch.bfloat16)
    adam_update(param, grad, exp_avg, exp_avg_sq, model, step=1, lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
                weight_decay=0.1, decoupled=True)
    assert torch.equal(model, param.to(torch.bfloat16))


def test_options_torch_takes_and_this_step_does_not_are_refused():
    _, ours = twins()
    ours.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        use_triton_adam(SimpleNamespace(optimizer=ours))
