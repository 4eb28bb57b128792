"""FSDP on 2 GPUs (docs/parallelism.md#fsdp): Megatron-FSDP's sharding strategies and torch FSDP2 follow the loss
curve of the same model under the distributed optimizer (Megatron-FSDP) or plain DDP (FSDP2), bf16, NCCL.

    pip install einops  # Megatron-FSDP builds its device meshes with it
    python -m pytest -q -n 0 tests/gpu/test_gpu_fsdp.py
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import torchrun
from tests.integration.test_pretrain_cpu import losses

pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                                 reason="needs 2 GPUs")]

# llama1b's shape at 4 layers; every run steps torch's foreach Adam, uncompiled, so only the wrapper differs (but the
# tests of compiled layers, and of bridge's Adam under FSDP2)
ARGS = ["pretrain", "recipe=llama1b", "model.num_layers=4", "train.train_iters=12", "logger.log_interval=1",
        "train.eval_iters=0", "optimizer.adam_kernel=foreach", "model.compile_layers=false"]
DISTRIBUTED_OPTIMIZER = ["optimizer.use_distributed_optimizer=true"]
MEGATRON_FSDP = [*DISTRIBUTED_OPTIMIZER, "ddp.use_megatron_fsdp=true", "ddp.overlap_grad_reduce=false",
                 "ddp.overlap_param_gather=false", "model.gradient_accumulation_fusion=false"]
PLAIN = ["optimizer.use_distributed_optimizer=false", "ddp.overlap_grad_reduce=false", "ddp.overlap_param_gather=false",
         "model.gradient_accumulation_fusion=false", "model.share_embeddings_and_output_weights=false"]
TOLERANCE = 2e-2
"""bf16 weights and another reduction order (reduce-scatters in buckets of other sizes): test_gpu_pretrain's bar
for TP and PP against one GPU."""


def curve(*args: str) -> list[float]:
    result = torchrun(2, *ARGS, *args)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    found = losses(result.stdout)
    assert len(found) == 12 and "DP 2" in result.stdout, result.stdout[-2000:]
    return found


@pytest.fixture(scope="module")
def distributed_optimizer_curve() -> list[float]:
    return curve(*DISTRIBUTED_OPTIMIZER, "ddp.overlap_grad_reduce=false", "ddp.overlap_param_gather=false",
                 "model.gradient_accumulation_fusion=false")


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_megatron_fsdp_follows_the_distributed_optimizer(distributed_optimizer_curve, strategy):
    found = curve(*MEGATRON_FSDP, f"ddp.data_parallel_sharding_strategy={strategy}")
    assert found == pytest.approx(distributed_optimizer_curve, rel=TOLERANCE), (found, distributed_optimizer_curve)
    assert found[-1] < found[0]


@pytest.mark.parametrize("strategy", ["no_shard", "optim", "optim_grads", "optim_grads_params"])
def test_megatron_fsdp_with_compiled_layers_follows_the_distributed_optimizer(distributed_optimizer_curve, strategy):
    """model.compile_layers=true under Megatron-FSDP: its hooks gather each layer's weights before the compiled
    forward and reduce its gradients after, outside the layer's graph (no graph break, no recompile)."""
    result = torchrun(2, *ARGS, *MEGATRON_FSDP, f"ddp.data_parallel_sharding_strategy={strategy}",
                      "model.compile_layers=true", env={"TORCH_LOGS": "graph_breaks,recompiles"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    found = losses(result.stdout)
    assert len(found) == 12 and "DP 2" in result.stdout, result.stdout[-2000:]
    assert found == pytest.approx(distributed_optimizer_curve, rel=TOLERANCE), (found, distributed_optimizer_curve)
    assert "Graph break" not in result.stderr and "Recompiling" not in result.stderr, result.stderr[-3000:]


@pytest.fixture(scope="module")
def eager_fsdp2_curve() -> list[float]:
    """torch FSDP2, eager layers, torch's foreach Adam over the DTensors."""
    return curve(*PLAIN, "dist.use_torch_fsdp2=true")


def test_torch_fsdp2_follows_plain_ddp(eager_fsdp2_curve):
    plain = curve(*PLAIN)
    assert eager_fsdp2_curve == pytest.approx(plain, rel=TOLERANCE), (eager_fsdp2_curve, plain)


@pytest.mark.parametrize("kernel", ["triton", "fused"])
def test_torch_fsdp2_with_compiled_layers_and_bridges_adam_follows_eager_foreach(eager_fsdp2_curve, kernel):
    """model.compile_layers=true with FSDP2's hooks outside each layer's graph (no graph break, no recompile), and the
    Adam kernel stepping each weight's local shard: bridge's Triton Adam (writing the bf16 model weights' shards
    itself) or torch's fused one, against eager layers and the foreach Adam."""
    result = torchrun(2, *ARGS, *PLAIN, "dist.use_torch_fsdp2=true", "model.compile_layers=true",
                      f"optimizer.adam_kernel={kernel}", env={"TORCH_LOGS": "graph_breaks,recompiles"})
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    found = losses(result.stdout)
    assert len(found) == 12 and "DP 2" in result.stdout, result.stdout[-2000:]
    assert found == pytest.approx(eager_fsdp2_curve, rel=TOLERANCE), (found, eager_fsdp2_curve)
    assert "Graph break" not in result.stderr and "Recompiling" not in result.stderr, result.stderr[-3000:]


def test_torch_fsdp2_with_compiled_layers_and_the_triton_adam_resumes_its_checkpoint(eager_fsdp2_curve, tmp_path):
    """Saved at 6 and resumed to 12 by the same run: the Triton Adam steps on from the loaded moments (DTensors
    again) and writes the loaded weights' shards, along the eager foreach curve."""
    root = tmp_path / "ckpt"
    fast = [*PLAIN, "dist.use_torch_fsdp2=true", "model.compile_layers=true", "optimizer.adam_kernel=triton",
            f"checkpoint.save={root}"]
    result = torchrun(2, *ARGS, *fast, "train.exit_interval=6")
    assert result.returncode == 0, result.stderr[-3000:]
    result = torchrun(2, *ARGS, *fast)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "optimizer starts fresh" not in result.stdout
    assert losses(result.stdout) == pytest.approx(eager_fsdp2_curve[6:], rel=TOLERANCE)


def test_torch_fsdp2_checkpoint_resumes_under_plain_ddp(tmp_path):
    """FSDP2 on 2 GPUs saves at 6; plain DDP on 2 GPUs resumes it to 12 with the optimizer state: the curve goes on
    as FSDP2's uninterrupted one does."""
    root = tmp_path / "ckpt"
    whole = curve(*PLAIN, "dist.use_torch_fsdp2=true")
    result = torchrun(2, *ARGS, *PLAIN, "dist.use_torch_fsdp2=true", f"checkpoint.save={root}", "train.exit_interval=6")
    assert result.returncode == 0, result.stderr[-3000:]
    result = torchrun(2, *ARGS, *PLAIN, f"checkpoint.save={root}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "optimizer starts fresh" not in result.stdout
    assert losses(result.stdout) == pytest.approx(whole[6:], rel=TOLERANCE)


def test_torch_fsdp2_checkpoint_under_the_distributed_optimizer_loads_the_weights_and_says_the_moments_start_fresh(
        tmp_path):
    root = tmp_path / "ckpt"
    result = torchrun(2, *ARGS, *PLAIN, "dist.use_torch_fsdp2=true", f"checkpoint.save={root}", "train.exit_interval=6")
    assert result.returncode == 0, result.stderr[-3000:]
    result = torchrun(2, *ARGS, *DISTRIBUTED_OPTIMIZER, "model.gradient_accumulation_fusion=false",
                      "model.share_embeddings_and_output_weights=false", f"checkpoint.save={root}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "holds the state of a plain optimizer" in result.stdout and "optimizer starts fresh" in result.stdout
    assert len(losses(result.stdout)) == 6  # iterations 7-12
