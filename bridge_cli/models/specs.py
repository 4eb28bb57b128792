"""Transformer layer specs: which modules a GPTModel layer is built from.

``te``     Transformer Engine's fused modules (megatron-core's TE spec); needs transformer_engine.
``local``  megatron-core's own modules, ``DotProductAttention`` included. Its attention
           materialises the full ``[b, h, s, s]`` score matrix: on the GPU it is slower than
           ``torch`` and runs out of memory at long sequences.
``torch``  ``local`` with this project's core attention
           (:class:`~bridge_cli.models.attention.core.TorchAttention`): causal SDPA (flash / cuDNN),
           and FlexAttention for packed documents, sliding windows and sinks; the fast path without
           Transformer Engine, and the default on the CPU.

``model.qk_layernorm_across_heads=true`` swaps the q/k norms of every spec for
:mod:`bridge_cli.models.projection_norm`'s (OLMoE's norm of the whole projection).

``model.moe_grouped_gemm=true`` on ``local`` and ``torch`` runs the experts as grouped GEMMs
(:mod:`bridge_cli.models.moe_experts`) instead of megatron-core's per-expert ``SequentialMLP``;
``SequentialMLP`` experts with biases get :mod:`bridge_cli.models.expert_linear`'s ``linear_fc2``.

``model.fused_single_qkv_rope=true`` splits the QKV projection and applies RoPE with Transformer Engine's
kernel where it has one, else :mod:`bridge_cli.models.qkv_rope`'s, on every spec.

``model.multi_latent_attention=true`` on ``torch`` builds megatron-core's ``MLASelfAttention`` with this core
attention (:mod:`bridge_cli.models.mla`); ``local`` refuses it.

``model.fp8`` on ``local`` and ``torch`` runs the attention and MLP linears as FP8 GEMMs
(:mod:`bridge_cli.models.fp8_linear`).

``local`` and ``torch`` normalise with ``torch.nn`` norms (megatron-core's ``WrappedTorchNorm``
for RMSNorm), which do not support sequence parallelism. On those two specs, the model options of
Gemma-style layers swap modules in (:mod:`bridge_cli.models.norms`, :mod:`bridge_cli.models.local_rope`):
``layernorm_zero_centered_gamma`` (RMSNorm with ``1 + w``), ``post_sublayer_norm`` (a norm on the
attention and MLP outputs), ``pre_sublayer_norm=false`` (none on their inputs: OLMo 2) and
``local_rotary_base`` (the sliding-window layers' own RoPE base).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

from bridge_cli.runtime.errors import RuntimeUnavailable

if TYPE_CHECKING:
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
    from megatron.core.transformer.transformer_config import TransformerConfig

SPEC_NAMES = ("te", "local", "torch")


def default_spec_name() -> str:
    """``te`` where Transformer Engine imports, else ``torch``."""
    return "te" if transformer_engine_importable() else "torch"


def layer_spec(name: str, config: TransformerConfig, vp_stage: Optional[int] = None) -> Union[ModuleSpec, TransformerBlockSubmodules]:
    """The layer spec called ``name`` for a GPT model with this ``config``.

    An MoE model gets megatron-core's block spec: one spec per layer of this pipeline stage
    (``vp_stage``), dense or MoE as ``model.moe_layer_freq`` says.
    """
    from megatron.core.models.gpt import gpt_layer_specs

    # Only keywords that megatron-core 0.16 to 0.19 all accept.
    options = dict(
        num_experts=config.num_moe_experts,
        moe_grouped_gemm=config.moe_grouped_gemm,
        qk_layernorm=config.qk_layernorm,
        multi_latent_attention=config.multi_latent_attention,
        qk_l2_norm=config.qk_l2_norm,
    )
    check_spec(name, config)
    use_te = name == "te"
    if config.num_moe_experts:
        spec = gpt_layer_specs.get_gpt_decoder_block_spec(
            config, use_transformer_engine=use_te, normalization=config.normalization,
            qk_l2_norm=config.qk_l2_norm, vp_stage=vp_stage)
        layers = list({id(layer): layer for layer in spec.layer_specs}.values())
    elif use_te:
        spec = gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(**options)
        layers = [spec]
    else:
        spec = gpt_layer_specs.get_gpt_layer_local_spec(normalization=config.normalization, **options)
        layers = [spec]
    if getattr(config, "qk_layernorm_across_heads", False):
        _use_projection_norms(layers)
    if config.fused_single_qkv_rope:  # Transformer Engine's where it has one
        from bridge_cli.models import qkv_rope

        qkv_rope.install()
    if use_te:
        return spec
    if config.num_moe_experts:
        _use_sequence_parallel_norms(spec, layers)
    if config.multi_latent_attention:
        _use_torch_mla(name, config, layers)
    for layer in layers:
        _check_sequence_parallel(name, layer, config)
        if name == "torch":
            from bridge_cli.models.attention.core import TorchAttention

            layer.submodules.self_attention.submodules.core_attention = TorchAttention
        if config.moe_grouped_gemm:
            _use_grouped_gemm_experts(layer)
        elif config.num_moe_experts and config.add_bias_linear:
            _use_biased_expert_linears(layer)
        if config.fp8:
            _use_fp8_linears(layer, config)
    return _use_layer_options(spec, layers, config, vp_stage)


def check_spec(name: str, config, transformer_engine_here: bool = True) -> None:
    """Refuse, naming the field, what the layer spec ``name`` cannot build for ``config`` (the model section or its
    TransformerConfig): the validation pass asks before any work, layer_spec again as it builds.
    ``transformer_engine_here=False`` (a dry run for another machine) leaves out whether Transformer Engine imports."""
    sdpa_backend = getattr(config, "sdpa_backend", "auto")
    if sdpa_backend != "auto" and name != "torch":
        raise RuntimeUnavailable(
            f"model.sdpa_backend={sdpa_backend} applies to the torch layer spec only, and model.spec={name}. "
            "Set model.spec=torch, or model.sdpa_backend=auto."
        )
    if name not in SPEC_NAMES:
        raise ValueError(f"model.spec={name!r} is not a layer spec; choose one of {', '.join(SPEC_NAMES)}.")
    if name == "te" and transformer_engine_here and not transformer_engine_importable():
        raise RuntimeUnavailable(
            "model.spec=te needs Transformer Engine, which does not import here. "
            "Install transformer_engine[pytorch] on a CUDA machine, or set "
            "model.spec=torch."
        )
    if name == "local" and config.context_parallel_size > 1:
        raise RuntimeUnavailable(
            f"model.context_parallel_size={config.context_parallel_size} needs Transformer Engine's attention or "
            "the torch spec's; the local layer spec has neither. Use model.spec=torch or model.spec=te.")
    if config.multi_latent_attention and name != "te":
        from bridge_cli.models import mla

        mla.check_config(config, name)


def _use_torch_mla(name: str, config: TransformerConfig, layers: list) -> None:
    """Multi-latent attention on the torch spec: megatron-core's MLASelfAttention with this project's core
    attention and Transformer Engine's checkpoint keys (:mod:`bridge_cli.models.mla`)."""
    from bridge_cli.models import mla

    mla.check_config(config, name)
    mla.allow_without_transformer_engine()
    dense = [layer for layer in layers if not hasattr(_submodules(layer.submodules.mlp), "experts")]
    mla.use_torch_mla(layers, dense, config.q_lora_rank)


