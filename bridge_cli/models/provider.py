"""GPTModelProvider: a megatron-core TransformerConfig plus what it takes to build a GPTModel."""

from __future__ import annotations

import copy
import math
import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

YARN_EXCLUDES = {
    "multi_latent_attention": (False, "multi-latent attention has its own YaRN (rope_type=yarn)"),
    "rotary_percent": (1.0, "megatron-core's YaRN table covers the whole head"),
    "rotary_interleaved": (False, "megatron-core's YaRN rotates the two halves of each head"),
    "rope_scaling": (False, "YaRN is the scaling"),
    "seq_len_interpolation_factor": (None, "megatron-core's YaRN table ignores it"),
    "apply_rope_fusion": (False, "the fused RoPE kernels cannot scale cos/sin by YaRN's factor"),
}
"""Settings position_embedding_type=yarn cannot take: the value it needs, and why."""


@dataclass
class GPTModelProvider(MLATransformerConfig):
    """Every megatron-core TransformerConfig field, plus the GPTModel constructor's arguments.

    It is an ``MLATransformerConfig`` so the multi-latent attention fields (``q_lora_rank``,
    ``kv_lora_rank``, ``qk_head_dim``, ...) are settable; they apply only with
    ``multi_latent_attention=true``, and the defaults below are TransformerConfig's.
    """

    multi_latent_attention: bool = False
    """Multi-latent attention (DeepSeek-V2/V3): low-rank query and key/value projections."""

    q_lora_rank: Optional[int] = 512
    """MLA: rank of the low-rank query projection; None projects the queries directly (DeepSeek-V2-Lite)."""

    normalization: Literal["LayerNorm", "RMSNorm"] = "LayerNorm"
    """Which norm to use for normalization layers, valid options are `LayerNorm` and `RMSNorm`."""

    gradient_accumulation_fusion: bool = False
    """Add each weight gradient into the fp32 main_grad inside its GEMM (Apex's kernel, else torch.addmm; grouped experts: a Triton kernel); with model.sequence_parallel, CUDA only."""

    fused_single_qkv_rope: bool = False
    """Split the fused QKV projection and rotate queries and keys by RoPE in one kernel each way: Transformer Engine's, else bridge's (Triton on CUDA, torch ops on the CPU); RoPE without q/k norms or packed sequences."""

    spec: Optional[str] = None
    """Layer spec: te (Transformer Engine), local (megatron-core's own) or torch (SDPA / FlexAttention); None picks te if importable, else torch."""

    vocab_size: Optional[int] = None
    """Tokenizer vocabulary size before padding; the mock dataset and the null tokenizer use it too."""

    make_vocab_size_divisible_by: int = 128
    """Pad the embedding rows to a multiple of this times the tensor-parallel size, as Megatron-LM does."""

    seq_length: int = 1024
    """Maximum sequence length the model is built for (positional embeddings, RoPE cache)."""

    position_embedding_type: Literal["learned_absolute", "rope", "yarn", "none"] = "learned_absolute"
    """Position embedding: learned_absolute (GPT-2), rope (Llama), yarn (RoPE with YaRN scaling, GPT-OSS; the yarn_* fields) or none."""

    rotary_base: int = 10000
    """RoPE base period (Llama 3: 500000)."""

    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates."""

    seq_len_interpolation_factor: Optional[float] = None
    """Linear RoPE interpolation factor for longer contexts; None disables it."""

    rope_scaling: bool = False
    """Llama 3.1 RoPE frequency scaling (low/high frequency factors 1/4, original context 8192)."""

    rope_scaling_factor: float = 8.0
    """Llama 3.1 RoPE scaling factor (Llama 3.1: 8, Llama 3.2: 32); used with rope_scaling."""

    yarn_rotary_scaling_factor: float = 1.0
    """YaRN: how many times longer than yarn_original_max_position_embeddings the context is stretched (GPT-OSS: 32)."""

    yarn_original_max_position_embeddings: int = 4096
    """YaRN: the context length the model was pretrained at, which sets the interpolated band of frequencies."""

    yarn_beta_fast: float = 32.0
    """YaRN: frequencies that turn more than this many times over the original context are kept (extrapolated)."""

    yarn_beta_slow: float = 1.0
    """YaRN: frequencies that turn fewer than this many times over the original context are divided by the factor."""

    yarn_mscale: float = 1.0
    """YaRN: cos/sin scale (0.1 * yarn_mscale * ln(factor) + 1) / (0.1 * yarn_mscale_all_dim * ln(factor) + 1), as transformers' mscale."""

    yarn_mscale_all_dim: float = 0.0
    """YaRN: the denominator's weight in that scale (0: transformers' default attention factor 0.1 * ln(factor) + 1)."""

    yarn_correction_range_round_to_int: bool = True
    """YaRN: round the band's edges to whole dimensions (transformers' truncate; GPT-OSS: false)."""

    local_rotary_base: Optional[int] = None
    """RoPE base of the sliding-window layers (Gemma 3: 10000), which take no RoPE scaling; None: rotary_base in every layer."""

    post_sublayer_norm: bool = False
    """Normalise the attention and MLP outputs before they join the residual (Gemma 2/3's post-attention and post-feedforward norms)."""

    pre_sublayer_norm: bool = True
    """Normalise the attention and MLP inputs (every Llama-style model); false: no norm there (OLMo 2, whose layers normalise only the outputs, with post_sublayer_norm)."""

    scale_embeddings: bool = False
    """Multiply the input embeddings by sqrt(hidden_size), rounded to their dtype (Gemma)."""

    attn_logit_softcapping: Optional[float] = None
    """Soft-cap the scaled attention scores at +-c as c * tanh(score / c) before the softmax (Gemma 2: 50); torch spec only."""

    final_logit_softcapping: Optional[float] = None
    """Soft-cap the output logits at +-c as c * tanh(logit / c) (Gemma 2: 30); None: no cap."""

    share_embeddings_and_output_weights: bool = True
    """Tie the input embedding and the output projection (GPT-2, Llama-3.2-1B) or not (Llama-3-8B)."""

    fp16_lm_cross_entropy: bool = False
    """Compute the language-model cross entropy in fp16 instead of fp32."""

    cross_entropy_fusion_impl: Literal["native", "te", "triton"] = "native"
    """The loss cross_entropy_loss_fusion runs: native (megatron-core's), te, or triton (bridge's: no fp32 logits).
    native keeps the fp32 softmax of the logits for its backward; te is Transformer Engine's; triton keeps the bf16
    logits and one number a token and recomputes the softmax in its backward (Triton kernels on CUDA, the same math
    as torch passes on the CPU)."""

    fused_linear_cross_entropy: bool = False
    """Project onto the vocabulary and take the cross entropy in chunks of linear_cross_entropy_chunk tokens, the
    logits never whole (the fp32 logits of 32K tokens x 128K vocabulary are 16 GiB); the projection runs twice.
    Training and evaluation losses only (a model asked for logits projects as usual); supersedes cross_entropy_loss_fusion.
    Under compile_layers the passes between the chunk GEMMs are compiled."""

    linear_cross_entropy_chunk: int = 4096
    """Tokens per chunk of fused_linear_cross_entropy: the peak holds chunk x vocabulary / TP fp32 logits."""

    parallel_output: bool = True
    """Keep the logits split across tensor-parallel ranks (the vocab-parallel loss needs this)."""

    sdpa_backend: Literal["auto", "flash", "cudnn", "efficient", "math"] = "auto"
    """SDPA kernel of the torch spec's causal layers: auto (torch picks per call) or only flash, cudnn, efficient or math."""

    moe_per_layer_logging: bool = False
    """Also write each MoE layer's auxiliary losses to the metric writers (moe/<loss>_layer_<i>), not only their mean."""

    fp8: Optional[Literal["e4m3", "hybrid"]] = None
    """FP8 GEMMs in the linear layers: e4m3 operands, or hybrid (e5m2 gradients); None: none (see fp8_recipe)."""

    fp8_recipe: Literal["tensorwise", "rowwise", "delayed", "mxfp8", "blockwise", "custom"] = "tensorwise"
    """FP8 scaling: tensorwise or rowwise (current scaling; every spec), delayed, mxfp8, blockwise or custom (te spec only)."""

    fp8_output_layer: bool = False
    """With model.fp8 on the torch or local spec: run the output layer's GEMMs (hidden x vocabulary) in FP8 too."""

    qk_layernorm_across_heads: bool = False
    """With qk_layernorm: RMS-normalise each token's whole query and key projections (all heads together, OLMoE), not each head."""

    compile_layers: bool = False
    """torch.compile each transformer layer in place (all share one graph) and the language-model loss."""

    moe_exchange_chunks: int = 1
    """Split each MoE layer's tokens into this many chunks whose expert-parallel exchange overlaps the experts' compute (bridge's token dispatch at EP or expert TP > 1; the same numbers); 1: one exchange."""

    def __post_init__(self):
        # MLATransformerConfig's own checks (e.g. no attention output gate) concern MLA models only.
        if self.multi_latent_attention:
            MLATransformerConfig.__post_init__(self)
        else:
            TransformerConfig.__post_init__(self)
        if self.qk_layernorm_across_heads:
            self._check_qk_layernorm_across_heads()
        self._check_yarn()

    def _check_qk_layernorm_across_heads(self) -> None:
        if not self.qk_layernorm or self.multi_latent_attention or self.normalization != "RMSNorm":
            raise ValueError("qk_layernorm_across_heads needs qk_layernorm=true, normalization=RMSNorm and no "
                             "multi_latent_attention")
        if (self.num_query_groups or self.num_attention_heads) % self.tensor_model_parallel_size:
            raise ValueError("qk_layernorm_across_heads needs num_query_groups to be a multiple of "
                             "tensor_model_parallel_size (each rank normalises the key heads it holds)")

    def _check_yarn(self) -> None:
        # megatron-core's attention scales cos/sin by the yarn_* fields whatever position_embedding_type is,
        # and its YaRN table ignores the other RoPE options: refuse what would not be computed as set
        if self.position_embedding_type != "yarn":
            # the yarn_* defaults are megatron-core YarnRotaryEmbedding's, whose cos/sin scale is then 1
            changed = [f.name for f in dataclasses.fields(GPTModelProvider)
                       if f.name.startswith("yarn_") and getattr(self, f.name) != f.default]
            if changed:
                raise ValueError(f"{changed[0]} applies to position_embedding_type=yarn only, and it is "
                                 f"{self.position_embedding_type}")
            return
        for name, (wanted, why) in YARN_EXCLUDES.items():
            if getattr(self, name) != wanted:
                raise ValueError(f"position_embedding_type=yarn needs {name}={wanted}: {why}")
        if self.yarn_rotary_scaling_factor <= 0 or self.yarn_original_max_position_embeddings < 1:
            raise ValueError("yarn_rotary_scaling_factor and yarn_original_max_position_embeddings must be positive")

    @property
    def padded_vocab_size(self) -> int:
        multiple = self.make_vocab_size_divisible_by * self.tensor_model_parallel_size
        return int(math.ceil(self.vocab_size / multiple) * multiple)

    def provide(self, pre_process: bool = True, post_process: bool = True, vp_stage: Optional[int] = None):
        """Build one megatron-core GPTModel (one pipeline stage) from this config."""
        from bridge_cli.models.gpt_model import GPTModel
        from bridge_cli.models.specs import default_spec_name, layer_spec

        if self.num_moe_experts:
            from bridge_cli.models.moe_compat import define_missing_te_names, make_aux_loss_scaler_traceable

            define_missing_te_names()
            make_aux_loss_scaler_traceable()
        if self.gradient_accumulation_fusion:
            from bridge_cli.models import wgrad_accumulation

            wgrad_accumulation.install()
        kwargs = {"vp_stage": vp_stage} if vp_stage is not None else {}
        spec = self.spec or default_spec_name()
        config = self
        if self.fp8 and spec != "te":
            # The spec's own FP8 linears do it; megatron-core's fp8 code paths are Transformer Engine's.
            config = copy.copy(self)
            config.fp8 = None
        layers = layer_spec(spec, self, vp_stage)
        if self.mtp_num_layers:
            kwargs["mtp_block_spec"] = _mtp_block_spec(self, layers, spec == "te", vp_stage)
        model = GPTModel(
            config=config,
            transformer_layer_spec=layers,
            vocab_size=self.padded_vocab_size,
            max_sequence_length=self.seq_length,
            pre_process=pre_process,
            post_process=post_process,
            fp16_lm_cross_entropy=self.fp16_lm_cross_entropy,
            parallel_output=self.parallel_output,
            share_embeddings_and_output_weights=self.share_embeddings_and_output_weights,
            position_embedding_type=self.position_embedding_type,
            rotary_percent=self.rotary_percent,
            rotary_base=self.rotary_base,
            seq_len_interpolation_factor=self.seq_len_interpolation_factor,
            rope_scaling=self.rope_scaling,
            rope_scaling_factor=self.rope_scaling_factor,
            **kwargs,
        )
        if config is not self:
            from bridge_cli.models.fp8_linear import keep_layers_in_bf16, output_layer_in_fp8

            keep_layers_in_bf16(model, self)
            if self.fp8_output_layer and post_process:
                output_layer_in_fp8(model, self)
        if self.num_moe_experts:
            from bridge_cli.models.moe_dispatch import use_device_token_dispatch

            use_device_token_dispatch(model)
        return model


def _mtp_block_spec(config, layers, use_te: bool, vp_stage: Optional[int]):
    """Multi-token prediction (``model.mtp_num_layers``): megatron-core's MTP block, its layers built like
    the decoder's last (as Megatron-LM's pretrain_gpt builds them); None on stages that hold no MTP layer."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec

    last = layers.layer_specs[-1] if hasattr(layers, "layer_specs") else layers
    block = get_gpt_mtp_block_spec(config, last, use_transformer_engine=use_te, vp_stage=vp_stage)
    if block is not None and not use_te and config.sequence_parallel:
        from bridge_cli.models.specs import use_sequence_parallel_norms_in_mtp

        use_sequence_parallel_norms_in_mtp(block)
    return block
