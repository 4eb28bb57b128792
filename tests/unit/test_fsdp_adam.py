"""bridge's Triton Adam and torch's fused Adam over FSDP2's weights (DTensors, dist.use_torch_fsdp2=true): each steps
the local shards, keeps the clip coefficient for the step to apply and writes the model weights' shards, while the
optimizer state stays DTensors, as torch's Adam keeps it and checkpoints save it. On the CPU the Triton Adam runs its
torch-op path over the same unwrapped shards; tests/gpu/test_gpu_fsdp.py runs the kernel."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard, distribute_tensor

from bridge_cli.runtime.grad_norm import clip_inside_fused_adam, multi_tensor_scale
from bridge_cli.runtime.optimizer import use_fused_adam
from bridge_cli.runtime.triton_adam import use_triton_adam

SHAPES = [(64, 32), (7,), (3, 5, 2)]


@pytest.fixture(scope="module")
def mesh():
    """A one-rank data-parallel mesh on the CPU, as FSDP2 builds over its group."""
    from torch.distributed.device_mesh import init_device_mesh

    if dist.is_initialized():
        pytest.skip("a process group is already set up in this process")
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,), mesh_dim_names=("dp_cp",))
    finally:
        dist.destroy_process_group()


def twins(mesh) -> tuple[torch.optim.AdamW, torch.optim.AdamW]:
    """Two AdamW over equal DTensor weights, built as megatron-core builds them (a group with weight decay, one
    without)."""
    weights = [torch.randn(s, generator=torch.Generator().manual_seed(i)) for i, s in enumerate(SHAPES)]

    def build():
        params = [torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])) for w in weights]
        groups = [{"params": params[:2], "weight_decay": 0.1}, {"params": params[2:], "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)

    return build(), build()


def params(optimizer) -> list[DTensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def set_grads(optimizer, seed: int, scale: float = 1.0) -> None:
    generator = torch.Generator().manual_seed(seed)
    for p in params(optimizer):
        p.grad = distribute_tensor(torch.randn(p.shape, generator=generator) * scale, p.device_mesh, p.placements)


def clip(optimizer, coefficient: float) -> None:
    """megatron-core's clip_grads scaling the gradients' local shards, as it does under FSDP2."""
    grads = [p.grad.to_local().detach() for p in params(optimizer)]
    multi_tensor_scale(2048 * 32, None, [grads, grads], coefficient)


def assert_steps_alike(reference, ours, steps: range, coefficient: float | None = None) -> None:
    """``ours`` and torch's foreach AdamW (``reference``) over ``steps``; with ``coefficient``, both clipped."""
    for seed in steps:
        set_grads(reference, seed, scale=coefficient or 1.0), set_grads(ours, seed)
        if coefficient:
            before = [p.grad.to_local().clone() for p in params(ours)]
            clip(ours, coefficient)
            kept = all(torch.equal(p.grad.to_local(), b) for p, b in zip(params(ours), before))
            assert kept, "the clip scaled the shards in place instead of leaving the coefficient to the step"
        reference.step(), ours.step()
    for p, q in zip(params(reference), params(ours)):
        assert isinstance(q, DTensor)
        torch.testing.assert_close(q.full_tensor(), p.full_tensor(), rtol=0, atol=1e-6)
        for key in ("exp_avg", "exp_avg_sq"):
            assert isinstance(ours.state[q][key], DTensor) and ours.state[q][key].placements == q.placements
            torch.testing.assert_close(ours.state[q][key].full_tensor(), reference.state[p][key].full_tensor(),
                                       rtol=1e-5, atol=1e-6)


def test_the_triton_adam_steps_dtensor_shards_like_torchs_adam(mesh):
    reference, ours = twins(mesh)
    use_triton_adam(SimpleNamespace(optimizer=ours))  # megatron-core's wrapper holds torch's as .optimizer
    assert_steps_alike(reference, ours, range(5))
    assert_steps_alike(reference, ours, range(5, 8), coefficient=0.25)


def test_the_fused_adam_steps_dtensors_and_takes_the_clip_as_its_grad_scale(mesh):
    reference, ours = twins(mesh)
    use_fused_adam(SimpleNamespace(optimizer=ours))
    assert_steps_alike(reference, ours, range(3))
    assert_steps_alike(reference, ours, range(3, 6), coefficient=0.25)


class Float16Wrapper:
    """megatron-core's mixed-precision optimizer under FSDP2 as far as the Triton Adam uses it: fp32 main weights and
    bf16 model weights, both DTensors, and the copy between them it makes after each step."""

    def __init__(self, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.model = [p.detach().to(torch.bfloat16) for p in params(optimizer)]
        self.copies = 0

    def _get_model_and_main_params_data_float16(self):
        return [m.data for m in self.model], [p.data for p in params(self.optimizer)]

    def _copy_main_params_to_model_params(self):
        self.copies += 1


def test_the_triton_adam_writes_each_model_weights_shard(mesh):
    reference, ours = twins(mesh)
    wrapper = Float16Wrapper(ours)
    use_triton_adam(wrapper)
    assert_steps_alike(reference, ours, range(2))
    wrapper._copy_main_params_to_model_params()  # what megatron-core calls after the step: the step wrote them
    assert wrapper.copies == 0
    for model, main in zip(wrapper.model, params(reference)):
        assert torch.equal(model.full_tensor(), main.full_tensor().to(torch.bfloat16))


def test_gradients_of_another_optimizer_are_still_scaled_in_place(mesh):
    _, ours = twins(mesh)
    clip_inside_fused_adam(ours)
    other = torch.randn(4, 4)
    expected = other * 0.5
    set_grads(ours, 0)
    grads = [p.grad.to_local().detach() for p in params(ours)] + [other]
    multi_tensor_scale(2048 * 32, None, [grads, grads], 0.5)
    torch.testing.assert_close(other, expected, rtol=0, atol=0)


def test_megatron_cores_mixed_precision_optimizer_loads_saved_main_weight_shards_into_its_dtensors(mesh):
    """A bf16 run under FSDP2 resumed (the GPU test's Triton Adam resume failed here): megatron-core's
    Float16OptimizerWithFloat16Params holds fp32 main weights as DTensors, the checkpoint hands back their local
    shards, and its load copies one into the other. Built without its constructor, which needs CUDA weights; the
    load is megatron-core's own."""
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from bridge_cli.runtime.fsdp import local_shard, shard_saved_main_weights

    _, adam = twins(mesh)
    for group in adam.param_groups:  # the keys megatron-core matches a checkpoint's groups by
        group.update(wd_mult=float(group["weight_decay"] > 0), lr_mult=1.0, is_expert_parallel=False,
                     is_decoupled_lr=False)
    set_grads(adam, 0)
    adam.step()
    member = object.__new__(Float16OptimizerWithFloat16Params)
    member.optimizer, member.grad_scaler, member.config = adam, None, SimpleNamespace(fp16=False)
    member.fp32_from_float16_groups = [list(group["params"]) for group in adam.param_groups]
    expected = [[local_shard(p).clone() + 1 for p in group] for group in member.fp32_from_float16_groups]
    saved = {"optimizer": adam.state_dict(), "fp32_from_fp16_params": [[t.clone() for t in g] for g in expected]}
    shard_saved_main_weights(member, saved)
    member.load_state_dict(saved)
    for group, values in zip(member.fp32_from_float16_groups, expected):
        for main, value in zip(group, values):
            assert isinstance(main, DTensor)
            assert torch.equal(local_shard(main), value)