def _use_fp8_linears(layer: ModuleSpec, config: TransformerConfig) -> None:
    """Swap megatron-core's parallel linears in the attention, the dense MLP and the shared experts of a
    layer spec for their FP8 subclasses (:mod:`bridge_cli.models.fp8_linear`); routed experts stay."""
    from dataclasses import fields

    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.spec_utils import ModuleSpec

    from bridge_cli.models.fp8_linear import Fp8ColumnParallelLinear, Fp8RowParallelLinear, Fp8Scaling

    swaps = {ColumnParallelLinear: Fp8ColumnParallelLinear, RowParallelLinear: Fp8RowParallelLinear}
    scaling = Fp8Scaling.from_config(config)
    mlp = _submodules(layer.submodules.mlp)
    owners = [_submodules(layer.submodules.self_attention), mlp, _submodules(getattr(mlp, "shared_experts", None))]
    for owner in filter(None, owners):
        for f in fields(owner):
            linear = getattr(owner, f.name)
            if linear in swaps:
                setattr(owner, f.name, ModuleSpec(module=swaps[linear], params={"fp8": scaling}))


def _submodules(spec):
    """The submodules dataclass of a ModuleSpec (megatron-core 0.16) or of a partial (0.19), or None."""
    return getattr(spec, "submodules", None) or getattr(spec, "keywords", {}).get("submodules")


def _use_projection_norms(layers: list) -> None:
    """Normalise each token's whole query and key projections (OLMoE) instead of each head:
    :class:`~bridge_cli.models.projection_norm.ProjectionRMSNorm` as the attention's q/k norms."""
    from bridge_cli.models.projection_norm import projection_norm_specs

    for layer in layers:
        attention = layer.submodules.self_attention.submodules
        attention.q_layernorm, attention.k_layernorm = projection_norm_specs()


