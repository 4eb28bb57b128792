"""LoRA on tiny_moe: adapters on attention, every routed expert and the shared expert train from a
pretrained MoE checkpoint; grouped-GEMM experts are refused with the fix named."""

from __future__ import annotations

import pytest

from tests.conftest import bridge
from tests.integration.test_pretrain_cpu import losses

RUN = ["recipe=tiny_moe", "train.eval_iters=0", "logger.log_interval=1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    save = tmp_path_factory.mktemp("moe_base") / "ckpt"
    result = bridge("pretrain", *RUN, "train.train_iters=4", f"checkpoint.save={save}")
    assert result.returncode == 0, result.stderr[-3000:]
    return save


@pytest.mark.slow
def test_lora_on_moe_adapts_attention_routed_and_shared_experts(base, tmp_path):
    from torch.distributed.checkpoint import FileSystemReader

    save = tmp_path / "lora"
    result = bridge("finetune", *RUN, "peft=lora", "train.train_iters=8", f"checkpoint.pretrained_checkpoint={base}",
                    f"checkpoint.save={save}")
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert len(curve) == 8 and curve[-1] < curve[0], curve
    shapes = {k: tuple(v.size) for k, v in FileSystemReader(str(save / "iter_0000008")).read_metadata()
              .state_dict_metadata.items() if k.startswith("decoder.layers.1.") and hasattr(v, "size")}
    layer = "decoder.layers.1."
    assert shapes[layer + "mlp.experts.experts.linear_fc1.adapter.linear_out.weight"] == (8, 256, 32)  # 8 experts
    assert shapes[layer + "mlp.experts.experts.linear_fc2.adapter.linear_in.weight"] == (8, 32, 128)
    assert layer + "mlp.shared_experts.linear_fc1.adapter.linear_in.weight" in shapes
    assert layer + "self_attention.linear_qkv.adapter.linear_in.weight" in shapes
    assert not any("router" in k or ("adapter" not in k and "optimizer" not in k) for k in shapes), shapes


@pytest.mark.slow
def test_lora_refuses_grouped_gemm_experts(base):
    result = bridge("finetune", *RUN, "peft=lora", "train.train_iters=2", "model.moe_grouped_gemm=true",
                    f"checkpoint.pretrained_checkpoint={base}")
    assert result.returncode != 0
    assert "peft=lora cannot adapt the grouped-GEMM experts" in result.stderr + result.stdout
    assert "Traceback" not in result.stderr
