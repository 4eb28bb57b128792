"""Import megatron-core for a command: quiet, and without compiler machinery it will not use.

megatron-core decorates its fused kernels (bias-GeLU, SwiGLU, the native fused cross entropy...)
with ``torch.compile`` as it imports them, and ``torch.compile`` imports dynamo, inductor, triton
and sympy on the spot: 2.7 of the 4.7 s ``import megatron.core`` takes on a 2-core CPU, about 5 of
14.5 s on the GPU machine. A command that runs no model (``config validate``, ``--dry-run``,
``preprocess-data``, ``convert-ckpt``, and so the conversion a run from a Hugging Face folder starts)
never needs them, so for it ``torch.compile`` is, while megatron-core binds
its decorator (``megatron.core.jit.jit_fuser``), one that compiles at the first call. A training
run keeps the eager import: it starts inductor's compile workers early, and deferring it made the
first step of a run with the fusions on 1.5 s slower on the CPU.
"""

from __future__ import annotations

import functools
import sys


def megatron_core_version() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core, read without importing it."""
    from importlib.metadata import version

    major, minor = version("megatron-core").split(".")[:2]
    return int(major), int(minor)


def import_megatron_core(runs_model: bool = True) -> None:
    """Silence megatron-core's known noise. Without ``runs_model``, also import megatron-core now
    (once), its fused kernels compiled at their first call if ever; with it, the command's own
    imports load megatron-core as they reach it."""
    from bridge_cli.runtime.quiet import quiet_known_noise

    quiet_known_noise()
    if runs_model or "megatron.core" in sys.modules:
        return
    import torch

    compile_now = torch.compile
    torch.compile = functools.partial(_compile_at_first_call, compile_now)
    try:
        import megatron.core.jit  # noqa: F401 -- binds jit_fuser to the torch.compile above
    finally:
        torch.compile = compile_now


def _compile_at_first_call(compile_now, model=None, **options):
    """``torch.compile(model, **options)``, run when the result is first called."""
    if model is None:  # used as @torch.compile(**options)
        return functools.partial(_compile_at_first_call, compile_now, **options)
    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if compiled is None:
            compiled = compile_now(model, **options)
        return compiled(*args, **kwargs)

    return call
