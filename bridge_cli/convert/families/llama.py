"""``llama``: Llama 2, 3, 3.1 and 3.2, the layout the other families start from."""

from __future__ import annotations

from bridge_cli.convert.families.llama_like import LlamaLike


class Llama(LlamaLike):
    """Exactly :class:`LlamaLike`: RMSNorm, SwiGLU, RoPE (optionally Llama 3.1's scaling), GQA, no biases."""

    inert_keys = (*LlamaLike.inert_keys, "pretraining_tp")  # transformers 5's Llama ignores it
