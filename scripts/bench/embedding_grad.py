"""The word embedding's weight gradient into its fp32 ``main_grad`` on one GPU, for one micro-batch of the 1.5B proxy
(4 x 4096 tokens, a 128,256 x 2,048 table): the dense bf16 gradient megatron-core's lookup writes plus the
data-parallel wrapper's add, against the rows added in place (``index_put_`` with accumulation, and ``index_add_``,
which ``model.gradient_accumulation_fusion`` uses), on mock-data tokens and on Zipf-distributed ones.

    python scripts/bench/embedding_grad.py
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

import numpy as np

from gpu_timing import require_cuda, time_ms  # this folder's helper

if TYPE_CHECKING:
    import torch

VOCAB, HIDDEN, BATCH, SEQ = 128256, 2048, 4, 4096


def mock_tokens() -> torch.Tensor:
    """megatron-core's mock documents: 1, 2, ..., length - 1, then end-of-document, random lengths."""
    import torch

    rng, rows = np.random.default_rng(0), []
    while sum(len(r) for r in rows) < BATCH * SEQ:
        n = int(rng.integers(1, SEQ))
        rows.append(np.concatenate([(np.arange(n - 1) + 1) % VOCAB, [0]]))
    return torch.tensor(np.concatenate(rows)[: BATCH * SEQ], device="cuda").view(BATCH, SEQ)


def zipf_tokens() -> torch.Tensor:
    import torch

    rng = np.random.default_rng(0)
    return torch.tensor(np.minimum(rng.zipf(1.2, BATCH * SEQ), VOCAB - 1), device="cuda").view(BATCH, SEQ)



def main() -> None:
    argparse.ArgumentParser(description=__doc__.split("\n\n")[0]).parse_args()
    require_cuda("embedding_grad.py times the embedding's gradient on a CUDA GPU")
    import torch

    main_grad = torch.zeros(VOCAB, HIDDEN, device="cuda")
    grad = torch.randn(BATCH, SEQ, HIDDEN, device="cuda", dtype=torch.bfloat16)
    rows = grad.reshape(-1, HIDDEN)
    for name, tokens in (("mock", mock_tokens()), ("zipf", zipf_tokens())):
        flat = tokens.reshape(-1)
        ways = {
            "dense gradient + add": lambda: main_grad.add_(
                torch.ops.aten.embedding_dense_backward(grad, tokens, VOCAB, -1, False)),
            "index_put_": lambda: main_grad.index_put_((flat,), rows.float(), accumulate=True),
            "index_add_": lambda: main_grad.index_add_(0, flat, rows.float()),
        }
        print(f"{name} tokens ({flat.unique().numel()} distinct): "
              + ", ".join(f"{way} {time_ms(fn):.3f} ms" for way, fn in ways.items()))


if __name__ == "__main__":
    main()
