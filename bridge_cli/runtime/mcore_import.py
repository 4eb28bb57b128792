"""Import megatron-core for a command: quiet, and without compiler machinery until something compiles.

megatron-core decorates its fused kernels (bias-GeLU, SwiGLU, the native fused cross entropy...)
with ``torch.compile`` as it imports them, and ``torch.compile`` imports dynamo, inductor, triton
and sympy on the spot: 2.7 of the 4.7 s ``import megatron.core`` takes on a 2-core CPU, about 5 of
14.5 s on the GPU machine. So while megatron-core binds its decorator (``megatron.core.jit.jit_fuser``),
``torch.compile`` is one that compiles at the kernel's first call. A command that runs no model
(``config validate``, ``--dry-run``, ``preprocess-data``, ``convert-ckpt``) and a run whose model calls
no fused kernel never import inductor for them; a run that calls one imports it in its first step
instead of before it, which costs that run's launch to its first step nothing (``tiny`` with
``model.bias_activation_fusion=true model.bias_dropout_fusion=true`` on the 2-core CPU: 6.9 s deferred
against 7.1 s eager, the medians of 8 launches each). Inductor's compile workers start at the first
compilation either way (``torch._dynamo.backends.inductor``), not at the decoration.
Inside a compiled region (``model.compile_layers``) a fused kernel is traced inline, as dynamo traces
any function ``torch.compile`` wrapped.

Either way megatron-core's import leaves out the optional packages it imports for loggers that bridge
never hands it: ``megatron.core.timers`` imports wandb and ``torch.utils.tensorboard`` (which imports
tensorboard, boto3 and botocore) for ``Timers.write``, which bridge does not call; its own loggers import
those packages when ``logger.tensorboard_dir`` or ``logger.wandb_project`` asks (``bridge_cli.logging.writers``).
That is 0.36 s of a 2-core CPU's launch, and an installed wandb's 1-3 s more.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from typing import Iterator

LOGGER_PACKAGES = ("wandb", "torch.utils.tensorboard")
"""Imported by megatron-core (each in a ``try: ... except ImportError``) only for loggers bridge does not give it."""


def megatron_core_version() -> tuple[int, int]:
    """(major, minor) of the installed megatron-core, read without importing it."""
    from importlib.metadata import version

    major, minor = version("megatron-core").split(".")[:2]
    return int(major), int(minor)


def import_megatron_core() -> None:
    """Silence megatron-core's known noise and import megatron-core (once), without the logger packages it
    would import for nothing, its fused kernels compiled at their first call."""
    from bridge_cli.runtime.quiet import quiet_known_noise

    quiet_known_noise()
    if "megatron.core" in sys.modules:
        return
    import torch

    compile_now = torch.compile
    torch.compile = functools.partial(_compile_at_first_call, compile_now)
    try:
        with _without(LOGGER_PACKAGES):
            import megatron.core.jit  # noqa: F401 -- imports megatron.core; binds jit_fuser to the torch.compile above
    finally:
        torch.compile = compile_now


@contextlib.contextmanager
def _without(packages: tuple[str, ...]) -> Iterator[None]:
    """Within the block, importing any of ``packages`` not yet imported raises ImportError (Python's meaning of a
    None in sys.modules); after it they import as usual."""
    blocked = [name for name in packages if name not in sys.modules]
    sys.modules.update(dict.fromkeys(blocked))
    try:
        yield
    finally:
        for name in blocked:
            if sys.modules.get(name, False) is None:
                del sys.modules[name]


def _compile_at_first_call(compile_now, model=None, **options):
    """``torch.compile(model, **options)``, run when the result is first called outside a compiled region; inside
    one, ``model`` itself, which dynamo traces inline as it does a function that ``torch.compile`` wrapped."""
    if model is None:  # used as @torch.compile(**options)
        return functools.partial(_compile_at_first_call, compile_now, **options)
    import torch

    compiled = None

    @functools.wraps(model)
    def call(*args, **kwargs):
        nonlocal compiled
        if torch.compiler.is_compiling():
            return model(*args, **kwargs)
        if compiled is None:
            compiled = compile_now(model, **options)
        return compiled(*args, **kwargs)

    return call
