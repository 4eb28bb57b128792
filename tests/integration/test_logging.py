"""What a user watches: TensorBoard scalars, the profiler trace, the plot command, the log line's numbers."""

from __future__ import annotations

import re
import time

import pytest

from bridge_cli.logging.console import ConsoleLog, IntervalStats
from tests.conftest import bridge


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    tb = tmp_path_factory.mktemp("tb")
    result = bridge("pretrain", "recipe=tiny", "train.train_iters=12", "logger.log_interval=4", "train.eval_interval=6",
                    f"logger.tensorboard_dir={tb}", "logger.log_throughput=true", "logger.log_params_norm=true",
                    "logger.log_timers_to_tensorboard=true", "logger.log_validation_ppl_to_tensorboard=true",
                    "logger.log_world_size_to_tensorboard=true", "profiling.use_pytorch_profiler=true",
                    "profiling.profile_step_start=3", "profiling.profile_step_end=4")
    assert result.returncode == 0, result.stderr[-3000:]
    return tb, result.stdout


def test_tensorboard_holds_the_reference_scalars(logged_run):
    from bridge_cli.logging.plot import read_scalars

    tb, _ = logged_run
    scalars = read_scalars(tb)
    for name in ("learning-rate", "learning-rate vs samples", "batch-size", "lm loss", "lm loss vs samples",
                 "loss-scale", "grad-norm", "params-norm", "iteration-time", "world-size", "throughput",
                 "throughput/device/tokens_per_sec", "lm loss validation", "lm loss validation ppl", "lm loss test"):
        assert name in scalars, (name, sorted(scalars))
    assert [step for step, _ in scalars["lm loss"]] == list(range(1, 13))
    assert [step for step, _ in scalars["lm loss validation"]] == [6, 12, 12]  # twice in training, once at the end


def test_params_norm_is_in_the_log_line(logged_run):
    _, out = logged_run
    assert re.search(r"^iteration  4/12 .*\| params norm [0-9.]+ \|", out, re.M)


def test_pytorch_profiler_writes_a_trace(logged_run):
    tb, _ = logged_run
    assert list(tb.rglob("*.pt.trace.json*")), list(tb.iterdir())


def test_plot_writes_a_png(logged_run, tmp_path):
    tb, _ = logged_run
    out = tmp_path / "run.png"
    result = bridge("plot", str(tb), "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_without_logs_is_a_clear_error(tmp_path):
    result = bridge("plot", str(tmp_path))
    assert result.returncode == 2 and "no TensorBoard scalars" in result.stderr


def test_log_line_numbers_from_known_step_times(capsys):
    console = ConsoleLog(total_iters=100, start_iter=0, enabled=True, peak_tflops=100.0)
    stats = IntervalStats(started=time.time() - 2.0)  # 10 iterations in 2 s: 200 ms each
    for _ in range(10):
        stats.add({}, skipped=0)
    console.training_line(10, stats, consumed_samples=80, lr=1e-3, grad_norm=1.5, loss_scale=1.0,
                          tokens_per_iter=4096, flops_per_iter=4e12, world_size=2, elapsed_run=2.0, first_iter=0)
    line = capsys.readouterr().out
    ms = float(re.search(r"elapsed ms/iter ([0-9.]+)", line).group(1))
    tokens = float(re.search(r"tokens/s/gpu ([0-9,]+)", line).group(1).replace(",", ""))
    tflops = float(re.search(r"TFLOP/s/gpu ([0-9.]+)", line).group(1))
    mfu = float(re.search(r"MFU ([0-9.]+)%", line).group(1))
    assert ms == pytest.approx(200, rel=0.01)
    assert tokens == pytest.approx(4096 / 0.2 / 2, rel=0.01)  # 10,240 per GPU
    assert tflops == pytest.approx(4e12 / 0.2 / 2 / 1e12, rel=0.01)  # 10 TFLOP/s per GPU
    assert mfu == pytest.approx(10.0, rel=0.02)
    assert "ETA 0:00:18" in line  # 90 iterations left at 200 ms


def test_progress_log_continues_across_a_resume(tmp_path):
    args = ["pretrain", "recipe=tiny", f"checkpoint.save={tmp_path}", "checkpoint.save_interval=5",
            "logger.log_progress=true", "train.eval_iters=0", "scheduler.lr_warmup_fraction=null",
            "scheduler.lr_warmup_iters=2", "scheduler.lr_decay_iters=20", "scheduler.override_opt_param_scheduler=true"]
    assert bridge(*args, "train.train_iters=10").returncode == 0
    result = bridge(*args, "train.train_iters=20")
    assert result.returncode == 0, result.stderr[-3000:]
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert [l.split("\t")[3] for l in lines].count("Starting job") == 2
    saved = [int(l.split("Iteration: ")[1].split("\t")[0]) for l in lines if "Saved checkpoint" in l]
    assert saved == [5, 10, 15, 20]
    flops = [float(l.split("Floating-point operations: ")[1].split("\t")[0]) for l in lines if "Saved" in l]
    assert flops == sorted(flops) and flops[-1] == pytest.approx(4 * flops[0], rel=0.01)
