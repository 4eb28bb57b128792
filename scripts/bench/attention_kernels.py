"""The torch spec's attention kernels alone, on one GPU: causal SDPA against masked FlexAttention.

    python scripts/bench/attention_kernels.py [--documents 8] [--seq 4096] [--batch 2] [--window 0]

At the 1.5B proxy's attention shape (32 query heads, 8 key/value groups, head size 64, bf16),
prints forward+backward ms of the causal path (today's SDPA call), of the masked path on rows of
N documents (FlexAttention with a block mask, optionally a sliding window), and the time to build
one micro-batch's block mask (host and GPU), which the training step pays once per micro-batch.
"""

from __future__ import annotations

import argparse
import time

from gpu_timing import require_cuda  # this folder's helper


def timed_ms(fn, iters: int = 20) -> float:
    import torch

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / iters * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--documents", type=int, default=8)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--window", type=int, default=0, help="sliding window (keys before the query); 0: none")
    args = parser.parse_args()
    require_cuda("attention_kernels.py times attention kernels on a CUDA GPU")
    import torch

    from bridge_cli.models.attention import kernels
    from bridge_cli.models.attention.masks import block_mask

    b, s, window = args.batch, args.seq, args.window or None
    q = torch.randn(b, 32, s, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(b, 8, s, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    documents = (torch.arange(s, device="cuda") * args.documents // s).to(torch.int32).expand(b, s).contiguous()

    def causal():
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        out.sum().backward()

    mask = block_mask(documents, window, s, "cuda")

    def masked():
        kernels.flex(q, k, v, mask, 0.125, None).sum().backward()

    host_ms = []

    def build():
        start = time.perf_counter()
        block_mask(documents, window, s, "cuda")
        host_ms.append((time.perf_counter() - start) * 1000)

    causal_ms, masked_ms, build_ms = timed_ms(causal), timed_ms(masked), timed_ms(build)
    print(f"shape: batch {b} x 32 heads (8 groups) x seq {s} x 64, bf16; {args.documents} documents per row"
          + (f", window {window}" if window else ""))
    print(f"causal SDPA fwd+bwd      {causal_ms:8.2f} ms")
    print(f"masked flex fwd+bwd      {masked_ms:8.2f} ms  ({causal_ms / masked_ms:.2f}x causal speed)")
    print(f"block mask per batch     {build_ms:8.2f} ms  (host {sorted(host_ms)[len(host_ms) // 2]:.2f} ms)")


if __name__ == "__main__":
    main()
