"""The ft and nvrx_straggler sections (NVIDIA Resiliency Extension): what is refused, where and why, and
what a straggler report prints and writes (docs/resilience.md). The runs under ft_launcher are in
tests/integration/test_fault_tolerance.py."""

from __future__ import annotations

import sys

import pytest

from bridge_cli.config.runtime_configs import NVRxStragglerDetectionConfig

GPU_CHECK = ["--dry-run", "--device", "cuda"]  # validates a GPU run's config on this machine


@pytest.fixture
def without_nvrx(monkeypatch):
    """nvidia-resiliency-ext as if not installed (Python's import raises for a None entry)."""
    monkeypatch.setitem(sys.modules, "nvidia_resiliency_ext", None)


@pytest.mark.parametrize("override", ["ft.enable_ft_package=true", "nvrx_straggler.enabled=true"])
def test_without_the_package_the_error_names_it_and_the_install_command(cli, without_nvrx, override):
    result = cli("pretrain", "recipe=tiny", override, *GPU_CHECK)
    assert result.exit_code == 2, result.output
    assert f"error: {override.split('=')[0]}: needs NVIDIA Resiliency Extension (the nvidia-resiliency-ext package)" \
        in result.stderr
    assert "pip install 'bridge-cli[resilience]'" in result.stderr


def test_straggler_detection_on_the_cpu_is_refused_naming_the_field(cli):
    result = cli("pretrain", "recipe=tiny", "nvrx_straggler.enabled=true", "--dry-run", "--device", "cpu")
    assert result.exit_code == 2
    assert "nvrx_straggler.enabled=true needs CUDA" in result.stderr and "nvrx_straggler.enabled=false" in result.stderr


@pytest.mark.parametrize("override, key", [
    ("ft.simulate_fault=true", "ft.simulate_fault"), ("ft.calc_ft_timeouts=true", "ft.calc_ft_timeouts"),
    ("nvrx_straggler.stop_if_detected=true", "nvrx_straggler.stop_if_detected"),
    ("nvrx_straggler.report_time_interval=5", "nvrx_straggler.report_time_interval")])
def test_a_field_of_a_section_left_off_is_refused(cli, override, key):
    result = cli("pretrain", "recipe=tiny", override, "--dry-run")
    assert result.exit_code == 2 and f"error: {key}: has no effect without" in result.stderr, result.output


@pytest.mark.parametrize("overrides, key", [
    (["nvrx_straggler.calc_relative_gpu_perf=false", "nvrx_straggler.calc_individual_gpu_perf=false"],
     "nvrx_straggler.calc_relative_gpu_perf"),
    (["nvrx_straggler.gpu_relative_perf_threshold=1.5"], "nvrx_straggler.gpu_relative_perf_threshold"),
    (["nvrx_straggler.report_time_interval=0"], "nvrx_straggler.report_time_interval"),
    (["nvrx_straggler.profiling_interval=0"], "nvrx_straggler.profiling_interval"),
])
def test_straggler_fields_out_of_range_are_refused(cli, overrides, key):
    result = cli("pretrain", "recipe=tiny", "nvrx_straggler.enabled=true", *overrides, *GPU_CHECK)
    assert result.exit_code == 2 and f"error: {key}:" in result.stderr, result.output


def test_fault_tolerance_fields_out_of_range_are_refused(cli):
    result = cli("pretrain", "recipe=tiny", "ft.enable_ft_package=true", "ft.simulate_fault=true",
                 "ft.simulated_fault_base_delay=-1", "--dry-run")
    assert result.exit_code == 2 and "error: ft.simulated_fault_base_delay: must be >= 0" in result.stderr


def report(relative: dict[int, float], individual: dict[int, float]):
    """A report as NVRx's Detector gathers it on rank 0."""
    from bridge_cli.logging.nvrx_stragglers import _straggler_module

    return _straggler_module().Report(
        gpu_relative_perf_scores=relative, section_relative_perf_scores={}, gpu_individual_perf_scores=individual,
        section_individual_perf_scores={}, rank_to_node={r: f"node{r // 2}" for r in relative or individual},
        local_section_summaries={}, local_kernel_summaries={}, generate_report_elapsed_time=0.1,
        gather_on_rank0=True, rank=None)


