"""Logger section: console, TensorBoard, Weights & Biases, MLflow and Comet logging."""

from dataclasses import dataclass
from typing import Optional

from bridge_cli.config.fields import one_of


@dataclass
class LoggerConfig:
    """Console, TensorBoard, Weights & Biases, MLflow and Comet logging."""

    log_interval: int = 100
    """Iterations between loss and timing reports."""

    log_params_norm: bool = False
    """Compute and log the parameter norm."""

    log_throughput: bool = False
    """Compute and log throughput per GPU."""

    log_progress: bool = False
    """Log processed tokens and FLOPs to progress.txt in the checkpoint directory."""

    timing_log_level: int = one_of(0, 0, 1, 2)
    """Timer granularity: 0 iteration time only, 1 once-per-iteration ops, 2 all ops (adds overhead)."""

    timing_log_option: str = one_of("minmax", "max", "minmax", "all")
    """Report the max timing across ranks, the min and max, or every rank's timing."""

    tensorboard_dir: Optional[str] = None
    """Directory for TensorBoard logs (None: no TensorBoard)."""

    tensorboard_log_interval: int = 1
    """Iterations between TensorBoard reports."""

    tensorboard_queue_size: int = 1000
    """Pending TensorBoard events held before a flush to disk."""

    log_timers_to_tensorboard: bool = False
    """Write timers to TensorBoard."""

    log_loss_scale_to_tensorboard: bool = True
    """Write the loss scale to TensorBoard."""

    log_validation_ppl_to_tensorboard: bool = False
    """Write validation perplexity to TensorBoard."""

    log_memory_to_tensorboard: bool = False
    """Write memory usage to TensorBoard."""

    log_world_size_to_tensorboard: bool = False
    """Write the world size to TensorBoard."""

    wandb_project: Optional[str] = None
    """Weights & Biases project (None: no W&B logging)."""

    wandb_exp_name: Optional[str] = None
    """Weights & Biases run name."""

    wandb_save_dir: Optional[str] = None
    """Local directory for Weights & Biases files."""

    wandb_entity: Optional[str] = None
    """Weights & Biases entity (user or team)."""

    logging_level: Optional[int] = None
    """Python logging level of bridge's and megatron-core's loggers, e.g. 20 for INFO (None: leave the default)."""

    filter_warnings: bool = True
    """Drop WARNING records of Python logging (megatron-core's start-up warnings); Python warnings are untouched."""

    modules_to_filter: Optional[list[str]] = None
    """Logger names (and their children) whose logging records are dropped, e.g. [megatron.core.datasets]."""

    set_level_for_all_loggers: bool = False
    """Apply logging_level to every logger, not only the framework's own."""

    log_energy: bool = False
    """Log GPU energy per iteration (J) and power (W) per GPU, read from NVML (NVIDIA GPUs only)."""

    log_l2_norm_grad_to_tensorboard: bool = False
    """Write the global and per-parameter gradient L2 norms (l2_norm/grad/...) to the metric writers."""

    log_runtime_to_tensorboard: bool = False
    """Write elapsed and estimated remaining time and consumed batches/samples/tokens (time/...)."""

    runtime_time_unit: str = one_of("hours", "seconds", "minutes", "hours", "days")
    """Unit of the time/... runtime metrics."""

    mlflow_experiment: Optional[str] = None
    """MLflow experiment to log metrics to (None: no MLflow; needs the mlflow package)."""

    mlflow_run_name: Optional[str] = None
    """MLflow run name (None: MLflow picks one)."""

    mlflow_tracking_uri: Optional[str] = None
    """MLflow tracking server or file store, e.g. file:./mlruns (None: MLflow's default)."""

    comet_project: Optional[str] = None
    """Comet project to log metrics to (None: no Comet; needs comet_ml and its API key or offline mode)."""

    comet_experiment_name: Optional[str] = None
    """Comet experiment name."""

    gpu_peak_tflops: Optional[float] = None
    """Peak dense bf16 TFLOP/s of one GPU, for the MFU column (None: looked up by GPU name; no MFU on CPU)."""
