"""straggler.*: megatron-core's StragglerDetector times every rank's forward passes and logs the slowest and
fastest ranks' estimated throughput each log interval; its control port toggles it while training."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time

import pytest
import torch

from tests.conftest import REPO, _free_port, bridge, torchrun

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

REPORT = re.compile(r"MnEtpt/Rnk: ([0-9.]+)TF/(\d+) \| MxEtpt/Rnk: ([0-9.]+)TF/(\d+)")
RUN = ["recipe=gpt2_124m", "train.micro_batch_size=16", "train.global_batch_size=32", "train.eval_iters=0",
       "logger.log_interval=5", "straggler.log_straggler=true"]


def test_each_log_interval_reports_the_slowest_and_fastest_rank():
    result = bridge("pretrain", *RUN, "train.train_iters=15", f"straggler.straggler_ctrlr_port={_free_port()}")
    assert result.returncode == 0, result.stderr[-3000:]
    reports = REPORT.findall(result.stderr)
    assert len(reports) == 3, result.stderr[-3000:]
    for slowest, slowest_rank, fastest, fastest_rank in reports:
        assert 0 < float(slowest) <= float(fastest) and slowest_rank == fastest_rank == "0"
    assert "MnPwr/Rnk:" in result.stderr and "MnDRtt/Rnk:" in result.stderr


def read_until(proc: subprocess.Popen, seen: list[str], done) -> str:
    """Read the run's output into ``seen`` until a line satisfies ``done``; returns that line."""
    deadline = time.time() + 300
    while time.time() < deadline:
        line = proc.stdout.readline()
        assert line, "".join(seen[-30:])
        seen.append(line)
        if done(line):
            return line
    raise AssertionError("".join(seen[-30:]))


def test_the_control_port_turns_a_detector_started_off_on():
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "bridge_cli", "pretrain", *RUN, "train.train_iters=400",
                             "straggler.disable_straggler_on_startup=true", f"straggler.straggler_ctrlr_port={port}"],
                            cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    seen: list[str] = []
    try:
        read_until(proc, seen, lambda line: re.match(r"iteration\s+10/", line))
        assert not REPORT.search("".join(seen))  # off from the start
        with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
            conn.sendall(b"GET / HTTP/1.0\r\n\r\n")
            assert b"Will turn StragglerDetector ON" in conn.recv(1024)
        read_until(proc, seen, lambda line: "Toggling StragglerDetector State ON" in line)
        read_until(proc, seen, REPORT.search)  # the first interval timed after the toggle
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_two_ranks_are_compared():
    result = torchrun(2, "pretrain", *RUN, "train.train_iters=10", f"straggler.straggler_ctrlr_port={_free_port()}")
    assert result.returncode == 0, result.stderr[-3000:]
    reports = REPORT.findall(result.stdout + result.stderr)
    assert len(reports) == 2 and {r[1] for r in reports} | {r[3] for r in reports} <= {"0", "1"}
