"""Core attention on ``torch.nn.functional.scaled_dot_product_attention``.

The fast path without Transformer Engine: SDPA dispatches to flash / cuDNN kernels on the GPU
and runs on the CPU. Unlike megatron-core's local ``DotProductAttention`` it materialises no
``[b, h, s, s]`` score tensor, builds no causal mask, and never forks the CUDA RNG tracker
(attention dropout is SDPA's ``dropout_p``, drawn from the default generator). The forward
does no host synchronisation, so it costs nothing per micro-batch beyond the kernel.
``model.sdpa_backend`` pins one kernel (``torch.nn.attention.sdpa_kernel``), checked once at build.

It is tensor-parallel by construction: ``linear_qkv`` has already split the heads, so the
inputs are ``[s, b, heads, d]`` with this rank's heads and query groups, and head counts are
read from them (which also covers MLA's distinct value head size). It holds no parameters.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from bridge_cli.runtime.errors import RuntimeUnavailable

# ``enable_gqa`` (torch 2.5) lets the kernels read each key/value group for several query heads
# instead of copying it; older torch gets an explicit repeat.
_SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
"""``model.sdpa_backend`` values other than auto, and the torch kernel each one allows."""


class SDPAttention(MegatronModule):
    """Drop-in ``core_attention`` for megatron-core's ``SelfAttention`` (0.16 to 0.19)."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        **unused,
    ):
        super().__init__(config=config)
        _check_supported(config, layer_number)
        self.attn_mask_type = attn_mask_type
        # Megatron's query-key layer scaling divides the scale by the layer number and
        # multiplies it back inside the softmax; the product is the plain scale.
        head_dim = config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout
        backend = getattr(config, "sdpa_backend", "auto")
        # None lets torch pick per call; built here so that a call only enters the context.
        self.backends = None if backend == "auto" else [BACKENDS[backend]]
        if self.backends:
            _check_backend(backend, config.params_dtype, self.dropout_p > 0,
                           *_heads_per_rank(config), config.kv_channels)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
        **unused,
    ) -> torch.Tensor:
        """``[s, b, heads, d]`` query/key/value to ``[s, b, heads * d_v]`` context."""
        if packed_seq_params is not None or attention_bias is not None:
            raise RuntimeUnavailable(
                "packed sequences and attention bias are not supported by the torch layer spec; "
                "use model.spec=te (needs transformer_engine)."
            )
        q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        repeats = q.shape[1] // k.shape[1]
        gqa = repeats > 1
        if gqa and not _SDPA_HAS_GQA:
            k = k.repeat_interleave(repeats, dim=1)
            v = v.repeat_interleave(repeats, dim=1)
            gqa = False
        mask, causal = _sdpa_mask(attn_mask_type or self.attn_mask_type, attention_mask, q, k)
        extra = {"enable_gqa": True} if gqa else {}
        with sdpa_kernel(self.backends) if self.backends else contextlib.nullcontext():
            out = F.scaled_dot_product_attention(
                q,
                k,
                v,
                attn_mask=mask,
                dropout_p=self.dropout_p if self.training else 0.0,
                is_causal=causal,
                scale=self.softmax_scale,
                **extra,
            )
        b, h, s, d = out.shape
        return out.permute(2, 0, 1, 3).reshape(s, b, h * d)


def _sdpa_mask(mask_type: AttnMaskType, attention_mask, q: torch.Tensor, k: torch.Tensor):
    """SDPA's ``(attn_mask, is_causal)`` for a megatron mask (``True`` = masked out).

    Like Transformer Engine, a causal layer ignores the mask it is given and uses the causal
    kernel: the GPT data pipeline's mask is the causal one anyway.
    """
    causal = mask_type in (AttnMaskType.causal, AttnMaskType.padding_causal)
    if mask_type == AttnMaskType.causal or (causal and attention_mask is None):
        return None, True
    if attention_mask is None or mask_type == AttnMaskType.no_mask:
        return None, False
    keep = ~attention_mask
    if causal:
        keep = keep & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return keep, False


def _check_supported(config, layer_number: int) -> None:
    unsupported = []  # context parallelism is refused earlier, with the layer spec (models/specs.py)
    if getattr(config, "softmax_type", "vanilla") != "vanilla":
        unsupported.append(f"model.softmax_type={config.softmax_type}")
    if is_layer_window_attention(config.window_size, config.window_attn_skip_freq, layer_number):
        unsupported.append(f"model.window_size={config.window_size}")
    # Both read the attention logits, which SDPA never materialises.
    for flag in ("qk_clip", "log_max_attention_logit"):
        if getattr(config, flag, False):
            unsupported.append(f"model.{flag}=true")
    if unsupported:
        raise RuntimeUnavailable(
            f"{', '.join(unsupported)} is not supported by the torch layer spec's SDPA attention; "
            "use model.spec=te (needs transformer_engine) or drop the setting."
        )


def _heads_per_rank(config) -> tuple[int, int]:
    tp = config.tensor_model_parallel_size
    return config.num_attention_heads // tp, (config.num_query_groups or config.num_attention_heads) // tp


@functools.lru_cache(maxsize=None)
def _check_backend(name: str, dtype: torch.dtype, dropout: bool, heads: int, groups: int, head_dim: int) -> None:
    """Refuse ``model.sdpa_backend=name`` where its kernel cannot run this attention; torch's own
    error would come at the first step and name no key."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _probe(BACKENDS[name], device, dtype, dropout, heads, groups, head_dim)
        except RuntimeError:
            pass
    # torch warns why it skipped each kernel: the first sentence of each, less those this check turned off
    reasons = [str(w.message).split(" (Triggered internally")[0].split(". ")[0].strip().rstrip(".") for w in caught]
    reasons = [r for r in reasons if r and not r.endswith("because:") and "runtime disabled" not in r]
    reasons = reasons or [f"torch has no {name} kernel for {device.type}"]
    raise RuntimeUnavailable(
        f"model.sdpa_backend={name} cannot run this model's attention on {device.type}: {'; '.join(reasons)}. "
        "Set model.sdpa_backend=auto to let torch pick a kernel per call, or model.sdpa_backend=math."
    )


def _probe(backend: SDPBackend, device, dtype, dropout: bool, heads: int, groups: int, head_dim: int) -> None:
    """One small causal attention, forward and backward, that only ``backend`` may run."""
    gqa = groups != heads and _SDPA_HAS_GQA
    q = torch.zeros(1, heads, 16, head_dim, dtype=dtype, device=device, requires_grad=True)
    kv = torch.zeros(1, groups if gqa else heads, 16, head_dim, dtype=dtype, device=device, requires_grad=True)
    # fork_rng: a dropout probe must not move the generator the run's dropout masks are drawn from
    with torch.enable_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, kv, kv, dropout_p=0.5 if dropout else 0.0, is_causal=True,
                                             **({"enable_gqa": True} if gqa else {}))
        out.sum().backward()
