"""`bridge convert-ckpt` streams: its peak memory grows with a layer, not with the model.

A Llama of 134M parameters (537 MB in fp32, layers much larger than its embedding) is imported and
exported, and so is a tiny one; the difference of their peak memory (PSS of the process tree, as
scripts/bench/convert_memory.py measures it) is what the model's size adds. Holding the model twice
on import, or once on export, exceeds the bounds.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from scripts.bench.convert_memory import peak_memory

transformers = pytest.importorskip("transformers")

LARGE = dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=8, num_attention_heads=8, vocab_size=4096)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4, vocab_size=4096)


def saved(folder: Path, shape: dict) -> int:
    """A random fp32 Llama of ``shape`` saved in ``folder``; returns its size in bytes."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**shape, tie_word_embeddings=False))
    model.save_pretrained(folder)
    return sum(p.numel() * p.element_size() for p in model.parameters())


def peaks(tmp_path: Path, name: str, shape: dict) -> tuple[int, float, float]:
    """(model bytes, import peak, export peak) in bytes."""
    hf, ckpt, out = tmp_path / f"hf_{name}", tmp_path / f"mcore_{name}", tmp_path / f"out_{name}"
    size = saved(hf, shape)
    _, imported, _ = peak_memory("convert-ckpt", "import-hf", str(hf), str(ckpt))
    _, exported, _ = peak_memory("convert-ckpt", "export-hf", str(ckpt), str(out), "--max-shard-size", "50MB")
    return size, imported * 1e9, exported * 1e9


@pytest.mark.slow
def test_conversion_memory_grows_with_a_layer_not_the_model(tmp_path):
    size, imported, exported = peaks(tmp_path, "large", LARGE)
    _, base_import, base_export = peaks(tmp_path, "tiny", TINY)
    # export: a decoder layer (67 MB) read and converted plus one 50 MB shard, 0.40 to 0.47x alone and 0.505x once
    # in the suite (2026-11-26); holding the model, it was 1.47x
    assert exported - base_export < 0.75 * size, (exported, base_export, size)
    # import: the model once (megatron-core's writer needs it whole, and its workers add about half),
    # about 1.55x, up to 1.86x when a sample falls while the writer's workers hold pages of their own
    # (two runs of 2026-11-26); with the Hugging Face files held too it was 2.48x
    assert imported - base_import < 2.1 * size, (imported, base_import, size)
