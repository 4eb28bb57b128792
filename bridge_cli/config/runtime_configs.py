"""Runtime sections: RNG, distributed init, rerun state machine, profiling, fault tolerance, stragglers."""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from bridge_cli.config.fields import list_field, one_of


@dataclass
class RNGConfig:
    """Random number generation."""

    seed: int = 1234
    """Random seed used for python, numpy, pytorch, and cuda."""

    te_rng_tracker: bool = False
    """Use Transformer Engine's RNG tracker; required for CUDA graphs."""

    inference_rng_tracker: bool = False
    """Use a random number generator configured for inference."""

    data_parallel_random_init: bool = False
    """Initialize parameters randomly per data-parallel rank instead of identically."""


@dataclass
class DistributedInitConfig:
    """torch.distributed and process-group initialization."""

    distributed_backend: Optional[str] = one_of(None, "nccl", "gloo")
    """Backend for torch.distributed; None picks nccl when a GPU is visible, else gloo."""

    distributed_timeout_minutes: int = 10
    """Timeout in minutes for torch.distributed collectives."""

    align_grad_reduce: bool = True
    """Launch each pipeline stage's gradient reduce independently instead of all at once."""

    local_rank: int = 0
    """Local rank of this process (Megatron-Bridge's field); bridge takes it from the launcher and refuses another value."""

    lazy_init: bool = False
    """Skip DDP initialization and return a function that completes it (external DDP manager); implies CPU init."""

    use_torch_fsdp2: bool = False
    """Use torch FSDP2 (experimental; does not work with pipeline parallelism)."""

    nccl_communicator_config_path: Optional[str] = None
    """A YAML file of NCCL settings per megatron-core process group (``dp_cp: {max_ctas: 8}``: ``cga_cluster_size``,
    ``max_ctas``, ``min_ctas``, ``net_name``, ``is_high_priority_stream``), applied as each group is created; the
    names and settings are checked (bridge_cli/runtime/nccl_groups.py). NCCL only."""

    use_tp_pp_dp_mapping: bool = False
    """Order ranks tp-pp-dp instead of tp-dp-pp; do not combine with EP or CP."""

    use_gloo_process_groups: bool = True
    """Have megatron-core make gloo copies of its data-parallel groups beside the main ones; the distributed
    optimizer's ``checkpoint.distrib_optim_fully_reshardable_mem_efficient`` saves gather over them. false: fewer
    groups to set up at launch (each gloo group connects its ranks over TCP), as Megatron-LM's
    ``--disable-gloo-process-groups``."""

    use_sharp: bool = False
    """Use SHARP for data-parallel collectives (runs a barrier in each DP group to set SHARP targets)."""

    high_priority_stream_groups: Optional[list[str]] = None
    """megatron-core process groups (e.g. ``[dp_cp, ep]``) whose NCCL streams get high priority, so that their
    collectives start ahead of compute they overlap. NCCL only."""

    external_gpu_device_mapping: bool = False
    """GPU visibility is managed externally (e.g. CUDA_VISIBLE_DEVICES): use device 0, not local_rank."""

    enable_megatron_core_experimental: bool = False
    """Enable experimental Megatron Core features."""


@dataclass
class RerunStateMachineConfig:
    """megatron-core's rerun state machine: re-run a step whose loss looks wrong, to tell a faulty GPU from a real result."""

    error_injection_rate: int = 0
    """Inject an unexpected result into about one in this many loss validations (0: never); needs validate_results."""

    error_injection_type: str = one_of("transient_error", "correct_result", "transient_error", "persistent_error")
    """What an injected result behaves like on its re-runs (with error_injection_rate > 0)."""

    rerun_mode: str = one_of("disabled", "disabled", "validate_results", "report_determinism_stats")
    """validate_results re-runs a step whose loss fails a check; report_determinism_stats re-runs each step, logs the variation. Off by default: it syncs the host each micro-batch (Megatron-LM's default: validate_results)."""

    check_for_nan_in_loss: bool = True
    """Validate each micro-batch's loss for NaN and Inf (with rerun_mode; without it a NaN/Inf loss stops the run anyway)."""

    check_for_spiky_loss: bool = False
    """Validate each micro-batch's loss against 10x the largest of the first 100 (needs rerun_mode)."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each setting that would do nothing in this mode."""
        problems = []
        if self.error_injection_rate and self.rerun_mode != "validate_results":
            problems.append(("error_injection_rate", f"injects results only with rerun_mode=validate_results (it is "
                                                     f"{self.rerun_mode}). Set rerun_state_machine.rerun_mode="
                                                     "validate_results, or leave this at 0."))
        if self.error_injection_type != "transient_error" and not self.error_injection_rate:
            problems.append(("error_injection_type", "takes effect only with error_injection_rate > 0. Set "
                                                     "rerun_state_machine.error_injection_rate too."))
        if self.check_for_spiky_loss and self.rerun_mode == "disabled":
            problems.append(("check_for_spiky_loss", "is checked by the rerun state machine, which is disabled. Set "
                                                     "rerun_state_machine.rerun_mode=validate_results."))
        return problems


