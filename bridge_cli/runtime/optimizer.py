"""One optimizer entry point for both devices.

On CUDA this is megatron-core's ``get_megatron_optimizer``, as Megatron-Bridge uses it. On the
CPU it is the same call after :func:`~bridge_cli.runtime.cpu_patches.apply_cpu_patches`, which
makes it build fp32 wrappers whose norm, clipping and loss scale run on the CPU (see
:mod:`bridge_cli.runtime.cpu_optimizer`). Both return a megatron-core ``MegatronOptimizer``:
``step() -> (update_successful, grad_norm, num_zeros_in_grad)``, ``zero_grad``, ``scale_loss``,
``get_loss_scale``, ``param_groups`` (what ``OptimizerParamScheduler`` drives),
``state_dict``/``load_state_dict``, ``sharded_state_dict`` and ``reload_model_params``.

Without Transformer Engine or Apex, megatron-core builds torch's Adam with default arguments,
which on CUDA means the foreach kernels; ``optimizer.adam_kernel`` makes it torch's fused kernel or
bridge's Triton one (:mod:`~bridge_cli.runtime.triton_adam`, the default). Its gradient norm then waits
for the GPU once per gradient and its clip makes two passes over every gradient;
:mod:`~bridge_cli.runtime.grad_norm` replaces both, and with either kernel the Adam step applies the clip.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bridge_cli.runtime import optimizer_chain
from bridge_cli.runtime.errors import RuntimeUnavailable
from bridge_cli.runtime.grad_norm import clip_inside_fused_adam, use_foreach_clip_grads
from bridge_cli.runtime.triton_adam import set_torch_kernel, torch_adams, use_triton_adam

if TYPE_CHECKING:
    from megatron.core.optimizer import MegatronOptimizer, OptimizerConfig

    from bridge_cli.runtime.distributed import Runtime


def build_optimizer(
    optimizer_config: OptimizerConfig, model_chunks: list, runtime: Runtime
) -> MegatronOptimizer:
    """The optimizer for DDP-wrapped ``model_chunks`` (see :func:`bridge_cli.runtime.ddp.wrap_model`)."""
    from megatron.core.optimizer import get_megatron_optimizer

    if runtime.is_cuda:
        use_foreach_clip_grads()
        optimizer = get_megatron_optimizer(optimizer_config, model_chunks, use_gloo_process_groups=runtime.gloo_groups)
        apply_adam_kernel_choice(optimizer, optimizer_config, runtime.is_cuda)
        return optimizer

    from bridge_cli.runtime.cpu_optimizer import CPUChainedOptimizer, CPUFP32Optimizer
    from bridge_cli.runtime.cpu_patches import apply_cpu_patches

    apply_cpu_patches()
    optimizer = get_megatron_optimizer(optimizer_config, model_chunks, use_gloo_process_groups=runtime.gloo_groups)
    members = optimizer_chain.members(optimizer)
    if not all(isinstance(opt, (CPUChainedOptimizer, CPUFP32Optimizer)) for opt in members):
        raise RuntimeUnavailable(
            f"megatron-core built a {type(optimizer).__name__} that needs CUDA; this version of "
            "megatron-core is not supported on the CPU. Train on a GPU machine."
        )
    return optimizer


def apply_adam_kernel_choice(optimizer: MegatronOptimizer, optimizer_config: OptimizerConfig, is_cuda: bool) -> None:
    """The Adam kernel ``optimizer.adam_kernel`` names, on CUDA (:func:`use_triton_adam`, :func:`use_fused_adam`;
    foreach is megatron-core's own choice).

    After building the optimizer, and again after loading its state, whose param groups bring
    the checkpoint's fused/foreach flags back.
    """
    # a megatron-core OptimizerConfig (Python callers) lacks the field: the same default
    kernel = getattr(optimizer_config, "adam_kernel", "triton")
    if is_cuda and kernel == "triton":
        use_triton_adam(optimizer)
    elif is_cuda and kernel == "fused":
        use_fused_adam(optimizer)


def use_fused_adam(optimizer: MegatronOptimizer) -> None:
    """Make each torch Adam/AdamW inside a megatron-core optimizer run as one fused kernel per step.

    Call before the first step. Transformer Engine's and Apex's FusedAdam are no torch Adam and
    are left alone. Fused keeps each parameter's step counter on the parameter's device as fp32,
    so counters that exist already (a loaded state) move there: calling it again after a load,
    whose param groups bring the checkpoint's fused/foreach flags back, is safe.
    """
    import torch

    for _, inner in torch_adams(optimizer):
        set_torch_kernel(inner, fused=True)
        clip_inside_fused_adam(inner)
        for param, state in inner.state.items():
            if isinstance(state.get("step"), torch.Tensor):
                state["step"] = state["step"].to(device=param.device, dtype=torch.float32)
