"""TrainState: a run's progress counters, which every checkpoint saves so a resumed run continues where it stopped.

It sits with the checkpoints rather than the training loop so that what writes a checkpoint outside a run
(a Hugging Face import) can start one at iteration 0 without importing training.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass
class TrainState:
    """Progress counters; saved in checkpoints so a resumed run continues where it stopped."""

    step: int = 0
    consumed_train_samples: int = 0
    skipped_train_samples: int = 0
    consumed_valid_samples: int = 0
    floating_point_operations_so_far: float = 0.0
    do_train: bool = False
    do_valid: bool = False
    do_test: bool = False

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, value in state.items():
            setattr(self, key, value)
