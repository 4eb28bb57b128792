"""FP8 linear layers against bf16 on the 1.5B proxy's GEMM shapes, forward + backward, one GPU.

    python scripts/bench/fp8_gemms.py [--tokens 4096] [--compile]

For each linear of a proxy layer (qkv, attention output, fc1, fc2 at hidden 2048, GQA 32/8,
FFN 8192) times ``fp8_linear`` (bridge_cli.models.fp8_linear, both recipes, casts included) and
``F.linear`` in bf16 over the same input and output gradient, and prints TFLOP/s (3 GEMMs of
2 x tokens x in x out FLOPs each) and the speed-up over bf16. ``--compile`` wraps each in
torch.compile, as ``model.compile_layers=true`` does for a whole layer.
"""

from __future__ import annotations

import argparse

from gpu_timing import require_cuda, time_ms  # this folder's helper

SHAPES = {"qkv": (2048, 3072), "proj": (2048, 2048), "fc1": (2048, 16384), "fc2": (8192, 2048)}



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--compile", action="store_true")
    args = parser.parse_args()
    require_cuda("fp8_gemms.py times FP8 and bf16 GEMMs on a CUDA GPU")
    import torch
    import torch.nn.functional as F

    from bridge_cli.models.fp8_linear import Fp8Scaling, fp8_linear

    linears = {"bf16": lambda x, w: F.linear(x, w),
               "fp8 tensorwise": lambda x, w: fp8_linear(x, w, None, Fp8Scaling("tensorwise", torch.float8_e5m2)),
               "fp8 rowwise": lambda x, w: fp8_linear(x, w, None, Fp8Scaling("rowwise", torch.float8_e4m3fn))}
    if args.compile:
        linears = {name: torch.compile(fn) for name, fn in linears.items()}
    print(f"{'linear':<6} {'in x out':>12} " + " ".join(f"{name + ' TF/s':>20}" for name in linears) + "  speed-up")
    total = dict.fromkeys(linears, 0.0)
    for layer, (d_in, d_out) in SHAPES.items():
        x = torch.randn(args.tokens, d_in, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = (torch.randn(d_out, d_in, device="cuda", dtype=torch.bfloat16) * 0.02).requires_grad_()
        grad = torch.randn(args.tokens, d_out, device="cuda", dtype=torch.bfloat16)
        flops = 3 * 2 * args.tokens * d_in * d_out
        ms = {name: time_ms(lambda fn=fn: fn(x, w).backward(grad)) for name, fn in linears.items()}
        for name in ms:
            total[name] += ms[name]
        speedups = " ".join(f"{ms['bf16'] / ms[name]:.2f}x" for name in list(ms)[1:])
        print(f"{layer:<6} {f'{d_in}x{d_out}':>12} " + " ".join(f"{flops / ms[n] / 1e9:>20.0f}" for n in ms)
              + f"  {speedups}")
    print("layer total ms: " + ", ".join(f"{name} {t:.2f}" for name, t in total.items()))


if __name__ == "__main__":
    main()
