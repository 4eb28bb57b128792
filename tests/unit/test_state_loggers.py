"""GlobalState.tensorboard_logger / wandb_logger (the reference's names) are the run's own writers."""

from __future__ import annotations

from types import SimpleNamespace

from bridge_cli.config.logger_config import LoggerConfig
from bridge_cli.logging.writers import MetricWriter
from bridge_cli.training.state import GlobalState


def test_loggers_are_the_writers_of_the_training_logger(tmp_path):
    state = GlobalState(cfg=None)
    assert state.tensorboard_logger is None and state.wandb_logger is None  # before train() builds them
    writer = MetricWriter(LoggerConfig(tensorboard_dir=str(tmp_path / "tb")))
    state.training_logger = SimpleNamespace(writer=writer)  # what TrainingLogger exposes
    assert state.tensorboard_logger is writer.tensorboard is not None
    assert state.wandb_logger is None  # no logger.wandb_project
    writer.tensorboard.close()
