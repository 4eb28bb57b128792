"""Transformer layer specs: which modules a GPTModel layer is built from.

``te``     Transformer Engine's fused modules (megatron-core's TE spec); needs transformer_engine.
``local``  megatron-core's own modules, ``DotProductAttention`` included. Its attention
           materialises the full ``[b, h, s, s]`` score matrix: on the GPU it is slower than
           ``torch`` and runs out of memory at long sequences.
``torch``  ``local`` with this project's core attention
           (:class:`~bridge_cli.models.attention.core.TorchAttention`): causal SDPA (flash / cuDNN),
           and FlexAttention for packed documents, sliding windows and sinks; the fast path without
           Transformer Engine, and the default on the CPU.

``local`` and ``torch`` normalise with ``torch.nn`` norms (megatron-core's ``WrappedTorchNorm``
for RMSNorm), which do not support sequence parallelism.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from bridge_cli.runtime.errors import RuntimeUnavailable

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_config import TransformerConfig

SPEC_NAMES = ("te", "local", "torch")


def default_spec_name() -> str:
    """``te`` where Transformer Engine imports, else ``torch``."""
    return "te" if _transformer_engine_importable() else "torch"


def layer_spec(name: str, config: TransformerConfig) -> ModuleSpec:
    """The layer spec called ``name`` for a GPT model with this ``config``."""
    from megatron.core.models.gpt import gpt_layer_specs

    # Only keywords that megatron-core 0.16 to 0.19 all accept.
    options = dict(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        qk_l2_norm=config.qk_l2_norm,
    )
    sdpa_backend = getattr(config, "sdpa_backend", "auto")
    if sdpa_backend != "auto" and name != "torch":
        raise RuntimeUnavailable(
            f"model.sdpa_backend={sdpa_backend} applies to the torch layer spec only, and model.spec={name}. "
            "Set model.spec=torch, or model.sdpa_backend=auto."
        )
    if name == "te":
        if not _transformer_engine_importable():
            raise RuntimeUnavailable(
                "model.spec=te needs Transformer Engine, which does not import here. "
                "Install transformer_engine[pytorch] on a CUDA machine, or set "
                "model.spec=torch."
            )
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**options)
    if name in ("local", "torch"):
        if config.context_parallel_size > 1 and name == "local":
            raise RuntimeUnavailable(
                f"model.context_parallel_size={config.context_parallel_size} needs Transformer Engine's attention or "
                "the torch spec's; the local layer spec has neither. Use model.spec=torch or model.spec=te.")
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=config.normalization, **options)
        _check_sequence_parallel(name, spec, config)
        if name == "torch":
            from bridge_cli.models.attention.core import TorchAttention

            spec.submodules.self_attention.submodules.core_attention = TorchAttention
        return spec
    raise ValueError(f"model.spec={name!r} is not a layer spec; choose one of {', '.join(SPEC_NAMES)}.")


def _check_sequence_parallel(name: str, spec: ModuleSpec, config: TransformerConfig) -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if config.sequence_parallel and spec.submodules.input_layernorm is WrappedTorchNorm:
        raise RuntimeUnavailable(
            f"model.sequence_parallel=true is not supported by the {name} layer spec (its torch "
            "norms cannot shard the sequence); use model.spec=te or set "
            "model.sequence_parallel=false."
        )


def _transformer_engine_importable() -> bool:
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a broken install raises more than ImportError
        return False
    return True