nvrx = pytest.importorskip("nvidia_resiliency_ext", reason="needs nvidia-resiliency-ext")


def test_a_report_names_the_straggler_and_prints_the_best_and_worst_scores():
    from bridge_cli.logging.nvrx_stragglers import StragglerSummary

    cfg = NVRxStragglerDetectionConfig(enabled=True, num_gpu_perf_scores_to_print=1)
    summary = StragglerSummary.of(report({0: 1.0, 1: 0.52, 2: 0.97, 3: 0.9}, {0: 0.99, 1: 0.6, 2: 1.0, 3: 0.95}), cfg)
    lines = summary.lines(cfg, step=300)
    assert lines == [
        "GPU relative performance scores at iteration 300 (1.00: as fast as the fastest GPU): "
        "worst rank 1 (node0) 0.52; best rank 0 (node0) 1.00",
        "GPU individual performance scores at iteration 300 (1.00: as fast as the GPU at its best): "
        "worst rank 1 (node0) 0.60; best rank 2 (node1) 1.00",
        "straggler at iteration 300: rank 1 on node0 (relative 0.52 < 0.7, individual 0.60 < 0.7)"]
    scalars = summary.scalars()
    assert scalars["nvrx_straggler/gpu_relative_perf_score/rank_1"] == 0.52
    assert scalars["nvrx_straggler/gpu_individual_perf_score/rank_3"] == 0.95
    assert scalars["nvrx_straggler/stragglers"] == 1.0


def test_scores_print_only_with_stragglers_when_asked_for_none_and_never_without_logging():
    from bridge_cli.logging.nvrx_stragglers import StragglerSummary

    quiet = NVRxStragglerDetectionConfig(enabled=True, num_gpu_perf_scores_to_print=0)
    assert StragglerSummary.of(report({0: 1.0, 1: 0.9}, {0: 1.0, 1: 0.95}), quiet).lines(quiet, 10) == []
    slow = StragglerSummary.of(report({0: 1.0, 1: 0.5}, {0: 1.0, 1: 0.95}), quiet).lines(quiet, 10)
    assert len(slow) == 3 and "worst rank 1 (node0) 0.50, rank 0 (node0) 1.00" in slow[0]  # every score
    off = NVRxStragglerDetectionConfig(enabled=True, enable_logging=False, gpu_individual_perf_threshold=0.99)
    assert StragglerSummary.of(report({0: 1.0, 1: 0.5}, {0: 1.0, 1: 0.95}), off).lines(off, 10) == [
        "straggler at iteration 10: rank 1 on node0 (relative 0.50 < 0.7, individual 0.95 < 0.99)"]


def test_a_simulated_fault_is_planned_on_its_rank_in_the_first_start_only(monkeypatch):
    from bridge_cli.config.errors import ConfigError
    from bridge_cli.config.runtime_configs import FaultToleranceConfig
    from bridge_cli.runtime.fault_tolerance import SimulatedFault

    cfg = FaultToleranceConfig(enable_ft_package=True, simulate_fault=True, simulated_fault_rank=1,
                               simulated_fault_base_delay=7)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    kinds = {SimulatedFault.plan(cfg, rank=1, world_size=2).kind for _ in range(40)}
    assert kinds == {"rank_hung", "rank_killed"}  # 'random' picks either
    fault = SimulatedFault.plan(cfg, rank=1, world_size=2)
    assert 7 <= fault.delay < 8 and fault.rank == 1
    assert SimulatedFault.plan(cfg, rank=0, world_size=2) is None
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert SimulatedFault.plan(cfg, rank=1, world_size=2) is None  # the restarted workers run clean
    with pytest.raises(ConfigError, match="ft.simulated_fault_rank: is 1, and this run has ranks 0 to 0"):
        SimulatedFault.plan(cfg, rank=0, world_size=1)
