"""Low-precision (FP8, FP4) settings: which run where, checked once by the validation pass.

The ``torch`` and ``local`` specs run FP8 GEMMs themselves (:mod:`bridge_cli.models.fp8_linear`)
with current scaling, tensor-wise or row-wise. Every other megatron-core low-precision setting
is a Transformer Engine recipe knob; megatron-core silently skips them when Transformer Engine is
absent, so here they are refused unless the run uses the ``te`` spec.
"""

from __future__ import annotations

from bridge_cli.config.errors import ConfigError

TORCH_RECIPES = ("tensorwise", "rowwise")
"""model.fp8_recipe values the torch and local specs implement."""

TE_ONLY_MODEL_FIELDS = (
    "fp8_param", "fp8_quantizer_factory", "fp8_margin", "fp8_interval", "fp8_amax_history_len",
    "fp8_amax_compute_algo", "fp8_dot_product_attention", "fp8_multi_head_attention", "tp_only_amax_red",
    "activation_func_fp8_input_store", "moe_router_padding_for_fp8", "fp4", "fp4_recipe", "fp4_param",
    "fp4_quantizer_factory",
)
"""model fields that only Transformer Engine's modules act on."""

TE_ONLY_DDP_FIELDS = ("fp8_param_gather", "reuse_grad_buf_for_mxfp8_param_ag", "keep_fp8_transpose_cache")

MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (sm89), Hopper (sm90) and newer."""


def check_low_precision(cfg, spec: str, device: str) -> None:
    """Raise ConfigError for an FP8/FP4 setting the run's layer ``spec`` or ``device`` cannot honour."""
    m = cfg.model
    if m.fp8_output_layer:
        _check_output_layer(cfg, spec)
    if spec == "te":
        return
    _refuse_te_only(cfg, spec)
    if not m.fp8:
        return
    if m.fp8_recipe not in TORCH_RECIPES:
        raise ConfigError("model.fp8_recipe", f"{m.fp8_recipe} scaling needs Transformer Engine (model.spec=te); "
                          f"the {spec} spec scales FP8 GEMMs per tensor or per row at each call.",
                          "Set model.fp8_recipe=tensorwise, or rowwise.")
    if m.fp8_recipe == "rowwise" and m.fp8 != "e4m3":
        raise ConfigError("model.fp8", f"{m.fp8} with row-wise scaling: row-wise FP8 GEMMs take e4m3 operands only "
                          "(gradients included).", "Set model.fp8=e4m3, or model.fp8_recipe=tensorwise.")
    if not m.bf16:
        raise ConfigError("model.fp8", "FP8 GEMMs take bf16 activations and weights, and model.bf16 is false.",
                          "Use mixed_precision=bf16_with_fp8_current_scaling_mixed (or bf16_with_fp8_rowwise_mixed).")
    if device == "cuda":
        _check_gpu()


def _check_output_layer(cfg, spec: str) -> None:
    m = cfg.model
    if spec == "te":
        raise ConfigError("model.fp8_output_layer", "is the torch and local specs' FP8 output layer; the te spec's "
                          "FP8 is Transformer Engine's, which leaves megatron-core's output layer in bf16.",
                          "Unset model.fp8_output_layer, or use model.spec=torch.")
    if not m.fp8:
        raise ConfigError("model.fp8_output_layer", "runs the output layer in FP8 and model.fp8 is not set.",
                          "Add mixed_precision=bf16_with_fp8_current_scaling_mixed (or bf16_with_fp8_rowwise_mixed).")
    if m.fused_linear_cross_entropy:
        raise ConfigError("model.fp8_output_layer", "and model.fused_linear_cross_entropy both claim the output "
                          "layer: the fused loss computes its GEMMs itself, in bf16.",
                          "Set one of them to false.")


def _refuse_te_only(cfg, spec: str) -> None:
    from dataclasses import fields

    for section, names in (("model", TE_ONLY_MODEL_FIELDS), ("ddp", TE_ONLY_DDP_FIELDS)):
        values = getattr(cfg, section)
        defaults = {f.name: f.default for f in fields(values)}
        for name in names:
            if name in defaults and getattr(values, name) != defaults[name]:
                raise ConfigError(f"{section}.{name}", f"is a Transformer Engine setting, and the {spec} spec does "
                                  "not use Transformer Engine.",
                                  f"Leave {section}.{name} unset; FP8 without Transformer Engine is model.fp8 with "
                                  f"model.fp8_recipe={' or '.join(TORCH_RECIPES)}.")


def _check_gpu() -> None:
    import torch

    if not torch.cuda.is_available():
        return  # checking a GPU run's config from a machine without one
    capability = torch.cuda.get_device_capability()
    if capability < MIN_CAPABILITY:
        raise ConfigError("model.fp8", f"FP8 GEMMs need an sm89 or newer GPU (Ada, Hopper); this "
                          f"{torch.cuda.get_device_name()} is sm{capability[0]}{capability[1]}.",
                          "Use mixed_precision=bf16_mixed on this GPU.")
