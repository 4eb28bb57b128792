"""GlobalState: the one mutable object of a run, passed explicitly (never a module global).

TrainState, its progress counters, lives with the checkpoints that save it (bridge_cli/checkpoint/train_state.py)
and is importable from here under Megatron-Bridge's name."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

from bridge_cli.checkpoint.train_state import TrainState
from bridge_cli.runtime.fault_tolerance import FaultToleranceOff

if TYPE_CHECKING:
    from bridge_cli.runtime.distributed import Runtime
    from bridge_cli.training.config import ConfigContainer


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
    fault_tolerance: FaultToleranceOff = field(default_factory=FaultToleranceOff)
    """The rank's ft_launcher client with ft.enable_ft_package (set by setup()); else one that does nothing."""
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
