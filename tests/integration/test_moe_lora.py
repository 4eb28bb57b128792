"""LoRA on tiny_moe: adapters on attention, every routed expert and the shared expert train from a
pretrained MoE checkpoint, per-expert (SequentialMLP) or grouped-GEMM experts alike, and the grouped
ones under expert parallelism too; their adapters load into either kind."""

from __future__ import annotations

import pytest

from tests.conftest import bridge, torchrun
from tests.integration.test_pretrain_cpu import losses

RUN = ["recipe=tiny_moe", "train.eval_iters=0", "logger.log_interval=1", "model.moe_grouped_gemm=false"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    save = tmp_path_factory.mktemp("moe_base") / "ckpt"
    result = bridge("pretrain", *RUN, "train.train_iters=4", f"checkpoint.save={save}")
    assert result.returncode == 0, result.stderr[-3000:]
    return save


@pytest.fixture(scope="module")
def sequential(base, tmp_path_factory):
    """A LoRA fine-tune of SequentialMLP experts: (its output, its checkpoint folder)."""
    save = tmp_path_factory.mktemp("moe_lora") / "lora"
    result = bridge("finetune", *LORA, f"checkpoint.pretrained_checkpoint={base}", f"checkpoint.save={save}")
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout, save


LORA = [*RUN, "peft=lora", "train.train_iters=8"]


def adapter_shapes(folder, layer: str = "decoder.layers.1.") -> dict:
    from torch.distributed.checkpoint import FileSystemReader

    return {k: tuple(v.size) for k, v in FileSystemReader(str(folder / "iter_0000008")).read_metadata()
            .state_dict_metadata.items() if k.startswith(layer) and hasattr(v, "size")}


@pytest.mark.slow
def test_lora_on_moe_adapts_attention_routed_and_shared_experts(sequential):
    output, save = sequential
    curve = losses(output)
    assert len(curve) == 8 and curve[-1] < curve[0], curve
    shapes = adapter_shapes(save)
    layer = "decoder.layers.1."
    assert shapes[layer + "mlp.experts.experts.linear_fc1.adapter.linear_out.weight"] == (8, 256, 32)  # 8 experts
    assert shapes[layer + "mlp.experts.experts.linear_fc2.adapter.linear_in.weight"] == (8, 32, 128)
    assert layer + "mlp.shared_experts.linear_fc1.adapter.linear_in.weight" in shapes
    assert layer + "self_attention.linear_qkv.adapter.linear_in.weight" in shapes
    assert not any("router" in k or ("adapter" not in k and "optimizer" not in k) for k in shapes), shapes


@pytest.mark.slow
def test_grouped_experts_take_the_same_adapters(base, sequential, tmp_path):
    """Same A draws, same math on the CPU (a loop of GEMMs), same checkpoint keys and shapes."""
    result = bridge("finetune", *LORA, "model.moe_grouped_gemm=true", f"checkpoint.pretrained_checkpoint={base}",
                    f"checkpoint.save={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(result.stdout) == pytest.approx(losses(sequential[0]), rel=1e-5)
    assert adapter_shapes(tmp_path) == adapter_shapes(sequential[1])


@pytest.mark.slow
def test_grouped_adapters_under_expert_parallel_two_match_and_load_into_sequential_experts(base, sequential, tmp_path):
    result = torchrun(2, "finetune", *LORA, "model.moe_grouped_gemm=true", "model.expert_model_parallel_size=2",
                      f"checkpoint.pretrained_checkpoint={base}", f"checkpoint.save={tmp_path}")
    assert result.returncode == 0, result.stderr[-3000:]
    assert losses(result.stdout) == pytest.approx(losses(sequential[0]), rel=1e-4)
    resumed = bridge("finetune", *RUN, "peft=lora", "train.train_iters=9", f"checkpoint.pretrained_checkpoint={base}",
                     f"checkpoint.save={tmp_path}", "scheduler.override_opt_param_scheduler=true")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"loaded LoRA adapters {tmp_path}/iter_0000008" in resumed.stdout
