"""Two "nodes" on localhost: one torchrun per node with --nnodes 2 and c10d rendezvous, as the
Slurm template launches them, training `tiny` over gloo."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import REPO, _free_port, run_env
from tests.integration.test_pretrain_cpu import SHORT, losses

pytestmark = pytest.mark.slow


def two_nodes(*args: str) -> list[subprocess.CompletedProcess]:
    endpoint = f"127.0.0.1:{_free_port()}"
    nodes = [subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", endpoint, "--rdzv-id", "bridge-test",
                               "-m", "bridge_cli", "pretrain", *args],
                              cwd=REPO, env=run_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for _ in range(2)]
    results = []
    for node in nodes:
        out, err = node.communicate(timeout=600)
        results.append(subprocess.CompletedProcess(node.args, node.returncode, out, err))
    return results


@pytest.mark.parametrize("layout", [[], ["model.tensor_model_parallel_size=2"]], ids=["dp2", "tp2"])
def test_two_nodes_match_one_process(single_process_curve, layout):
    results = two_nodes(*SHORT, *layout)
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    logging_node = next(r for r in results if "iteration" in r.stdout)  # the last rank's node prints
    assert losses(logging_node.stdout) == pytest.approx(single_process_curve, rel=1e-4)
    expected = "tensor-parallel groups: [0,1]" if layout else "data-parallel groups: [0,1]"
    assert expected in logging_node.stdout


def test_two_nodes_pipeline_parallel_trains():
    results = two_nodes(*SHORT, "model.pipeline_model_parallel_size=2")
    for result in results:
        assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(next(r for r in results if "iteration" in r.stdout).stdout)
    assert len(curve) == 12 and curve[-1] < 0.8 * curve[0]
