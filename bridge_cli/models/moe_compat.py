"""Names megatron-core's MoE code reads whether or not Transformer Engine is installed.

megatron-core 0.16 imports ``te_general_gemm`` into ``moe.moe_utils`` only when Transformer Engine
imports, yet the router's gating GEMM reads it unconditionally (``if te_general_gemm is not None``),
so every MoE forward without Transformer Engine raises NameError. 0.17 and later define it as
None in that case; this does the same for 0.16, on any device.
"""

from __future__ import annotations


def define_missing_te_names() -> None:
    """Bind ``moe_utils.te_general_gemm = None`` where megatron-core left it undefined."""
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None
