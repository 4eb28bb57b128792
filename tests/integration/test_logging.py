"""What a user watches: TensorBoard scalars, the profiler trace, the plot command, the log line's numbers."""

from __future__ import annotations

import re
import time

import pytest

from bridge_cli.logging.console import ConsoleLog, IntervalStats
from tests.conftest import bridge, torchrun


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    tb = tmp_path_factory.mktemp("tb")
    tracking = tmp_path_factory.mktemp("tracking")
    result = bridge("pretrain", "recipe=tiny", "train.train_iters=12", "logger.log_interval=4", "train.eval_interval=6",
                    f"logger.tensorboard_dir={tb}", "logger.log_throughput=true", "logger.log_params_norm=true",
                    "logger.log_timers_to_tensorboard=true", "logger.log_validation_ppl_to_tensorboard=true",
                    "logger.log_world_size_to_tensorboard=true", "profiling.use_pytorch_profiler=true",
                    "profiling.profile_step_start=3", "profiling.profile_step_end=4",
                    "logger.timing_log_level=2", "logger.log_l2_norm_grad_to_tensorboard=true",
                    "logger.log_runtime_to_tensorboard=true", "logger.runtime_time_unit=seconds",
                    "logger.mlflow_experiment=tiny", f"logger.mlflow_tracking_uri=file:{tracking}/mlruns",
                    "logger.comet_project=tiny",
                    env={"MLFLOW_ALLOW_FILE_STORE": "true", "COMET_START_ONLINE": "false",
                         "COMET_OFFLINE_DIRECTORY": str(tracking / "comet")})
    assert result.returncode == 0, result.stderr[-3000:]
    return tb, result.stdout, tracking


@pytest.mark.slow
def test_tensorboard_holds_the_reference_scalars(logged_run):
    from bridge_cli.logging.plot import read_scalars

    tb, *_ = logged_run
    scalars = read_scalars(tb)
    for name in ("learning-rate", "learning-rate vs samples", "batch-size", "lm loss", "lm loss vs samples",
                 "loss-scale", "grad-norm", "params-norm", "iteration-time", "world-size", "throughput",
                 "throughput/device/tokens_per_sec", "lm loss validation", "lm loss validation ppl", "lm loss test"):
        assert name in scalars, (name, sorted(scalars))
    assert [step for step, _ in scalars["lm loss"]] == list(range(1, 13))
    assert [step for step, _ in scalars["lm loss validation"]] == [6, 12, 12]  # twice in training, once at the end


@pytest.mark.slow
def test_timers_l2_norms_and_runtime_reach_tensorboard(logged_run):
    from bridge_cli.logging.plot import read_scalars

    tb, *_ = logged_run
    scalars = read_scalars(tb)
    for name in ("forward-backward-time", "forward-compute-time", "backward-compute-time", "batch-generator-time",
                 "optimizer-time", "l2_norm/grad/global", "l2_norm/grad/decoder.final_layernorm.weight",
                 "time/remaining_estimate", "time/total", "time/tokens"):
        assert name in scalars, (name, sorted(scalars))
    assert [step for step, _ in scalars["forward-backward-time"]] == [4, 8, 12]  # each log interval
    assert scalars["time/tokens"][-1] == (12, 12 * 8 * 128)  # iterations x global batch x seq length
    # Clipping (optimizer.clip_grad=1.0) scales the gradients in place after the norm is taken.
    assert all(0 < norm <= 1.0 + 1e-4 for _, norm in scalars["l2_norm/grad/global"])


@pytest.mark.slow
def test_timer_block_follows_each_log_line(logged_run):
    _, out, _ = logged_run
    block = re.search(r"^iteration  4/12 .*\n\(min, max\) time across ranks \(ms\):\n((?:    .*\n)+)", out, re.M)
    assert block, out[-3000:]
    timed = dict(re.findall(r"^    (\S+) \.+: \(([0-9.]+), [0-9.]+\)$", block.group(1), re.M))
    assert {"forward-backward", "forward-compute", "backward-compute", "batch-generator", "optimizer"} <= set(timed)
    assert float(timed["forward-backward"]) >= float(timed["forward-compute"]) > 0


@pytest.mark.slow
def test_metrics_reach_mlflow_and_comet(logged_run):
    import json
    import os
    import zipfile

    from mlflow.tracking import MlflowClient

    _, _, tracking = logged_run
    os.environ["MLFLOW_ALLOW_FILE_STORE"] = "true"
    client = MlflowClient(f"file:{tracking}/mlruns")
    (run,) = client.search_runs([client.get_experiment_by_name("tiny").experiment_id])
    assert [m.step for m in client.get_metric_history(run.info.run_id, "lm loss")] == list(range(1, 13))
    (archive,) = (tracking / "comet").glob("*.zip")
    with zipfile.ZipFile(archive) as zipped:
        messages = [json.loads(line) for line in zipped.read("messages.json").splitlines()]
    logged = {m["payload"]["metric"]["metricName"] for m in messages if m["type"] == "metric_msg"}
    assert {"lm loss", "grad-norm", "learning-rate"} <= logged, sorted(logged)


@pytest.mark.slow
def test_params_norm_is_in_the_log_line(logged_run):
    _, out, _ = logged_run
    assert re.search(r"^iteration  4/12 .*\| params norm [0-9.]+ \|", out, re.M)


@pytest.mark.slow
def test_pytorch_profiler_writes_a_trace(logged_run):
    tb, *_ = logged_run
    assert list(tb.rglob("*.pt.trace.json*")), list(tb.iterdir())


@pytest.mark.slow
def test_plot_writes_a_png(logged_run, tmp_path):
    tb, *_ = logged_run
    out = tmp_path / "run.png"
    result = bridge("plot", str(tb), "--output", str(out))
    assert result.returncode == 0, result.stderr
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000


def test_plot_without_logs_is_a_clear_error(cli, tmp_path):
    result = cli("plot", str(tmp_path))
    assert result.exit_code == 2 and "no TensorBoard scalars" in result.stderr


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_two_ranks_time_each_rank_and_reduce_gradient_norms(tmp_path):
    """TP=2: the 'all' option lists both ranks; the global gradient norm over the model-parallel
    group equals the optimizer's grad norm (no clipping at clip_grad=100)."""
    from bridge_cli.logging.plot import read_scalars

    result = torchrun(2, "pretrain", "recipe=tiny", "train.train_iters=4", "logger.log_interval=2", "train.eval_iters=0",
                      "model.tensor_model_parallel_size=2", "optimizer.clip_grad=100.0", "logger.timing_log_level=1",
                      "logger.timing_log_option=all", f"logger.tensorboard_dir={tmp_path}",
                      "logger.log_l2_norm_grad_to_tensorboard=true")
    assert result.returncode == 0, result.stderr[-3000:]
    block = result.stdout.split("times across ranks (ms):", 1)[1]
    assert re.search(r"  forward-backward:\n     rank  0: [0-9.]+\n     rank  1: [0-9.]+", block), block[:500]
    scalars = read_scalars(tmp_path)
    for (_, global_norm), (_, grad_norm) in zip(scalars["l2_norm/grad/global"], scalars["grad-norm"]):
        assert global_norm == pytest.approx(grad_norm, rel=1e-4)


def test_energy_logging_on_the_cpu_is_a_clear_error(cli):
    result = cli("pretrain", "recipe=tiny", "logger.log_energy=true")  # refused before any process group exists
    assert result.exit_code == 2, result.stderr[-2000:]
    assert "logger.log_energy=true" in result.stderr and "CUDA" in result.stderr
    assert "Traceback" not in result.stderr