@dataclass
class ProfilingConfig:
    """Profiling of the training loop."""

    use_nsys_profiler: bool = False
    """Open an nsys capture range (run under `nsys profile --capture-range=cudaProfilerApi`)."""

    profile_step_start: int = 10
    """Global step at which profiling starts."""

    profile_step_end: int = 12
    """Global step at which profiling stops."""

    use_pytorch_profiler: bool = False
    """Use the built-in PyTorch profiler; its trace (viewable in TensorBoard or Perfetto) goes to
    `logger.tensorboard_dir`, or `./torch_profile` when that is unset."""

    profile_ranks: list[int] = list_field(0)
    """Global ranks to profile."""

    record_memory_history: bool = False
    """Record CUDA memory history on the last rank."""

    memory_snapshot_path: str = "snapshot.pickle"
    """Where to dump the memory history pickle."""

    record_shapes: bool = False
    """Record tensor shapes while profiling."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        problems = []
        if self.use_pytorch_profiler and self.use_nsys_profiler:
            problems.append(("use_pytorch_profiler", "use_pytorch_profiler and use_nsys_profiler cannot both be true."))
        if self.profile_step_start < 0:
            problems.append(("profile_step_start", f"must be >= 0, got {self.profile_step_start}."))
        if self.profile_step_end < self.profile_step_start:
            problems.append(
                (
                    "profile_step_end",
                    f"must be >= profile_step_start ({self.profile_step_start}), got {self.profile_step_end}.",
                )
            )
        return problems


@dataclass
class FaultToleranceConfig:
    """Hang detection and in-job restarts through NVIDIA Resiliency Extension's ft_launcher (docs/resilience.md)."""

    enable_ft_package: bool = False
    """Report the setup, step and checkpointing sections to ft_launcher's rank monitors (run under ft_launcher)."""

    calc_ft_timeouts: bool = False
    """Compute the section timeouts from this run's timings and keep them in checkpoint.save/ft_state.json."""

    simulate_fault: bool = False
    """Inject a fault to test fault tolerance, in the launcher's first start only (a restart then finishes)."""

    simulated_fault_type: str = one_of("random", "rank_hung", "rank_killed", "random")
    """rank_hung stops the rank (SIGSTOP), rank_killed kills it (SIGKILL); 'random' picks one of the two."""

    simulated_fault_rank: Optional[int] = None
    """Rank on which the simulated fault occurs (None: a random rank)."""

    simulated_fault_base_delay: int = 0
    """Seconds from the first training step to the simulated fault; up to 1 s more is added at random."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        if not self.enable_ft_package:
            return _set_while_off(self, "ft", "enable_ft_package")
        problems = []
        if resilience_missing():
            problems.append(("enable_ft_package", f"needs {RESILIENCE_PACKAGE}"))
        if self.simulated_fault_rank is not None and self.simulated_fault_rank < 0:
            problems.append(("simulated_fault_rank", f"must be >= 0, got {self.simulated_fault_rank}."))
        if self.simulated_fault_base_delay < 0:
            problems.append(("simulated_fault_base_delay", f"must be >= 0, got {self.simulated_fault_base_delay}."))
        return problems


RESILIENCE_PACKAGE = ("NVIDIA Resiliency Extension (the nvidia-resiliency-ext package), which is not installed. "
                      "Install it with: pip install 'bridge-cli[resilience]' (or: pip install nvidia-resiliency-ext).")


def resilience_missing() -> bool:
    """Whether nvidia-resiliency-ext cannot be imported (found without importing it: it imports torch)."""
    import importlib.util

    try:
        return importlib.util.find_spec("nvidia_resiliency_ext.fault_tolerance") is None
    except ImportError:
        return True


@dataclass
class StragglerDetectionConfig:
    """megatron-core's StragglerDetector: per-rank GPU throughput, to find the rank that slows the others (GPU only)."""

    log_straggler: bool = False
    """Every logger.log_interval, log the slowest and fastest ranks' estimated throughput, GPU time and clocks."""

    enable_straggler_on_startup: bool = True
    """Time from the first step (false: only once toggled on through straggler_ctrlr_port)."""

    straggler_ctrlr_port: int = 65535
    """TCP port on rank 0 where a request (e.g. `curl host:port`) toggles timing on or off at the next report."""

    straggler_minmax_count: int = 1
    """Also list this many slowest and fastest ranks by estimated throughput (above 1)."""

    disable_straggler_on_startup: bool = False
    """Do not time from the first step (Megatron-LM's flag; wins over enable_straggler_on_startup)."""


