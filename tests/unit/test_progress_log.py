"""progress.txt: the series start survives resumes and restarts when the world size changes."""

from __future__ import annotations

from datetime import datetime

from bridge_cli.logging.progress_log import get_start_time_from_progress_log


def line(stamp: str, gpus: int, *fields: str) -> str:
    return "\t".join([stamp, "Job ID: 1", f"# GPUs: {gpus}", *fields])


def test_start_of_the_latest_series_with_this_world_size(tmp_path):
    saved = lambda it, flops: ("Saved checkpoint", f"Iteration: {it}", "Job throughput: 1 TFLOP/s/GPU",
                               "Cumulative throughput: 1 TFLOP/s/GPU", f"Floating-point operations: {flops:.2e}",
                               "Tokens (in billions): 0.01")
    (tmp_path / "progress.txt").write_text("\n".join([
        line("2026-01-01 00:00:00", 8, "Starting job"),
        line("2026-01-01 01:00:00", 8, *saved(100, 1e18)),
        line("2026-01-01 02:00:00", 16, "Starting job"),  # another world size breaks the series
        line("2026-01-01 03:00:00", 16, *saved(200, 3e18)),
        line("2026-01-01 04:00:00", 8, "Starting job"),
        line("2026-01-01 05:00:00", 8, *saved(300, 4e18)),
        line("2026-01-01 06:00:00", 8, "Starting job"),
    ]) + "\n")
    start, flops = get_start_time_from_progress_log(str(tmp_path), world_size=8)
    assert start == datetime(2026, 1, 1, 4).timestamp() and flops == 3e18
    assert get_start_time_from_progress_log(str(tmp_path / "none"), world_size=8) == (None, 0.0)
