"""Five fixes to megatron-core's MoE code: two applied before an MoE model is built, one after its cast to bf16,
two before its layers compile.

``define_missing_te_names``: megatron-core 0.16 imports ``te_general_gemm`` into ``moe.moe_utils``
only when Transformer Engine imports, yet the router's gating GEMM reads it unconditionally
(``if te_general_gemm is not None``), so every MoE forward without Transformer Engine raises
NameError. 0.17 and later define it as None in that case; this does the same for 0.16.

``make_aux_loss_scaler_traceable``: the router attaches its auxiliary losses (load balancing,
z-loss) with ``MoEAuxLossAutoScaler``, whose backward reads the loss scale that megatron-core's
schedule stores on the class after each forward. ``torch.compile`` cannot trace that read, so under
``model.compile_layers`` every MoE layer broke into separate graphs at each level of the router's
calls. The replacement backward does the same arithmetic and reads the scale inside a custom op,
which compiled backward graphs call as it is, at backward time as before.

``keep_router_biases_in_fp32``: megatron-core (0.16 to 0.19) keeps a router's expert bias in fp32 by
casting it back at the start of every router forward, after ``Float16Module`` cast it to bf16 with the
weights. Under ``model.compile_layers`` that first forward assigns ``.data`` inside the compiled layer:
a graph break in every MoE layer (seen on an H100 with megatron-core 0.19.2, DeepSeek-V3's routing).
Casting it once right after ``Float16Module`` does what that forward does, before anything is compiled.

``number_routers_by_tensor``: each router records its layer's auxiliary losses in megatron-core's tracker at
``values[layer_number - 1]``, ``layer_number`` an int attribute of the router, which ``torch.compile`` reads as a
constant and guards on. Under ``model.compile_layers`` every MoE layer then compiled a graph of its own (on 4 H100s
with megatron-core 0.19.2, the 8-layer MoE proxy's first step spent about 5 s compiling each layer) instead of all
layers sharing one, and past dynamo's recompile limit (8 a function) the layers beyond it ran eager. A one-element
int64 tensor on the router's device in its place indexes the same entry (``values[t] += loss``) as a graph input,
the same for every layer (a 0-d one would not do: dynamo reads a 0-d index back with ``.item()`` and guards on it).

``make_router_loss_entries``: the tracker makes a loss's entry at the first router's record (``if name not in``
the tracker), inside the first compiled layer, and dynamo guards on the name being absent: the next layer's call
recompiled every layer once (on 4 H100s with megatron-core 0.19.2, one recompilation a rank in the MoE proxy's first
step, "not ___dict_contains('load_balancing_loss', ...)"). The entries the routers will record are made before,
at the size and on the device the routers use, as megatron-core's own ``force_initialize`` makes them.
"""

from __future__ import annotations

import torch


def define_missing_te_names() -> None:
    """Bind ``moe_utils.te_general_gemm = None`` where megatron-core left it undefined."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def make_aux_loss_scaler_traceable() -> None:
    """Give ``MoEAuxLossAutoScaler`` a backward that ``torch.compile`` traces (:func:`aux_loss_scaler_backward`)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.backward = staticmethod(aux_loss_scaler_backward)


@torch.library.custom_op("bridge::scaled_aux_loss_grad", mutates_args=())
def scaled_aux_loss_grad(aux_loss: torch.Tensor) -> torch.Tensor:
    """The gradient megatron-core gives an auxiliary loss: its current main-loss backward scale (1 if unset)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    scale = MoEAuxLossAutoScaler.main_loss_backward_scale
    ones = torch.ones_like(aux_loss)
    return ones if scale is None else ones * scale.to(aux_loss.device).reshape(())  # the schedule's scale is [1]


@scaled_aux_loss_grad.register_fake
def _(aux_loss: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(aux_loss)


def aux_loss_scaler_backward(ctx, grad_output: torch.Tensor):
    """``MoEAuxLossAutoScaler.backward``'s arithmetic: the output's gradient passes through, and the
    auxiliary loss gets the main loss's backward scale as its gradient."""
    (aux_loss,) = ctx.saved_tensors
    return grad_output, scaled_aux_loss_grad(aux_loss)


def keep_router_biases_in_fp32(chunks: list) -> None:
    """Every router's expert bias (and megatron-core 0.19's ``qb_beta`` buffers) back in fp32, as its forward would."""
    from megatron.core.transformer.moe.router import Router

    for chunk in chunks:
        for module in chunk.modules():
            keep = getattr(module, "_maintain_float32_expert_bias", None) if isinstance(module, Router) else None
            if keep is not None:  # megatron-core's TopKRouter
                keep()


def number_routers_by_tensor(chunks: list) -> None:
    """Each megatron-core router's ``layer_number`` as a one-element int64 tensor on its device (before compiling the
    layers), so that recording its auxiliary losses does not tie a compiled graph to one layer."""
    from megatron.core.transformer.moe.router import Router

    for chunk in chunks:
        for module in chunk.modules():
            number = getattr(module, "layer_number", None) if isinstance(module, Router) else None
            if isinstance(number, int):
                device = next(module.parameters()).device
                module.layer_number = torch.tensor([number], dtype=torch.int64, device=device)


def router_loss_names(config) -> list[str]:
    """The tracker names megatron-core's routers record their losses under for this model config (Megatron-LM's
    list)."""
    kinds = config.moe_router_load_balancing_type
    kinds = kinds if isinstance(kinds, list) else [kinds]
    names = [f"{prefix}load_balancing_loss" for kind, prefix in
             (("aux_loss", ""), ("seq_aux_loss", "seq_"), ("global_aux_loss", "global_")) if kind in kinds]
    if config.moe_z_loss_coeff is not None:
        names.append("z_loss")
    return names


def make_router_loss_entries(chunks: list) -> None:
    """The tracker entries the routers of ``chunks`` record into, made zero now (before compiling the layers) where
    they do not exist yet: one value per layer, MTP layers included, on the first router's device."""
    from megatron.core.transformer.moe.router import Router

    router = next((m for chunk in chunks for m in chunk.modules() if isinstance(m, Router)), None)
    if router is None:
        return
    config, device = router.config, next(router.parameters()).device
    size = config.num_layers + (config.mtp_num_layers or 0)
    try:
        from megatron.core.transformer.moe.moe_logging import get_moe_metrics_tracker  # megatron-core 0.18 and later
    except ImportError:  # 0.16 and 0.17: a module-level dict
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        tracker = get_moe_layer_wise_logging_tracker()
        for name in router_loss_names(config):
            tracker.setdefault(name, {"values": torch.zeros(size, device=device), "reduce_group": None,
                                      "avg_group": None, "reduce_group_has_dp": False})
    else:
        tracker = get_moe_metrics_tracker()
        for name in router_loss_names(config):
            tracker.ensure_initialized(name, size, device)
