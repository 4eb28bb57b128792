"""TensorBoard, W&B, MLflow and Comet behind one ``add_scalars``; only the logging rank opens them."""

from __future__ import annotations

from typing import Any, Optional

from bridge_cli.config.errors import ConfigError
from bridge_cli.config.logger_config import LoggerConfig


def _import(module: str, key: str, package: str):
    """Import an optional backend, or say which config key wants it and how to get it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ConfigError(f"logger.{key}", f"is set but {package} is not installed.",
                          f"pip install {package}, or unset logger.{key}.") from err


class MetricWriter:
    """Fans scalars out to every configured backend; does nothing when none is configured."""

    def __init__(self, cfg: LoggerConfig, run_config: Optional[dict] = None, enabled: bool = True):
        self.tensorboard = None
        self.wandb = None
        self.mlflow = None
        self.comet = None
        if not enabled:
            return
        if cfg.tensorboard_dir:
            tensorboard = _import("torch.utils.tensorboard", "tensorboard_dir", "tensorboard")
            self.tensorboard = tensorboard.SummaryWriter(log_dir=cfg.tensorboard_dir, max_queue=cfg.tensorboard_queue_size)
        if cfg.wandb_project:
            wandb = _import("wandb", "wandb_project", "wandb")
            self.wandb = wandb.init(project=cfg.wandb_project, name=cfg.wandb_exp_name, entity=cfg.wandb_entity,
                                    dir=cfg.wandb_save_dir, config=run_config)
        if cfg.mlflow_experiment:
            self.mlflow = _import("mlflow", "mlflow_experiment", "mlflow")
            try:
                if cfg.mlflow_tracking_uri:
                    self.mlflow.set_tracking_uri(cfg.mlflow_tracking_uri)
                self.mlflow.set_experiment(cfg.mlflow_experiment)
                self.mlflow.start_run(run_name=cfg.mlflow_run_name)
            except self.mlflow.exceptions.MlflowException as err:
                raise ConfigError("logger.mlflow_tracking_uri", f"MLflow could not start a run: {err.message}",
                                  "Check the tracking URI (e.g. http://host:5000 or sqlite:///mlflow.db).") from err
        if cfg.comet_project:
            comet_ml = _import("comet_ml", "comet_project", "comet_ml")
            # Online/offline, API key and workspace come from Comet's own settings (COMET_* variables).
            self.comet = comet_ml.start(project_name=cfg.comet_project,
                                        experiment_config=comet_ml.ExperimentConfig(name=cfg.comet_experiment_name))
            if run_config:
                self.comet.log_parameters(run_config)

    @property
    def active(self) -> bool:
        return any(backend is not None for backend in (self.tensorboard, self.wandb, self.mlflow, self.comet))

    def add_scalars(self, values: dict[str, Any], step: int) -> None:
        if not self.active:
            return
        clean = {name: float(value) for name, value in values.items() if value is not None}
        if self.tensorboard is not None:
            for name, value in clean.items():
                self.tensorboard.add_scalar(name, value, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)
        if self.mlflow is not None:
            # MLflow's file store keeps a metric per file, so "throughput" and "throughput/..." would
            # collide as file and folder; its names get "_" for "/".
            self.mlflow.log_metrics({name.replace("/", "_"): value for name, value in clean.items()}, step=step)
        if self.comet is not None:
            self.comet.log_metrics(clean, step=step)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()
        if self.mlflow is not None:
            self.mlflow.end_run()
        if self.comet is not None:
            self.comet.end()
