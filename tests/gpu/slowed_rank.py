"""`python tests/gpu/slowed_rank.py ARGS` is `python -m bridge_cli ARGS`, except that on rank 1 a noisy neighbour
in the same process slows that rank's GPU: torchrun starts it in place of `-m bridge_cli` in
tests/gpu/test_gpu_nvrx_stragglers.py.

The neighbour, started before bridge's CLI runs, is a daemon thread that keeps the Triton kernel below running back to
back on a stream of the device's highest priority, on GPU LOCAL_RANK: one wave of 1024-thread blocks on about
SM_SHARE of the SMs, each streaming a slice of its own through HBM. Kernels of one process on different streams run
at the same time, so each training kernel of rank 1 runs on the SMs left over and shares the memory bandwidth: it takes
longer from its start to its end, and those start-end times are what NVRx scores. Why this shape:

- A second process on the GPU, the test's first way, is time-sliced with the run's, never concurrent: a training
  kernel runs whole in its slice at full speed and the wait falls between kernels, where NVRx does not look (the
  scores stayed 0.99-1.00 on 2 H100s).
- A grid of many short blocks would not do either: the GPU dispatches a grid's blocks before those of grids queued
  after it, so a training kernel would wait to start behind it, unmeasured, then run alone. One wave of long blocks is
  dispatched at once and leaves the other SMs free, so training kernels start at once there and run longer; the
  highest priority has each relaunch take back the SMs its previous launch held instead of queueing behind training
  kernels.
- The CUDA context is created here, before bridge sets CUDA_DEVICE_MAX_CONNECTIONS=1 (training/setup.py), so rank 1
  keeps the driver's 8 hardware queues: with one queue, the neighbour's next launch, waiting at its head for the
  previous one to end, would hold the training kernels queued behind it before they start. Rank 0 keeps 1; the
  number of queues does not change how long a kernel runs.
- NVRx records every kernel the process runs while a step's section is open, this one's too (CUPTI's kernel
  activity is process-wide: cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL)), under its name, block and
  grid. A key that rank 0 never records has no reference time, so the relative score leaves it out
  (attribution/straggler/reporting.py, _all_reduce_times and _compute_gpu_perf_score): the kernel is named
  noisy_neighbour so that no training kernel shares its key. It does count in rank 1's individual score (against
  its own best: about 1.0, weighted by its long time), which the test does not assert on.

Without CUDA (a CPU machine) rank 1 says so and runs unslowed, so that the launcher can be tried there.
"""

from __future__ import annotations

import runpy
import sys
import threading
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
SLOWED_RANK = 1
SM_SHARE = 2 / 3
"""Blocks of the neighbour per SM of the GPU: one a SM as the GPU spreads a grid (on an H100, 88 of 132 SMs),
leaving a third of the SMs to the multi-wave GEMMs and attention of training (about 3 times longer) and most of
the memory bandwidth to the neighbour (memory-bound kernels about twice as long): far below the 0.7 threshold.
Even packed two blocks an SM (the thread limit), a third of the SMs go, and the bandwidth still does."""
PER_BLOCK = 1 << 21
"""float32 values each block streams: 8 MiB, 0.7 GiB in all on an H100, far beyond the 50 MiB L2."""
ROUNDS = 4
"""Passes over its slice per launch: 64 MiB read and written per block, about 2 ms a launch."""
BLOCK = 4096
"""Values per block per loop step: 4 per thread, one 16-byte load."""

try:  # torch.compile's Triton, on every CUDA machine that runs bridge's GPU tests
    import triton
    import triton.language as tl
except ImportError:
    triton = None

if triton is not None:
    @triton.jit
    def noisy_neighbour(values, per_block, rounds, BLOCK: tl.constexpr):
        # this block's own slice, read, scaled and written back rounds times (the values stay near 2)
        first = values + tl.program_id(0) * per_block
        offsets = tl.arange(0, BLOCK)
        for _ in range(rounds):
            for start in range(0, per_block, BLOCK):
                x = tl.load(first + start + offsets)
                tl.store(first + start + offsets, x * 0.5 + 1.0)


def start_noisy_neighbour(device: int) -> Callable[[], None]:
    """Keep GPU ``device`` busy from a daemon thread of this process; returns what stops it. The kernel is compiled
    and run once here, so that a failure stops the launcher before training starts."""
    import torch

    if triton is None:
        raise SystemExit("tests/gpu/slowed_rank.py: the noisy neighbour of rank 1 is a Triton kernel; install triton "
                         "(torch.compile's, a dependency of torch's CUDA wheels).")
    torch.cuda.set_device(device)
    blocks = int(torch.cuda.get_device_properties(device).multi_processor_count * SM_SHARE)
    stream = torch.cuda.Stream(priority=-100)  # torch maps it to the device's highest
    with torch.cuda.stream(stream):
        values = torch.zeros(blocks * PER_BLOCK, device="cuda")

    def launch() -> None:
        noisy_neighbour[(blocks,)](values, PER_BLOCK, ROUNDS, BLOCK=BLOCK, num_warps=32)

    with torch.cuda.stream(stream):
        launch()
    stream.synchronize()
    stop = threading.Event()
    thread = threading.Thread(target=_keep_busy, args=(launch, stream, device, stop), name="noisy_neighbour",
                              daemon=True)
    thread.start()
    print(f"slowed_rank.py: rank {SLOWED_RANK}: noisy_neighbour on {blocks} of "
          f"{torch.cuda.get_device_properties(device).multi_processor_count} SMs of cuda:{device}", file=sys.stderr,
          flush=True)

    def stop_it() -> None:
        stop.set()
        thread.join()

    return stop_it


def _keep_busy(launch: Callable[[], None], stream, device: int, stop: threading.Event) -> None:
    """``launch`` on ``stream`` until ``stop``, one launch queued behind the running one: no gap between them, and
    no more queued. The wait for the previous one sleeps (a blocking event) and holds no GIL."""
    import torch

    torch.cuda.set_device(device)
    previous = None
    with torch.cuda.stream(stream):
        while not stop.is_set():
            launch()
            done = torch.cuda.Event(blocking=True)
            done.record(stream)
            if previous is not None:
                previous.synchronize()
            previous = done


def main() -> None:
    sys.path[0] = str(REPO)  # this checkout's bridge_cli, as `python -m bridge_cli` run from it finds it
    from bridge_cli.runtime import launch_env

    stop = None
    if launch_env.rank() == SLOWED_RANK:
        import torch

        if torch.cuda.is_available():
            stop = start_noisy_neighbour(launch_env.local_rank())
        else:
            print(f"slowed_rank.py: rank {SLOWED_RANK} runs unslowed: no CUDA device", file=sys.stderr, flush=True)
    try:
        runpy.run_module("bridge_cli", run_name="__main__", alter_sys=True)
    finally:  # bridge's CLI ends with SystemExit: stop launching before the interpreter shuts down
        if stop is not None:
            stop()


if __name__ == "__main__":
    main()
