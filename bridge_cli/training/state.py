"""GlobalState: the one mutable object of a run, passed explicitly (never a module global)."""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:
    from bridge_cli.runtime.distributed import Runtime
    from bridge_cli.training.config import ConfigContainer


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


@dataclass
class GlobalState:
    """What a forward-step function or the loop may need: config, progress, runtime, loggers."""

    cfg: "ConfigContainer"
    train_state: TrainState = field(default_factory=TrainState)
    runtime: Optional["Runtime"] = None
    start_time: float = field(default_factory=time.time)
    timers: Any = None
    training_logger: Any = None
    """The TrainingLogger train() reports through (console, TensorBoard, W&B); pretrain() closes it."""
    checkpoint_manager: Any = None
    """The run's CheckpointManager (bridge_cli.checkpoint.manager), built by setup()."""
    straggler_timer: Any = None
    """megatron-core's StragglerDetector with straggler.log_straggler (set by setup()), else None; the forward step
    times its batch loading and forward pass with it."""
    signal_handler: Any = None
    """The exit-signal handler train() installs with train.exit_signal_handler (see training.train.ExitSignal)."""
    base_checkpoint: Optional[str] = None
    """The base model a run with adapters loaded (checkpoint.pretrained_checkpoint, or the one its
    adapter checkpoint names); its adapter checkpoints name it in turn."""

    @property
    def tensorboard_logger(self) -> Any:
        """The run's TensorBoard SummaryWriter (None without logger.tensorboard_dir, or before train())."""
        return self.training_logger.writer.tensorboard if self.training_logger is not None else None

    @property
    def wandb_logger(self) -> Any:
        """The run's W&B run (None without logger.wandb_project, or before train())."""
        return self.training_logger.writer.wandb if self.training_logger is not None else None