def _use_sequence_parallel_norms(block: TransformerBlockSubmodules, layers: list) -> None:
    """Swap megatron-core's WrappedTorchNorm (which refuses sequence parallelism) for
    :class:`SequenceParallelTorchNorm` in an MoE block spec: megatron-core's MoE layer needs sequence
    parallelism under tensor parallelism."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from bridge_cli.models.sequence_parallel_norm import SequenceParallelTorchNorm

    _replace_norms(block, layers, (WrappedTorchNorm,), SequenceParallelTorchNorm)


def use_sequence_parallel_norms_in_mtp(block) -> None:
    """Swap WrappedTorchNorm for :class:`SequenceParallelTorchNorm` in megatron-core's multi-token-prediction block
    spec (its embedding, hidden and final norms; its transformer layer is the decoder's last, swapped already), so
    MTP trains under sequence parallelism on the ``local`` and ``torch`` specs (DeepSeek-V3's MoE layers need SP at
    TP > 1)."""
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    from bridge_cli.models.sequence_parallel_norm import SequenceParallelTorchNorm

    for layer in block.layer_specs:
        for field in ("enorm", "hnorm", "layer_norm"):
            if getattr(layer.submodules, field, None) is WrappedTorchNorm:
                setattr(layer.submodules, field, SequenceParallelTorchNorm)


def _replace_norms(block: TransformerBlockSubmodules, layers: list, old: tuple, new: type) -> None:
    """Swap the norm classes ``old`` for ``new`` in a block spec: its final norm and its layers' norms."""
    if block.layer_norm in old:
        block.layer_norm = new
    for layer in layers:
        owners = [layer.submodules, getattr(layer.submodules.self_attention, "submodules", None)]
        for owner in filter(None, owners):
            for field in ("input_layernorm", "pre_mlp_layernorm", "q_layernorm", "k_layernorm", "kv_layernorm"):
                if getattr(owner, field, None) in old:
                    setattr(owner, field, new)


def _use_layer_options(spec, layers: list, config: TransformerConfig, vp_stage: Optional[int]):
    """The ``local``/``torch`` spec with the Gemma-style model options (see the module's doc); returns the
    spec, a block spec when zero-centred norms need the final norm swapped too."""
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    from bridge_cli.models.local_rope import LocalRopeSelfAttention
    from bridge_cli.models.norms import PostNormBiasDropoutAdd, ZeroCenteredRMSNorm
    from bridge_cli.models.sequence_parallel_norm import SequenceParallelTorchNorm

    for layer in layers:
        # a plain TransformerConfig (megatron-core's own callers) has neither option
        if getattr(config, "local_rotary_base", None) is not None:
            layer.submodules.self_attention.module = LocalRopeSelfAttention
        if getattr(config, "post_sublayer_norm", False):
            post_norm = ModuleSpec(module=PostNormBiasDropoutAdd, params={"config": config})
            layer.submodules.self_attn_bda = layer.submodules.mlp_bda = post_norm
        if not getattr(config, "pre_sublayer_norm", True):
            layer.submodules.input_layernorm = layer.submodules.pre_mlp_layernorm = IdentityOp
    if config.layernorm_zero_centered_gamma:
        if isinstance(spec, ModuleSpec):  # one dense layer spec: megatron-core would add a WrappedTorchNorm
            spec = TransformerBlockSubmodules(layer_specs=[spec] * get_num_layers_to_build(config, vp_stage),
                                              layer_norm=WrappedTorchNorm)
        _replace_norms(spec, layers, (WrappedTorchNorm, SequenceParallelTorchNorm), ZeroCenteredRMSNorm)
    return spec


def _use_grouped_gemm_experts(layer: ModuleSpec) -> None:
    """Swap the experts of an MoE layer spec for :class:`GroupedGemmExperts`; dense layers stay.

    megatron-core 0.16 describes the MoE block as a ModuleSpec, 0.19 as a partial of MoELayer;
    both hold an ``MoESubmodules`` whose ``experts`` is built with (num_local_experts, config,
    pg_collection=...), which the class accepts.
    """
    from bridge_cli.models.moe_experts import GroupedGemmExperts

    submodules = _submodules(layer.submodules.mlp)
    if submodules is not None and hasattr(submodules, "experts"):
        submodules.experts = GroupedGemmExperts


def _use_biased_expert_linears(layer: ModuleSpec) -> None:
    """Give an MoE layer spec's SequentialMLP experts :class:`ExpertRowParallelLinear` as ``linear_fc2``,
    so that their biases train (:mod:`bridge_cli.models.expert_linear`); dense layers stay."""
    from bridge_cli.models.expert_linear import ExpertRowParallelLinear

    experts = getattr(_submodules(layer.submodules.mlp), "experts", None)
    if experts is not None:
        experts.submodules.linear_fc2 = ExpertRowParallelLinear


def _check_sequence_parallel(name: str, spec: ModuleSpec, config: TransformerConfig) -> None:
    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    if config.sequence_parallel and spec.submodules.input_layernorm is WrappedTorchNorm:
        raise RuntimeUnavailable(
            f"model.sequence_parallel=true is not supported by the {name} layer spec (its torch "
            "norms cannot shard the sequence); use model.spec=te or set "
            "model.sequence_parallel=false."
        )


def transformer_engine_importable() -> bool:
    """Whether transformer_engine imports here (a broken install counts as missing)."""
    try:
        import transformer_engine  # noqa: F401
    except Exception:  # a broken install raises more than ImportError
        return False
    return True
