"""`bridge plot`: a PNG of loss, learning rate and throughput against iteration, from TensorBoard logs."""

from __future__ import annotations

from pathlib import Path

from bridge_cli.config.errors import ConfigError

PANELS = (
    ("loss", lambda tag: tag.endswith("loss") and "validation" not in tag and "vs samples" not in tag),
    ("validation loss", lambda tag: tag.endswith("loss validation")),
    ("learning rate", lambda tag: tag == "learning-rate"),
    ("tokens/s per GPU", lambda tag: tag == "throughput/device/tokens_per_sec"),
)


def read_scalars(log_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar series in the TensorBoard event files under ``log_dir``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    series: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(log_dir.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            series.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return {tag: sorted(points) for tag, points in series.items()}


def plot_run(log_dir: Path, output: Path) -> Path:
    """Write the PNG; raise ConfigError when there is nothing to plot or a package is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise ConfigError(None, "bridge plot needs matplotlib.", "pip install matplotlib") from err
    if not log_dir.is_dir():
        raise ConfigError(None, f"{log_dir} is not a folder.", "Give the run's logger.tensorboard_dir.")
    series = read_scalars(log_dir)
    if not series:
        raise ConfigError(None, f"no TensorBoard scalars under {log_dir}.",
                          "Train with logger.tensorboard_dir=DIR, then run bridge plot DIR.")
    panels = [(title, [(tag, pts) for tag, pts in series.items() if wanted(tag)]) for title, wanted in PANELS]
    panels = [(title, lines) for title, lines in panels if lines]
    figure, axes = plt.subplots(len(panels), 1, figsize=(8, 2.6 * len(panels)), sharex=True, squeeze=False)
    for ax, (title, lines) in zip(axes[:, 0], panels):
        for tag, points in lines:
            steps, values = zip(*points)
            ax.plot(steps, values, label=tag, marker="." if len(points) < 30 else None)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize="small")
    axes[-1, 0].set_xlabel("iteration")
    figure.tight_layout()
    figure.savefig(output, dpi=110)
    plt.close(figure)
    return output
