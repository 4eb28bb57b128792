"""NVRxStragglerDetection's steps and reports on 2 gloo ranks (under torchrun), for test_nvrx_straggler_ranks.py.

NVRx's Detector needs CUDA (CUPTI, torch.cuda.synchronize), so here it is replaced by one that answers each rank
as NVRx's does with gather_on_rank0=True (straggler.py and reporting.py, the same in 0.4.1 and 0.7.0): every
REPORT_EVERY-th call of generate_report_if_interval_elapsed is due on every rank alike, and returns the gathered
Report (NVRx's own class) on rank 0 and None on every other rank. Each step all-reduces a tensor, as a training
step reduces its gradients, so a rank left waiting in a collective the other never joins hangs here as on GPUs.
Each rank writes what after_step returned at each step, and the report lines its logger received, to
``--out``/rank<N>.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import types
from pathlib import Path

import torch
import torch.distributed as dist

from bridge_cli.config.runtime_configs import NVRxStragglerDetectionConfig
from bridge_cli.logging import nvrx_stragglers

REPORT_EVERY = 3
STEPS = 7
NVRX = nvrx_stragglers._straggler_module()


class Detector:
    """NVRx's straggler.Detector as each rank sees it, without CUDA."""

    calls = 0

    @classmethod
    def initialize(cls, **kwargs) -> None:
        cls.calls = 0

    @classmethod
    def detection_section(cls, name=None, profile_cuda=True):
        return contextlib.nullcontext()

    @classmethod
    def generate_report_if_interval_elapsed(cls):
        cls.calls += 1
        if not cls.is_interval_elapsed() or dist.get_rank() != 0:
            return None
        return NVRX.Report(gpu_relative_perf_scores={0: 1.0, 1: 0.52}, section_relative_perf_scores={},
                           gpu_individual_perf_scores={0: 0.99, 1: 0.9}, section_individual_perf_scores={},
                           rank_to_node={0: "node0", 1: "node0"}, local_section_summaries={},
                           local_kernel_summaries={}, generate_report_elapsed_time=0.1, gather_on_rank0=True,
                           rank=0)

    @classmethod
    def is_interval_elapsed(cls) -> bool:
        return cls.calls % REPORT_EVERY == 0

    @classmethod
    def shutdown(cls) -> None:
        pass


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stop-if-detected", action="store_true")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    nvrx_stragglers._straggler_module = lambda: types.SimpleNamespace(Detector=Detector, Report=NVRX.Report)
    cfg = NVRxStragglerDetectionConfig(enabled=True, num_gpu_perf_scores_to_print=1,
                                       stop_if_detected=args.stop_if_detected)
    stragglers = nvrx_stragglers.start_nvrx_straggler_detection(cfg)
    logged = Lines()
    logging.getLogger(cfg.logger_name).addHandler(logged)
    returned = {}
    for step in range(1, STEPS + 1):
        with stragglers.step():
            gradients = torch.ones(4)
            dist.all_reduce(gradients)
        returned[step] = stragglers.after_step(step, writer=None)
    stragglers.close()
    dist.barrier()
    (args.out / f"rank{dist.get_rank()}.json").write_text(json.dumps({"returned": returned, "logged": logged.lines}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
