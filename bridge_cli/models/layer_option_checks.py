"""Config rules of the Gemma-style model options that the ``local``/``torch`` specs add (models/specs.py):
``layernorm_zero_centered_gamma``, ``post_sublayer_norm``, ``pre_sublayer_norm``, ``local_rotary_base`` and the soft caps, and the
choice of cross entropy; checked before any model is built."""

from __future__ import annotations

from bridge_cli.config.errors import ConfigError


def check_layer_options(model) -> None:
    """Raise ConfigError for an option the model's layer spec or its other settings cannot honour."""
    from bridge_cli.models.specs import default_spec_name, transformer_engine_importable

    spec = model.spec or default_spec_name()
    if not model.pre_sublayer_norm and spec == "te":
        raise ConfigError("model.pre_sublayer_norm", "false is built into the local and torch layer specs only "
                          "(Transformer Engine fuses the input norms into the linears), and model.spec=te.",
                          "Set model.spec=torch.")
    for key in ("post_sublayer_norm", "local_rotary_base"):
        if getattr(model, key) not in (None, False) and spec == "te":
            raise ConfigError(f"model.{key}", "is built into the local and torch layer specs only, and model.spec=te.",
                              "Set model.spec=torch.")
    if model.multi_latent_attention and spec == "local":
        raise ConfigError("model.multi_latent_attention", "needs the torch or te layer spec: the local spec's core "
                          "attention takes one head size for keys and values, and multi-latent attention has two "
                          "(bridge_cli/models/mla.py).", "Set model.spec=torch.")
    if model.attn_logit_softcapping is not None and spec != "torch":
        raise ConfigError("model.attn_logit_softcapping", f"is applied by the torch layer spec's attention only, and "
                          f"model.spec={spec}.", "Set model.spec=torch.")
    if model.layernorm_zero_centered_gamma and spec != "te" and model.normalization != "RMSNorm":
        raise ConfigError("model.layernorm_zero_centered_gamma", f"the {spec} layer spec has a zero-centred RMSNorm "
                          f"only, and model.normalization={model.normalization}.",
                          "Set model.normalization=RMSNorm, or model.spec=te.")
    if model.local_rotary_base is not None and (model.position_embedding_type != "rope"
                                                or model.multi_latent_attention):
        raise ConfigError("model.local_rotary_base", "sets the RoPE base of the sliding-window layers, which needs "
                          "model.position_embedding_type=rope without multi-latent attention.",
                          "Unset model.local_rotary_base.")
    if model.cross_entropy_fusion_impl != "native" and not model.cross_entropy_loss_fusion:
        raise ConfigError("model.cross_entropy_fusion_impl", f"{model.cross_entropy_fusion_impl} is a fused "
                          "cross entropy, and model.cross_entropy_loss_fusion=false runs the unfused one.",
                          "Set model.cross_entropy_loss_fusion=true.")
    if model.cross_entropy_fusion_impl == "te" and not transformer_engine_importable():
        raise ConfigError("model.cross_entropy_fusion_impl", "te is Transformer Engine's kernel, and "
                          "transformer_engine does not import here.",
                          "Set model.cross_entropy_fusion_impl=triton (bridge's, without Transformer Engine) or native.")
    if model.fused_linear_cross_entropy:
        for key in ("fp16_lm_cross_entropy", "use_mup"):
            if getattr(model, key, False):
                raise ConfigError(f"model.{key}", "changes the logits or their loss in megatron-core's own loss path, "
                                  "which model.fused_linear_cross_entropy replaces.",
                                  f"Unset model.{key} or model.fused_linear_cross_entropy.")
