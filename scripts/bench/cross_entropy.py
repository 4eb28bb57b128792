"""The language-model cross entropy on one GPU: megatron-core's fused one (``native``), compiled as
``model.compile_layers`` runs it, against bridge's two Triton kernels (``triton``), forward and backward.

    python scripts/bench/cross_entropy.py [--block 4096 --warps 8 ...]

At gpt2_124m's micro-batch (64 x 1024 tokens, vocabulary 50,304) and the 1.5B proxy's (4 x 4096 tokens,
128,256): ms per forward and backward, the GB/s that is (bf16 logits read by the forward, read and the
gradient written by the backward), the memory the loss holds from forward to backward, and the largest
loss difference between the two.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from gpu_timing import require_cuda, time_ms  # this folder's helper

if TYPE_CHECKING:
    import torch

SHAPES = {"gpt2_124m": (1024, 64, 50304), "1.5B proxy": (4096, 4, 128256)}


def native_loss():
    """megatron-core's compute_language_model_loss body with cross_entropy_fusion_impl=native, compiled."""
    import torch
    from megatron.core import parallel_state
    from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy

    group = parallel_state.get_tensor_model_parallel_group()

    def loss(labels, logits):
        return fused_vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(), group).transpose(0, 1)

    return torch.compile(loss, dynamic=False)


def measure(loss_fn, labels, logits, mask) -> tuple[float, float, torch.Tensor]:
    """ms for forward + backward, GiB held between them, and the losses."""
    import torch

    def step():
        (loss_fn(labels, logits) * mask).sum().backward()
        logits.grad = None

    ms = time_ms(step)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    losses = loss_fn(labels, logits)
    held = (torch.cuda.memory_allocated() - before) / 2**30
    return ms, held, losses.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--block", type=int, nargs="*", help="Triton block sizes to try (default: the kernel's)")
    parser.add_argument("--warps", type=int, nargs="*", help="Triton warp counts to try (default: the kernel's)")
    args = parser.parse_args()
    require_cuda("cross_entropy.py times the loss on a CUDA GPU")
    import torch

    from bridge_cli.models import cross_entropy
    from bridge_cli.runtime.distributed import init_distributed

    blocks, warps_tried = args.block or [cross_entropy.BLOCK], args.warps or [cross_entropy.WARPS]
    init_distributed("nccl", 10, 1, 1)
    print("| shape | loss | ms (forward + backward) | GB/s | held GiB | max loss difference |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for name, (seq, batch, vocab) in SHAPES.items():
        torch.manual_seed(0)
        logits = (torch.randn(seq, batch, vocab, device="cuda") * 3).to(torch.bfloat16).requires_grad_()
        labels = torch.randint(0, vocab, (batch, seq), device="cuda")
        mask = torch.ones(batch, seq, device="cuda")
        traffic = 3 * logits.numel() * logits.element_size()
        ms, held, reference = measure(native_loss(), labels, logits, mask)
        print(f"| {name} | native, compiled | {ms:.2f} | {traffic / ms / 1e6:,.0f} | {held:.2f} | |")
        for block in blocks:
            for warps in warps_tried:
                cross_entropy.BLOCK, cross_entropy.WARPS = block, warps
                # a new gradient tensor: the model's in-place one moves the same bytes but would overwrite this
                # benchmark's logits, which every step reuses
                ms, held, losses = measure(lambda lab, log: cross_entropy.language_model_loss(lab, log, None, False),
                                           labels, logits, mask)
                diff = (losses - reference).abs().max().item()
                print(f"| {name} | triton, block {block}, {warps} warps | {ms:.2f} | {traffic / ms / 1e6:,.0f} "
                      f"| {held:.2f} | {diff:.2e} |")


if __name__ == "__main__":
    main()
