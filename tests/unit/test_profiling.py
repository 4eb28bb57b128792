"""The step profiler's trace lands where the README says, with or without a TensorBoard folder."""

from __future__ import annotations

import torch

from bridge_cli.config.runtime_configs import ProfilingConfig
from bridge_cli.training.profiling import StepProfiler


def _profile_steps(profiler: StepProfiler, steps: int) -> None:
    x = torch.randn(64, 64)
    for iteration in range(1, steps + 1):
        profiler.before_step(iteration)
        x = torch.tanh(x @ x)
        profiler.after_step(iteration)
    profiler.close()


def test_trace_without_a_tensorboard_dir_goes_to_torch_profile(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    cfg = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=2, profile_step_end=3)
    _profile_steps(StepProfiler(cfg, rank=0, is_cuda=False, trace_dir=None), steps=4)
    assert list((tmp_path / "torch_profile").glob("*.pt.trace.json*"))
    assert "iterations 2..3 written to torch_profile" in capsys.readouterr().out


def test_ranks_not_listed_write_nothing(tmp_path):
    cfg = ProfilingConfig(use_pytorch_profiler=True, profile_step_start=1, profile_step_end=2, profile_ranks=[0])
    _profile_steps(StepProfiler(cfg, rank=1, is_cuda=False, trace_dir=str(tmp_path / "tb")), steps=3)
    assert not (tmp_path / "tb").exists()
