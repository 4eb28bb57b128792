"""An imported Gemma 3 trains on the GPU in bf16: FlexAttention with a window in one layer and none in the
other, per-document masks, post-sublayer and 1 + w norms and the two RoPE tables inside compiled layers."""

from __future__ import annotations

import math

import pytest

from tests.conftest import bridge
from tests.integration.test_convert_hf import hf_model
from tests.integration.test_pretrain_cpu import losses

pytestmark = pytest.mark.gpu


def test_imported_gemma3_trains_in_bf16_with_compiled_layers(tmp_path):
    hf_model("gemma3_text").save_pretrained(tmp_path / "hf")
    result = bridge("convert-ckpt", "import-hf", str(tmp_path / "hf"), str(tmp_path / "mcore"))
    assert result.returncode == 0, result.stderr[-3000:]
    result = bridge("pretrain", f"recipe={tmp_path / 'mcore' / 'recipe.yaml'}", "mixed_precision=bf16_mixed",
                    "model.compile_layers=true", "dataset.reset_attention_mask=true", "dataset.reset_position_ids=true",
                    "train.train_iters=20", "train.eval_iters=0", "logger.log_interval=5")
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert len(curve) == 4 and all(math.isfinite(loss) for loss in curve), curve
    assert curve[-1] < 0.6 * curve[0], curve
