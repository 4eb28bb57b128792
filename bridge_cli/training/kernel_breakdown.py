"""Where a profiled step's GPU time goes: kernels by kind (GEMMs, attention, compiled, ...) and the idle gaps.

Read from the PyTorch profiler's events of a training run (``StepProfiler``) or from any Chrome trace it
wrote (``scripts/bench/kernel_breakdown.py``, for torchtitan's traces too). The kinds come from the
kernel names that cuBLAS, cuDNN, FlashAttention, Triton (``torch.compile``) and NCCL give their kernels.
"""

from __future__ import annotations

import gzip
import json
import re
from collections import Counter
from pathlib import Path
from typing import Iterable, NamedTuple

# first match wins: attention before GEMM (cuDNN's attention kernels name their GEMM tiles too)
KINDS = (
    ("attention", re.compile(r"flash|fmha|sdpa|attention|attn", re.I)),
    ("GEMM", re.compile(r"gemm|nvjet|cutlass|xmma|cublas|matmul|_mm_|wgrad|dgrad", re.I)),
    ("communication", re.compile(r"nccl|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all", re.I)),
    ("compiled (Triton)", re.compile(r"^triton_", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("copies and casts", re.compile(r"memcpy|memset|copy|cast|to_copy|fill", re.I)),
)
OTHER = "other kernels"
IDLE = "GPU idle between kernels"


class Kernel(NamedTuple):
    name: str
    start_us: float
    duration_us: float


class Share(NamedTuple):
    kind: str
    ms_per_step: float
    fraction: float  # of the profiled window, first kernel's start to last kernel's end


def kind_of(name: str) -> str:
    return next((kind for kind, pattern in KINDS if pattern.search(name)), OTHER)


def breakdown(kernels: Iterable[Kernel], steps: int) -> list[Share]:
    """GPU time per step by kind, largest first, then the idle time (the window less the kernels' union)."""
    kernels = sorted(kernels, key=lambda k: k.start_us)
    if not kernels or steps < 1:
        return []
    window = max(k.start_us + k.duration_us for k in kernels) - kernels[0].start_us
    by_kind: dict[str, float] = {}
    for k in kernels:
        by_kind[kind_of(k.name)] = by_kind.get(kind_of(k.name), 0.0) + k.duration_us
    busy, reach = 0.0, kernels[0].start_us  # union of the intervals (kernels on several streams overlap)
    for k in kernels:
        end = k.start_us + k.duration_us
        if end > reach:
            busy += end - max(reach, k.start_us)
            reach = end
    rows = sorted(by_kind.items(), key=lambda item: -item[1]) + [(IDLE, window - busy)]
    return [Share(kind, us / steps / 1000, us / window if window else 0.0) for kind, us in rows]


def from_profiler(profile) -> list[Kernel]:
    """The CUDA kernels, copies and sets of a stopped ``torch.profiler.profile``."""
    from torch.autograd import DeviceType

    return [Kernel(e.name, e.time_range.start, e.time_range.elapsed_us()) for e in profile.events()
            if e.device_type == DeviceType.CUDA]


def from_trace_file(path: Path) -> list[Kernel]:
    """The same from a Chrome trace (``*.pt.trace.json``, gzipped or not) the profiler wrote."""
    return [Kernel(e["name"], float(e["ts"]), float(e["dur"])) for e in _events(path) if _is_gpu_work(e)]


class OpShare(NamedTuple):
    kind: str
    kernel: str
    op: str  # the CPU op that launched the kernel ("" where the trace does not say)
    shapes: str  # that op's input shapes (with profiling.record_shapes=true)
    ms_per_step: float
    launches_per_step: float


def by_launching_op(path: Path, steps: int, top: int) -> list[OpShare]:
    """GPU time per (kind, kernel, launching op and its input shapes) in a Chrome trace, the ``top`` largest:
    which op a kind's time goes to (the profiler links each kernel to its op by "External id")."""
    events = _events(path)
    ops: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") == "cpu_op" and "External id" in e.get("args", {}):
            ops.setdefault(e["args"]["External id"], e)
    time: Counter = Counter()
    launches: Counter = Counter()
    for e in filter(_is_gpu_work, events):
        op = ops.get(e.get("args", {}).get("External id"), {"name": "", "args": {}})
        key = (kind_of(e["name"]), e["name"], op["name"], str(op["args"].get("Input Dims", "")))
        time[key] += float(e["dur"])
        launches[key] += 1
    return [OpShare(*key, us / steps / 1000, launches[key] / steps) for key, us in time.most_common(top)]


class IdleCauses(NamedTuple):
    host_late_ms: float  # per step: the next kernel was launched only after the GPU had run dry
    waiting_ms: float  # per step: the next kernel was launched in time and started late (a stream or rank dependency)


def idle_causes(path: Path, steps: int) -> IdleCauses:
    """Split a Chrome trace's idle GPU time by cause, matching each kernel to its launch ("correlation").

    A gap that ends with a kernel launched after the previous one finished is the host setting the pace (its
    Python, dispatch and launch overhead); one whose kernel was queued before is a wait on another stream or an
    event (a collective waiting for a peer). The profiler slows the host, so host-late time reads higher under
    it than in an unprofiled step."""
    events = _events(path)
    launched = {e["args"]["correlation"]: e["ts"] + e["dur"] for e in events
                if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver")
                and "correlation" in e.get("args", {})}
    late = waiting = 0.0
    reach = None
    for e in sorted(filter(_is_gpu_work, events), key=lambda e: e["ts"]):
        start, end = float(e["ts"]), float(e["ts"]) + float(e["dur"])
        if reach is not None and start > reach:
            launch_end = launched.get(e.get("args", {}).get("correlation"))
            if launch_end is not None and launch_end >= reach:
                late += start - reach
            else:
                waiting += start - reach
        reach = end if reach is None else max(reach, end)
    return IdleCauses(late / steps / 1000, waiting / steps / 1000)


def op_table(shares: list[OpShare], title: str) -> str:
    lines = [title, f"  {'ms/step':>9} {'launches':>8}  {'kind':<20} {'kernel':<50} op (input shapes)"]
    lines += [f"  {s.ms_per_step:>9.2f} {s.launches_per_step:>8.0f}  {s.kind:<20} {s.kernel[:50]:<50} "
              f"{s.op} {s.shapes[:100]}" for s in shares]
    return "\n".join(lines)


def _events(path: Path) -> list[dict]:
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        return json.load(f)["traceEvents"]


def _is_gpu_work(event: dict) -> bool:
    return event.get("ph") == "X" and event.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")


def table(shares: list[Share], title: str) -> str:
    lines = [title, f"  {'kind':<26} {'ms/step':>9} {'share':>7}"]
    lines += [f"  {s.kind:<26} {s.ms_per_step:>9.1f} {s.fraction:>7.1%}" for s in shares]
    return "\n".join(lines)
