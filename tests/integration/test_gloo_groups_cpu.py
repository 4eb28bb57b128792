"""``dist.use_gloo_process_groups``: megatron-core makes gloo copies of its data-parallel groups unless it is false
(Megatron-LM's ``--disable-gloo-process-groups``), and a run without them trains, saves and resumes with the
distributed optimizer as a run with them does. The one save that gathers over them
(``checkpoint.distrib_optim_fully_reshardable_mem_efficient``) is refused beside it.

The runs are ``bridge pretrain`` on two CPU processes (gloo) through distributed_optimizer_cli.py, which lets the
CPU run megatron-core's distributed optimizer."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import bridge, python
from tests.integration.test_pretrain_cpu import losses

REPO = Path(__file__).resolve().parents[2]
WORKER = Path(__file__).with_name("distributed_optimizer_cli.py")
RUN = ["recipe=tiny", "train.train_iters=6", "logger.log_interval=1", "train.eval_iters=0",
       "optimizer.use_distributed_optimizer=true", "model.use_cpu_initialization=true"]


def test_without_gloo_groups_megatron_core_makes_none():
    from megatron.core import parallel_state

    from bridge_cli.runtime.distributed import destroy_distributed, init_distributed

    try:
        runtime = init_distributed("gloo", 1, 1, 1, gloo_groups=False)
        assert runtime.gloo_groups is False
        with pytest.raises(AssertionError, match="gloo"):
            parallel_state.get_data_parallel_group_gloo()
        assert init_distributed("gloo", 1, 1, 1).gloo_groups
        assert parallel_state.get_data_parallel_group_gloo() is not None
    finally:
        destroy_distributed()


def test_the_memory_efficient_save_over_gloo_is_refused_without_gloo_groups():
    result = bridge("pretrain", "recipe=tiny", "dist.use_gloo_process_groups=false",
                    "checkpoint.distrib_optim_fully_reshardable_mem_efficient=true", "--dry-run")
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert "dist.use_gloo_process_groups" in result.stderr and "mem_efficient=false" in result.stderr


def pretrain(*overrides: str):
    env = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = python(str(WORKER), "pretrain", *RUN, *overrides, nproc=2, env=env, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_a_run_without_gloo_groups_trains_saves_and_resumes_as_one_with_them(tmp_path):
    whole = losses(pretrain().stdout)
    ckpt = [f"checkpoint.save={tmp_path / 'ckpt'}", "checkpoint.save_interval=3", "dist.use_gloo_process_groups=false"]
    first = losses(pretrain(*ckpt, "train.exit_interval=3").stdout)
    resumed = pretrain(*ckpt)
    assert "resuming at iteration 3" in resumed.stdout and "optimizer starts fresh" not in resumed.stdout
    assert first + losses(resumed.stdout) == pytest.approx(whole, rel=1e-6), (first, resumed.stdout[-2000:])
