"""Whether this machine can run bridge's Triton kernels (the Adam step, grouped expert weight gradients, the cross
entropy, the QKV RoPE)."""

from __future__ import annotations

import functools


@functools.cache
def available() -> bool:
    """Whether Triton imports (CUDA builds of torch ship it)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
