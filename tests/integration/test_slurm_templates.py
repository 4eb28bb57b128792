"""The Slurm templates, run as Slurm would run them, on two localhost "nodes".

``srun``, ``scontrol`` and ``squeue`` are stand-ins on PATH: srun starts its command once per node
with that node's SLURM_* variables, scontrol resolves the node list to localhost and records a
requeue, squeue reports a 20-minute time limit. Everything else (common.sh, torchrun with c10d
rendezvous, bridge, the checkpoint, the requeue decision) is the real thing.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO, RUN_ENV, _free_port, run_env

pytestmark = pytest.mark.slow

SRUN = """#!/bin/bash
while [[ "$1" == --* ]]; do shift; done
pids=()
for ((node = 0; node < SLURM_NNODES; node++)); do
    SLURM_NODEID=$node SLURM_PROCID=$node "$@" & pids+=($!)
done
status=0
for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
exit $status
"""
SCONTROL = """#!/bin/bash
case "$1 $2" in
    "show hostnames") echo 127.0.0.1 ;;
    requeue*) echo "$2" >> "$REQUEUED" ;;
esac
"""
SQUEUE = "#!/bin/bash\necho 00:20:00\n"


def sbatch(template: str, tmp_path: Path, *args: str, hand_off: bool = True) -> subprocess.CompletedProcess:
    """Run a template as Slurm would on two nodes; its bridge runs are forks of the worker's server unless
    ``hand_off`` is false (under ft_launcher, whose kill of a rank's process a forked run would outlive)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("srun", SRUN), ("scontrol", SCONTROL), ("squeue", SQUEUE)):
        (bin_dir / name).write_text(body)
        (bin_dir / name).chmod(0o755)
    env = run_env() if hand_off else dict(RUN_ENV)
    env = {**env, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{env['PATH']}",
           "SLURM_JOB_ID": "4242", "SLURM_JOB_NAME": "bridge", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "node[1-2]",
           "SLURM_SUBMIT_DIR": str(REPO), "GPUS_PER_NODE": "1", "RDZV_PORT": str(_free_port()),
           "LOG_DIR": str(tmp_path / "logs"), "PYTHON": sys.executable, "REQUEUED": str(tmp_path / "requeued")}
    return subprocess.run(["bash", str(REPO / "scripts/slurm" / template), *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900)


def test_multi_node_template_stops_requeues_and_resumes(tmp_path):
    args = ["recipe=tiny", "train.train_iters=20", "train.exit_interval=10", "train.eval_iters=0",
            f"checkpoint.save={tmp_path / 'ckpt'}", "logger.log_interval=5"]
    first = sbatch("multi_node.sbatch", tmp_path, *args)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert "data-parallel groups: [0,1]" in first.stdout  # two nodes of one rank each, one world
    assert "exiting at iteration 10" in first.stdout
    assert (tmp_path / "requeued").read_text().split() == ["4242"]
    log = (tmp_path / "logs" / "4242.log").read_text()
    assert "requeueing job 4242" in log and "iteration 10/20" in log

    second = sbatch("multi_node.sbatch", tmp_path, *args)  # what the requeued job runs
    assert second.returncode == 0, second.stdout[-3000:] + second.stderr[-3000:]
    assert "iteration 15/20" in second.stdout and "iteration 20/20" in second.stdout
    assert "iteration  5/20" not in second.stdout  # resumed, not restarted
    assert (tmp_path / "requeued").read_text().split() == ["4242"]  # finished: no second requeue
