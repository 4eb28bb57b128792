"""Training-loop sections: learning-rate / weight-decay schedule and the train/eval loop."""

from dataclasses import dataclass
from typing import Optional

from bridge_cli.config.fields import one_of


@dataclass
class SchedulerConfig:
    """Learning-rate and weight-decay schedules."""

    lr_decay_style: str = one_of("linear", "constant", "linear", "cosine", "inverse-square-root", "WSD")
    """Learning-rate decay function."""

    lr_wsd_decay_style: str = one_of("exponential", "exponential", "linear", "cosine")
    """Decay function of the annealing phase of the WSD schedule."""

    lr_decay_iters: Optional[int] = None
    """Iterations over which the learning rate decays (None: train.train_iters)."""

    lr_wsd_decay_iters: Optional[int] = None
    """Iterations of the annealing phase of the WSD schedule."""

    lr_warmup_fraction: Optional[float] = None
    """Fraction of the decay iterations used for warmup; overrides lr_warmup_iters when set."""

    lr_warmup_iters: int = 0
    """Iterations over which the learning rate warms up linearly."""

    lr_warmup_init: float = 0.0
    """Learning rate at the start of warmup."""

    override_opt_param_scheduler: bool = False
    """Take scheduler values from this config and ignore those stored in the checkpoint."""

    use_checkpoint_opt_param_scheduler: bool = False
    """Take scheduler values from the checkpoint and ignore those in this config."""

    start_weight_decay: Optional[float] = None
    """Weight decay at the start of training (None: optimizer.weight_decay)."""

    end_weight_decay: Optional[float] = None
    """Weight decay at the end of training (None: optimizer.weight_decay)."""

    weight_decay_incr_style: str = one_of("constant", "constant", "linear", "cosine")
    """How weight decay moves from start_weight_decay to end_weight_decay."""

    lr_warmup_steps: Optional[int] = None
    """Derived by ConfigContainer.validate(); not set by users."""

    lr_decay_steps: Optional[int] = None
    """Derived by ConfigContainer.validate(); not set by users."""

    wd_incr_steps: Optional[int] = None
    """Derived by ConfigContainer.validate(); not set by users."""

    wsd_decay_steps: Optional[int] = None
    """Derived by ConfigContainer.validate(); not set by users."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        problems = []
        if self.start_weight_decay is not None and self.start_weight_decay < 0.0:
            problems.append(("start_weight_decay", f"must be >= 0, got {self.start_weight_decay}."))
        if (
            self.start_weight_decay is not None
            and self.end_weight_decay is not None
            and self.end_weight_decay < self.start_weight_decay
        ):
            problems.append(
                (
                    "end_weight_decay",
                    f"must be >= start_weight_decay ({self.start_weight_decay}), got {self.end_weight_decay}.",
                )
            )
        if self.override_opt_param_scheduler and self.use_checkpoint_opt_param_scheduler:
            problems.append(
                (
                    "override_opt_param_scheduler",
                    "cannot be combined with use_checkpoint_opt_param_scheduler; set at most one.",
                )
            )
        return problems


@dataclass
class TrainingConfig:
    """Training loop, batch sizes, exit conditions and evaluation cadence."""

    micro_batch_size: Optional[int] = None
    """Samples per model replica per forward pass."""

    global_batch_size: Optional[int] = None
    """Samples per optimizer step, a multiple of micro_batch_size * data-parallel size (None: exactly that product)."""

    rampup_batch_size: Optional[list[int]] = None
    """Batch-size ramp-up as [start, increment, ramp-up samples], e.g. [16, 8, 300000]."""

    decrease_batch_size_if_needed: bool = False
    """Round the global batch size down to a multiple of micro_batch_size * data-parallel size when that does
    not divide it, instead of refusing it (the log's start-up line shows the batch that runs)."""

    empty_unused_memory_level: int = one_of(0, 0, 1, 2)
    """Call torch.cuda.empty_cache() each iteration: 0 off, 1 moderate, 2 aggressive."""

    check_weight_hash_across_dp_replicas_interval: Optional[int] = None
    """Iterations between checks that weights match across data-parallel replicas (None: never)."""

    train_sync_interval: Optional[int] = None
    """Iterations between CPU-GPU synchronizations, to keep the CPU from running far ahead (None: never)."""

    train_iters: Optional[int] = None
    """Total training iterations across all runs."""

    exit_interval: Optional[int] = None
    """Exit once the iteration number is divisible by this value."""

    exit_duration_in_mins: Optional[int] = None
    """Exit after this many minutes of training."""

    exit_signal_handler: bool = False
    """On exit_signal, save a checkpoint and shut down."""

    exit_signal: int = 15
    """Signal number the exit signal handler listens for (15 is SIGTERM)."""

    exit_signal_handler_for_dataloader: bool = False
    """Install the exit signal handler in dataloader workers too."""

    manual_gc: bool = False
    """Disable automatic garbage collection and collect at aligned points on all ranks, reducing jitter."""

    manual_gc_interval: int = 0
    """Training iterations between manual garbage collections (0: only around evaluation)."""

    manual_gc_eval: bool = True
    """With manual_gc, collect garbage at the start and end of each evaluation."""

    eval_iters: int = 100
    """Iterations per validation or test evaluation."""

    eval_interval: Optional[int] = 1000
    """Training iterations between validation runs (None or 0: never)."""

    skip_train: bool = False
    """Skip training; only run validation/test evaluation, then exit."""
