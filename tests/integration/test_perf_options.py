"""Performance options end to end on the CPU: compiled layers and a pinned attention kernel."""

from __future__ import annotations

import re

import pytest
import torch

from tests.conftest import bridge, torchrun
from tests.integration.test_pretrain_cpu import losses

pytestmark = pytest.mark.slow

RUN = ["recipe=tiny", "train.train_iters=6", "logger.log_interval=1", "train.eval_iters=0"]


@pytest.fixture(scope="module")
def eager():
    """The eager run every compiled run is compared with."""
    return bridge("pretrain", *RUN)


def test_compiled_layers_and_loss_train_like_eager_and_save_the_same_checkpoint(eager, tmp_path):
    ckpt = tmp_path / "ckpt"
    compiled = bridge("pretrain", *RUN, "model.compile_layers=true", f"checkpoint.save={ckpt}",
                      "checkpoint.save_interval=3", env={"TORCH_LOGS": "dynamo,graph_breaks,recompiles"})
    assert eager.returncode == 0 and compiled.returncode == 0, compiled.stderr[-3000:]
    assert len(losses(eager.stdout)) == 6
    assert losses(compiled.stdout) == pytest.approx(losses(eager.stdout), rel=1e-3)
    # two graphs, each compiled once: the whole layer (the second layer reuses the first one's) and the loss
    assert compiled.stderr.count("done compiler function inductor") == 2, compiled.stderr[-3000:]
    assert "Graph break" not in compiled.stderr and "Recompiling" not in compiled.stderr, compiled.stderr[-3000:]
    # an eager run resumes from the compiled run's checkpoint: its keys carry no `_orig_mod.`
    resumed = bridge("pretrain", *RUN, f"checkpoint.load={ckpt}", "checkpoint.ckpt_step=3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming at iteration 3" in resumed.stdout
    assert losses(resumed.stdout) == pytest.approx(losses(eager.stdout)[3:], rel=1e-3)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU has no efficient-attention kernel; a GPU has")
def test_a_backend_the_cpu_lacks_is_refused_in_one_paragraph():
    result = bridge("pretrain", "recipe=tiny", "train.train_iters=1", "model.sdpa_backend=efficient")
    assert result.returncode == 2, result.stderr[-2000:]
    assert result.stderr.startswith("error: model.sdpa_backend=efficient cannot run this model's attention on cpu")
    assert "Traceback" not in result.stderr and result.stderr.count("\n") <= 2, result.stderr
    assert "model.sdpa_backend=auto" in result.stderr


def test_compiled_layers_with_the_fused_linear_cross_entropy_and_full_recompute_match_eager(eager):
    # the chunks' passes between the GEMMs compile (one graph each, reused by every chunk of the same size); a
    # recomputed layer runs forward without gradients, then again with them (its one recompile, for grad mode)
    compiled = bridge("pretrain", *RUN, "model.compile_layers=true", "model.fused_linear_cross_entropy=true",
                      "model.linear_cross_entropy_chunk=128", "model.recompute_granularity=full",
                      "model.recompute_method=uniform", "model.recompute_num_layers=1",
                      env={"TORCH_LOGS": "graph_breaks,recompiles"})
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    assert losses(compiled.stdout) == pytest.approx(losses(eager.stdout), rel=1e-3)
    assert "Graph break" not in compiled.stderr, compiled.stderr[-3000:]
    recompiled = re.findall(r"Recompiling function (\S+) in (\S+)", compiled.stderr)
    assert {(function, where.rsplit("/", 1)[-1].split(":")[0]) for function, where in recompiled} == {
        ("forward", "transformer_layer.py")}, compiled.stderr[-3000:]
    assert "GLOBAL_STATE changed: grad_mode" in compiled.stderr


def test_compiled_layers_and_loss_under_tensor_parallelism_match_one_process(eager, tmp_path):
    # the compiled loss holds the vocab-parallel cross entropy's all-reduces; a cache of its own, as its
    # shapes (halved by TP) are the only ones no other test compiles
    cache = tmp_path / "cache"
    compiled = torchrun(2, "pretrain", *RUN, "model.tensor_model_parallel_size=2",
                        "model.compile_layers=true", env={"XDG_CACHE_HOME": str(cache)})
    assert compiled.returncode == 0, compiled.stderr[-3000:]
    # what it compiled is kept in the user's cache folder, not in /tmp (runtime/compile_cache.py)
    assert any((cache / "bridge" / "torchinductor").rglob("*.py")), compiled.stderr[-3000:]
    assert losses(compiled.stdout) == pytest.approx(losses(eager.stdout), rel=1e-3)
