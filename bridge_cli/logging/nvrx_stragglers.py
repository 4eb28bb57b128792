"""NVIDIA Resiliency Extension's straggler detection (the ``nvrx_straggler`` section; GPU only).

NVRx's ``straggler.Detector`` times the CUDA kernels of each training step with CUPTI (every
``profiling_interval``-th step) and scores each GPU: relative to the fastest GPU, and individually against its
own best so far (1.0: as fast). It times the first 16 steps, turns ``report_time_interval`` seconds into a number
of steps (the largest any rank computed, so every rank reports at the same step) and reports every that many
steps. Rank 0 gathers every rank's scores and alone holds the report; bridge sends its summary from rank 0 to
every rank at each report, and the logging rank prints the best and worst, names the GPUs below the thresholds,
writes every score to TensorBoard/W&B, and, with ``stop_if_detected``, has the run save a checkpoint and stop
(every rank decides alike from rank 0's report)."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any, ContextManager, Optional

SECTION = "train_step"
"""The name of the Detector's section that wraps each training step."""


@dataclass
class StragglerSummary:
    """What one NVRx report says, as the log line and TensorBoard need it (built on rank 0, sent to all)."""

    relative: dict[int, float] = field(default_factory=dict)
    """Rank -> relative GPU performance score (empty unless calc_relative_gpu_perf)."""
    individual: dict[int, float] = field(default_factory=dict)
    """Rank -> individual GPU performance score (empty unless calc_individual_gpu_perf)."""
    nodes: dict[int, str] = field(default_factory=dict)
    """Rank -> node name."""
    stragglers: dict[int, list[str]] = field(default_factory=dict)
    """Rank -> which scores fell below their thresholds ('relative 0.52 < 0.7')."""

    @classmethod
    def of(cls, report, cfg) -> "StragglerSummary":
        """The summary of ``report`` (an nvidia_resiliency_ext straggler.Report gathered on rank 0)."""
        found = report.identify_stragglers(gpu_rel_threshold=cfg.gpu_relative_perf_threshold,
                                           gpu_indiv_threshold=cfg.gpu_individual_perf_threshold)
        summary = cls(relative=dict(report.gpu_relative_perf_scores),
                      individual=dict(report.gpu_individual_perf_scores), nodes=dict(report.rank_to_node))
        for kind, scores, threshold in (("relative", summary.relative, cfg.gpu_relative_perf_threshold),
                                        ("individual", summary.individual, cfg.gpu_individual_perf_threshold)):
            for straggler in found[f"straggler_gpus_{kind}"]:
                summary.stragglers.setdefault(straggler.rank, []).append(
                    f"{kind} {scores[straggler.rank]:.2f} < {threshold}")
        return summary

    def lines(self, cfg, step: int) -> list[str]:
        """The report's lines for the log at ``step``."""
        out = []
        shown = cfg.enable_logging and (cfg.num_gpu_perf_scores_to_print > 0 or self.stragglers)
        count = cfg.num_gpu_perf_scores_to_print or len(self.nodes)  # 0: every score, when stragglers are found
        for kind, scores in (("relative", self.relative), ("individual", self.individual)):
            if shown and scores:
                ranked = sorted(scores.items(), key=lambda item: (item[1], item[0]))
                out.append(f"GPU {kind} performance scores at iteration {step} (1.00: as fast as the "
                           f"{'fastest GPU' if kind == 'relative' else 'GPU at its best'}): "
                           f"worst {self._ranks(ranked[:count])}; best {self._ranks(ranked[::-1][:count])}")
        for rank, why in sorted(self.stragglers.items()):
            out.append(f"straggler at iteration {step}: rank {rank} on {self.nodes.get(rank, '?')} ({', '.join(why)})")
        return out

    def _ranks(self, items) -> str:
        return ", ".join(f"rank {rank} ({self.nodes.get(rank, '?')}) {score:.2f}" for rank, score in items)

    def scalars(self) -> dict[str, float]:
        """Every score, and the number of stragglers, for TensorBoard/W&B."""
        values: dict[str, float] = {f"nvrx_straggler/gpu_relative_perf_score/rank_{rank}": score
                                    for rank, score in self.relative.items()}
        values.update({f"nvrx_straggler/gpu_individual_perf_score/rank_{rank}": score
                       for rank, score in self.individual.items()})
        values["nvrx_straggler/stragglers"] = float(len(self.stragglers))
        return values


