"""Expert weight gradients on one GPU: ``torch._grouped_mm`` plus the data-parallel wrapper's add into
``main_grad`` (what autograd and megatron-core do without the fusion) against
``bridge_cli.models.grouped_wgrad.accumulate`` (one kernel), at the MoE proxy's expert shapes.

    python scripts/bench/grouped_wgrad.py [--tokens 65536] [--experts 64]

Prints ms per call and TFLOP/s for fc1 and fc2 of one layer, each Triton tile configuration tried,
and the largest difference from a float64 reference.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from gpu_timing import require_cuda, time_ms  # this folder's helper

if TYPE_CHECKING:
    import torch

CONFIGS = [(128, 128, 64, 4, 4), (128, 128, 32, 4, 4), (128, 128, 32, 4, 5), (128, 128, 32, 8, 4),
           (128, 256, 32, 8, 4), (256, 128, 32, 8, 4), (128, 64, 32, 4, 4), (64, 128, 32, 4, 4),
           (128, 128, 16, 4, 6), (256, 256, 32, 8, 3)]


def routed_ends(tokens: int, experts: int) -> torch.Tensor:
    """Uneven token counts per expert (as a router gives), a few experts empty."""
    import torch

    weights = torch.rand(experts) + 0.5
    weights[:2] = 0
    counts = torch.distributions.Multinomial(tokens, weights / weights.sum()).sample().long()
    return torch.cumsum(counts, 0).to(device="cuda", dtype=torch.int32)


def check(experts: int = 8, out_features: int = 256, in_features: int = 384, tokens: int = 3001) -> float:
    import torch

    from bridge_cli.models import grouped_wgrad

    ends = routed_ends(tokens, experts)
    dy = torch.randn(tokens, out_features, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(tokens, in_features, device="cuda", dtype=torch.bfloat16)
    main_grad = torch.randn(experts, out_features, in_features, device="cuda")
    expected = main_grad.double().clone()
    bounds = [0] + ends.tolist()
    for e in range(experts):
        expected[e] += dy[bounds[e]:bounds[e + 1]].double().t() @ x[bounds[e]:bounds[e + 1]].double()
    grouped_wgrad.accumulate(dy, x, ends, main_grad)
    return ((main_grad.double() - expected).abs().max() / expected.abs().max()).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=65536, help="routed tokens a micro-batch (2 x 4096 x top-8)")
    parser.add_argument("--experts", type=int, default=64)
    args = parser.parse_args()
    require_cuda("grouped_wgrad.py times expert weight gradients on a CUDA GPU")
    import torch

    from bridge_cli.models import grouped_wgrad

    print(f"relative error against float64: {check():.2e}")
    rows = []
    for name, out_features, in_features in (("fc1", 1536, 2048), ("fc2", 2048, 768)):
        ends = routed_ends(args.tokens, args.experts)
        dy = torch.randn(args.tokens, out_features, device="cuda", dtype=torch.bfloat16)
        x = torch.randn(args.tokens, in_features, device="cuda", dtype=torch.bfloat16)
        main_grad = torch.zeros(args.experts, out_features, in_features, device="cuda")
        flops = 2 * args.tokens * out_features * in_features

        def grouped_mm_only():
            return torch._grouped_mm(x.t(), dy, offs=ends)

        def grouped_mm_and_add():
            # autograd lays the weight's gradient out like the weight (a copy), then DDP adds it
            main_grad.add_(torch._grouped_mm(x.t(), dy, offs=ends).transpose(1, 2).contiguous())

        for label, fn in (("grouped_mm (bf16 out)", grouped_mm_only), ("grouped_mm + copy + add", grouped_mm_and_add)):
            ms = time_ms(fn)
            rows.append((name, label, ms, flops / ms / 1e9))
        for config in CONFIGS:
            try:
                ms = time_ms(lambda: grouped_wgrad.accumulate(dy, x, ends, main_grad, config))
            except Exception as error:  # a tile that does not fit the shared memory
                print(f"{name} {config}: {type(error).__name__}")
                continue
            rows.append((name, f"triton {config}", ms, flops / ms / 1e9))
    print("| proj | kernel | ms | TFLOP/s |\n| --- | --- | ---: | ---: |")
    for name, label, ms, tflops in rows:
        print(f"| {name} | {label} | {ms:.3f} | {tflops:.0f} |")


if __name__ == "__main__":
    main()
