"""Whole models with the torch spec's attention: exact packed SFT, and sliding windows as Mistral's.

Each check runs attention_worker.py in a process of its own (megatron-core's process groups).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.conftest import bridge, python

WORKER = Path(__file__).with_name("attention_worker.py")


def worker(*args: str) -> dict:
    result = python(str(WORKER), *args, env={"OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.strip().splitlines()[-1])


@pytest.mark.slow
@pytest.mark.parametrize("window", [0, 4])
def test_packed_sft_row_equals_its_samples_one_by_one(window):
    """fp32: each token's loss, and the gradients of the summed answer loss, of four samples packed into
    one row equal those of the samples run alone (with a window of 4 on every other layer too)."""
    measured = worker("packed", "--window", str(window))
    assert measured["tokens"] == 39
    assert measured["loss_diff"] < 1e-5, measured
    assert measured["grad_diff"] < 1e-5, measured
    # the same row without document masks (what packing computed before) is far off: the check can fail
    assert measured["crossing_loss_diff"] > 1e-2, measured


@pytest.mark.slow
def test_sliding_window_matches_transformers_mistral(tmp_path):
    """A Mistral whose sliding window (6) is shorter than its input (24 tokens), imported with
    `bridge convert-ckpt import-hf`: megatron-core with window_size=(5, 0) gives transformers' logits;
    without the window it does not."""
    transformers = pytest.importorskip("transformers")
    config = transformers.MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                        sliding_window=6, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.MistralForCausalLM(config).float()
    with torch.no_grad():  # larger than the default init, so that attention differences show in the logits
        for name, param in model.named_parameters():
            param.uniform_(0.5, 1.5) if "norm" in name else param.normal_(0.0, 0.1)
    model.save_pretrained(tmp_path / "hf")
    result = bridge("convert-ckpt", "import-hf", str(tmp_path / "hf"), str(tmp_path / "mcore"))
    assert result.returncode == 0, result.stderr[-4000:]
    measured = worker("mistral", "--hf", str(tmp_path / "hf"), "--ckpt", str(tmp_path / "mcore"), "--seq", "24")
    assert measured["windowed_diff"] < 1e-4, measured
    assert measured["full_diff"] > 1e-2, measured
