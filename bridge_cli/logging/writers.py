"""TensorBoard and W&B behind one ``add_scalar``; only the logging rank opens them."""

from __future__ import annotations

from typing import Any, Optional

from bridge_cli.config.errors import ConfigError
from bridge_cli.config.logger_config import LoggerConfig


class MetricWriter:
    """Fans scalars out to every configured backend; does nothing when none is configured."""

    def __init__(self, cfg: LoggerConfig, run_config: Optional[dict] = None, enabled: bool = True):
        self.tensorboard = None
        self.wandb = None
        if not enabled:
            return
        if cfg.tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as err:
                raise ConfigError("logger.tensorboard_dir", "is set but the tensorboard package is not installed.",
                                  "pip install tensorboard, or unset logger.tensorboard_dir.") from err
            self.tensorboard = SummaryWriter(log_dir=cfg.tensorboard_dir, max_queue=cfg.tensorboard_queue_size)
        if cfg.wandb_project:
            try:
                import wandb
            except ImportError as err:
                raise ConfigError("logger.wandb_project", "is set but wandb is not installed.",
                                  "pip install wandb, or unset logger.wandb_project.") from err
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name, entity=cfg.wandb_entity,
                                    dir=cfg.wandb_save_dir, config=run_config)

    @property
    def active(self) -> bool:
        return self.tensorboard is not None or self.wandb is not None

    def add_scalars(self, values: dict[str, Any], step: int) -> None:
        if not self.active:
            return
        clean = {name: float(value) for name, value in values.items() if value is not None}
        if self.tensorboard is not None:
            for name, value in clean.items():
                self.tensorboard.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