@dataclass
class NVRxStragglerDetectionConfig:
    """NVIDIA Resiliency Extension's straggler detection: per-GPU performance scores from CUDA kernel timings."""

    enabled: bool = False
    """Time each training step's CUDA kernels (CUPTI) and report GPU performance scores (GPU only)."""

    report_time_interval: float = 300.0
    """Seconds between reports (the ranks agree on the step at which one is due)."""

    calc_relative_gpu_perf: bool = True
    """Score each GPU against the fastest GPU (1.0: as fast); a straggler is below gpu_relative_perf_threshold."""

    calc_individual_gpu_perf: bool = True
    """Score each GPU against its own best so far (1.0: as fast); a straggler is below gpu_individual_perf_threshold."""

    num_gpu_perf_scores_to_print: int = 5
    """Best and worst scores to print each report (0: print only when stragglers are found)."""

    gpu_relative_perf_threshold: float = 0.7
    """Relative performance score below which a GPU is a straggler."""

    gpu_individual_perf_threshold: float = 0.7
    """Individual performance score below which a GPU is a straggler."""

    stop_if_detected: bool = False
    """When a report finds stragglers, save a checkpoint (with checkpoint.save) and stop training."""

    enable_logging: bool = True
    """Print the scores and write every GPU's to TensorBoard/W&B (nvrx_straggler/...); stragglers are named anyway."""

    profiling_interval: int = 1
    """Time every profiling_interval-th step (straggler.Detector.initialize's profiling_interval)."""

    logger_name: str = "megatron_hub.NVRxStragglerDetection"
    """Python logger of the report lines (scores at INFO, stragglers at WARNING), shown on stderr."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        if not self.enabled:
            return _set_while_off(self, "nvrx_straggler", "enabled")
        problems = []
        if resilience_missing():
            problems.append(("enabled", f"needs {RESILIENCE_PACKAGE}"))
        if not (self.calc_relative_gpu_perf or self.calc_individual_gpu_perf):
            problems.append(("calc_relative_gpu_perf", "and calc_individual_gpu_perf are both false: there is no "
                                                       "score to report. Set one of them to true."))
        if self.report_time_interval <= 0:
            problems.append(("report_time_interval", f"must be > 0 seconds, got {self.report_time_interval}."))
        for name in ("gpu_relative_perf_threshold", "gpu_individual_perf_threshold"):
            if not 0 <= getattr(self, name) <= 1:
                problems.append((name, f"must be in [0, 1] (a score is a ratio to the best), got {getattr(self, name)}."))
        if self.num_gpu_perf_scores_to_print < 0:
            problems.append(("num_gpu_perf_scores_to_print", f"must be >= 0, got {self.num_gpu_perf_scores_to_print}."))
        if self.profiling_interval < 1:
            problems.append(("profiling_interval", f"must be >= 1, got {self.profiling_interval}."))
        return problems


def _set_while_off(section, name: str, switch: str) -> list[tuple[str, str]]:
    """(field, message) for each field of ``section`` set away from its default while its ``switch`` is off."""
    return [(f.name, f"has no effect without {name}.{switch}=true.") for f in dataclasses.fields(section)
            if f.name != switch and getattr(section, f.name) != f.default]
