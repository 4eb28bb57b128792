"""How a model with adapters (LoRA) is checkpointed, given to the checkpoint layer by the caller.

The checkpoint layer knows nothing of LoRA itself: :func:`bridge_cli.peft.lora.adapter_policy` builds
this policy, and saving and loading follow it. Adapter checkpoints hold the adapters' tensors alone,
plus a ``peft`` entry in the common state: the adapter settings and the base checkpoint they adapt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional


@dataclass(frozen=True)
class AdapterPolicy:
    settings: dict[str, Any]
    """The adapter settings saved with the adapters and compared on load (e.g. dim, alpha, target_modules)."""
    is_adapter_key: Callable[[str], bool]
    """Whether a model key belongs to an adapter (saved by adapter checkpoints)."""

    def is_base_key(self, key: str) -> bool:
        """Whether a model key belongs to the frozen base model (loaded from the base checkpoint)."""
        return not self.is_adapter_key(key)

    def entry(self, base_checkpoint: Optional[str]) -> dict[str, Any]:
        """The ``peft`` entry of an adapter checkpoint."""
        return {**self.settings, "base_checkpoint": str(Path(base_checkpoint).resolve()) if base_checkpoint else None}
