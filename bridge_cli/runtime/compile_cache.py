"""Where ``torch.compile`` keeps what it compiled: a folder that outlives the node's /tmp.

torch's inductor caches compiled graphs and kernels in ``/tmp/torchinductor_<user>``, so a job that
lands on another node, or runs after /tmp was cleaned, compiles everything again (``llama1b`` on an
H200: first step 14.1 s cold, 4.1 s warm). Unless ``TORCHINDUCTOR_CACHE_DIR`` names a folder of the
user's, bridge points it at ``$XDG_CACHE_HOME/bridge/torchinductor`` (``~/.cache/bridge/torchinductor``),
on the home file system that a cluster's nodes usually share. torch writes its default into the
variable the first time it looks (megatron-core's import does), so that value counts as unset.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional

VARIABLE = "TORCHINDUCTOR_CACHE_DIR"


def cache_root() -> Path:
    """bridge's folder for what outlives a run: ``$XDG_CACHE_HOME/bridge`` (``~/.cache/bridge``)."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "bridge"


def use_persistent_compile_cache() -> Optional[str]:
    """Point torch's compile cache at bridge's folder unless the user chose one; return the folder in use
    (None where torch's default stays: a home that cannot be written)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get(VARIABLE)
    if current and os.path.abspath(current) != os.path.abspath(default_cache_dir()):
        return current
    folder = cache_root() / "torchinductor"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    if not os.access(folder, os.W_OK | os.X_OK):
        return None
    os.environ[VARIABLE] = str(folder)
    return str(folder)
