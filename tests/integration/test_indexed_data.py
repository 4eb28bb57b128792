"""Training on megatron-core indexed datasets (.bin/.idx) given as dataset.blend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import bridge
from tests.integration.test_pretrain_cpu import losses

pytestmark = pytest.mark.slow


def write_indexed_dataset(prefix: str, documents: int, seed: int, vocab: int = 1000) -> None:
    """Documents of a learnable pattern (each token = previous + step, mod vocab), end-of-document last."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    rng = np.random.default_rng(seed)
    builder = IndexedDatasetBuilder(prefix + ".bin", dtype=np.int32)
    for _ in range(documents):
        length, start, step = rng.integers(50, 300), rng.integers(0, vocab - 1), rng.integers(1, 4)
        tokens = (start + step * np.arange(length)) % (vocab - 1)
        builder.add_item(torch.from_numpy(np.append(tokens, vocab - 1).astype(np.int32)))
        builder.end_document()
    builder.finalize(prefix + ".idx")


@pytest.fixture(scope="module")
def corpora(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    prefixes = [str(root / "a"), str(root / "b")]
    for seed, prefix in enumerate(prefixes):
        write_indexed_dataset(prefix, documents=400, seed=seed)
    return prefixes


def test_pretrain_on_a_weighted_blend_of_indexed_datasets(corpora, tmp_path):
    a, b = corpora
    result = bridge("pretrain", "recipe=tiny", "dataset=gpt", f"dataset.blend=[{a},0.7,{b},0.3]",
                    "model.vocab_size=1000", "train.train_iters=40", "logger.log_interval=5",
                    "train.eval_interval=20", f"dataset.path_to_cache={tmp_path}/cache", "dataset.split='90,8,2'")
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert curve[-1] < 0.7 * curve[0], curve
    assert "validation at iteration 20" in result.stdout
    assert any((tmp_path / "cache").rglob("*.npy")), "megatron-core should cache its sample indices"


def test_megatron_weight_first_order_and_cyclic_loader(corpora):
    a, b = corpora
    result = bridge("pretrain", "recipe=tiny", "dataset=gpt", f"dataset.blend=[1,{a},1,{b}]", "model.vocab_size=1000",
                    "train.train_iters=10", "logger.log_interval=5", "dataset.dataloader_type=cyclic",
                    "train.eval_iters=0")
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(losses(result.stdout)) == 2


def test_a_split_without_documents_is_an_error_not_a_hang(corpora):
    a, _ = corpora
    result = bridge("pretrain", "recipe=tiny", "dataset=gpt", f"dataset.blend=[{a}]", "model.vocab_size=1000",
                    "train.train_iters=10", timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "dataset.split: the test split (969,30,1) gets none of the 400 documents" in result.stderr