class NoStragglerDetection:
    """What the loop calls without ``nvrx_straggler.enabled``: nothing happens."""

    def step(self) -> ContextManager[None]:
        """Time the training step this block runs."""
        return contextlib.nullcontext()

    def after_step(self, step: int, writer: Any) -> Optional[str]:
        """Report if one is due; the reason to save and stop when stragglers were found with stop_if_detected."""
        return None

    def close(self) -> None:
        """Stop the detector."""


class NVRxStragglerDetection(NoStragglerDetection):
    """NVRx's straggler.Detector, initialized for this run (a class with global state: one per process)."""

    def __init__(self, cfg) -> None:
        self.cfg = cfg
        self.detector = _straggler_module().Detector
        scores = [name for name, on in (("relative_perf_scores", cfg.calc_relative_gpu_perf),
                                        ("individual_perf_scores", cfg.calc_individual_gpu_perf)) if on]
        self.detector.initialize(scores_to_compute=scores, gather_on_rank0=True,
                                 profiling_interval=cfg.profiling_interval,
                                 report_time_interval=cfg.report_time_interval)
        self.log = logging.getLogger(cfg.logger_name)

    def step(self) -> ContextManager[None]:
        return self.detector.detection_section(SECTION, profile_cuda=True)

    def after_step(self, step: int, writer: Any) -> Optional[str]:
        from bridge_cli.runtime.collectives import is_last_rank

        report = self.detector.generate_report_if_interval_elapsed()  # collective when due
        # Due at the same step on every rank (NVRx agrees on the interval in steps), but only rank 0 holds the
        # report (gather_on_rank0): every rank asks whether one is due, never whether it holds one.
        if not self.detector.is_interval_elapsed():
            return None
        summary = summary_from_rank_0(report, self.cfg)
        if is_last_rank():
            for line in summary.lines(self.cfg, step):
                self.log.log(logging.WARNING if line.startswith("straggler") else logging.INFO, line)
            if self.cfg.enable_logging and writer is not None:
                writer.add_scalars(summary.scalars(), step)
        if summary.stragglers and self.cfg.stop_if_detected:
            ranks = ", ".join(map(str, sorted(summary.stragglers)))
            return f"exiting at iteration {step}: straggler GPU on rank {ranks} (nvrx_straggler.stop_if_detected)"
        return None

    def close(self) -> None:
        self.detector.shutdown()


def start_nvrx_straggler_detection(cfg) -> NoStragglerDetection:
    """The run's detector with ``nvrx_straggler.enabled`` (validation has refused it off CUDA), else one that
    does nothing; its report lines show on stderr, as Python logging's INFO records of ``cfg.logger_name``."""
    if cfg is None or not cfg.enabled:
        return NoStragglerDetection()
    from bridge_cli.logging.python_logging import show_info_records

    show_info_records(cfg.logger_name)
    return NVRxStragglerDetection(cfg)


def summary_from_rank_0(report, cfg) -> StragglerSummary:
    """Rank 0's summary of its ``report``, on every rank; called by every rank when a report is due (the
    others hold None)."""
    import torch.distributed as dist

    box = [StragglerSummary.of(report, cfg) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _straggler_module():
    """nvidia_resiliency_ext's straggler package: ``attribution.straggler`` from 0.5 on, ``straggler`` in 0.4
    (the same Detector and Report through 0.7)."""
    try:
        from nvidia_resiliency_ext.attribution import straggler
    except ImportError:
        from nvidia_resiliency_ext import straggler
    return straggler
