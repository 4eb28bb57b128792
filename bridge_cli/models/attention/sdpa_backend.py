"""``model.sdpa_backend``: pin the causal path of the torch spec's attention to one SDPA kernel.

``auto`` lets torch pick per call (flash / cuDNN on the GPU). A pinned kernel that cannot run this
model's attention is refused once, at build, with the reasons torch gives, instead of failing at the
first step with an error that names no key.
"""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bridge_cli.runtime.errors import RuntimeUnavailable

# ``enable_gqa`` (torch 2.5) lets the kernels read each key/value group for several query heads
# instead of copying it; older torch gets an explicit repeat.
SDPA_HAS_GQA = tuple(int(part) for part in torch.__version__.split(".")[:2]) >= (2, 5)

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
"""``model.sdpa_backend`` values other than auto, and the torch kernel each one allows."""


def heads_per_rank(config) -> tuple[int, int]:
    """Query heads and key/value groups of one tensor-parallel rank."""
    tp = config.tensor_model_parallel_size
    return config.num_attention_heads // tp, (config.num_query_groups or config.num_attention_heads) // tp


@functools.lru_cache(maxsize=None)
def check_backend(name: str, dtype: torch.dtype, dropout: bool, heads: int, groups: int, head_dim: int,
                  value_dim: int | None = None) -> None:
    """Refuse ``model.sdpa_backend=name`` where its kernel cannot run this attention; torch's own
    error would come at the first step and name no key."""
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            return _probe(BACKENDS[name], device, dtype, dropout, heads, groups, head_dim, value_dim or head_dim)
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


def _probe(backend: SDPBackend, device, dtype, dropout: bool, heads: int, groups: int, head_dim: int,
           value_dim: int) -> None:
    """One small causal attention, forward and backward, that only ``backend`` may run (values of ``value_dim``:
    MLA's differ from its keys)."""
    gqa = groups != heads and SDPA_HAS_GQA
    q = torch.zeros(1, heads, 16, head_dim, dtype=dtype, device=device, requires_grad=True)
    k = torch.zeros(1, groups if gqa else heads, 16, head_dim, dtype=dtype, device=device, requires_grad=True)
    v = torch.zeros(1, groups if gqa else heads, 16, value_dim, dtype=dtype, device=device, requires_grad=True)
    # fork_rng: a dropout probe must not move the generator the run's dropout masks are drawn from
    with torch.enable_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), \
            sdpa_kernel([backend]):
        out = F.scaled_dot_product_attention(q, k, v, dropout_p=0.5 if dropout else 0.0, is_causal=True,
                                             **({"enable_gqa": True} if gqa else {}))
        out.sum().backward()
