"""One Adam step over the 1.5B proxy's weights on one GPU: torch's fused AdamW (with the clip coefficient as its
``grad_scale``) followed by megatron-core's copy of every fp32 main weight into its bf16 model weight, against
bridge's Triton kernel (``optimizer.adam_kernel=triton``), which writes the model weight in the same pass.

    python scripts/bench/adam_step.py [--steps 10]

Prints ms a step for each and the bytes a second that is, and checks that the Triton step's model weights are its
fp32 weights rounded to bf16.
"""

from __future__ import annotations

import argparse

from gpu_timing import require_cuda, time_ms  # this folder's helper

LR, BETAS, EPS, WEIGHT_DECAY, CLIP = 3e-4, (0.9, 0.95), 1e-8, 0.1, 0.8


def proxy_shapes() -> list[tuple[int, ...]]:
    """The 1.5B proxy's weights: untied embedding and output layer, 16 layers of QKV, projection, fc1, fc2, norms."""
    layer = [(2048,), (3072, 2048), (2048, 2048), (2048,), (16384, 2048), (2048, 8192)]
    return [(128256, 2048), *(layer * 16), (2048,), (128256, 2048)]



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    require_cuda("adam_step.py times Adam steps on a CUDA GPU")
    import torch

    from bridge_cli.runtime.triton_adam import adam_update

    torch.manual_seed(0)
    weights = [torch.nn.Parameter(torch.randn(shape, device="cuda").view(-1) * 0.02) for shape in proxy_shapes()]
    for w in weights:
        w.grad = torch.randn_like(w) * 1e-3
    model = [torch.empty_like(w, dtype=torch.bfloat16) for w in weights]
    count = sum(w.numel() for w in weights)

    fused = torch.optim.AdamW(weights, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY, fused=True)
    grad_scale = torch.tensor(1 / CLIP, device="cuda")

    def torch_step():
        fused.grad_scale = grad_scale
        fused.step()
        for m, w in zip(model, weights):
            m.copy_(w)

    torch_ms = time_ms(torch_step, args.steps)
    del fused
    moments = [(torch.zeros_like(w), torch.zeros_like(w)) for w in weights]

    def triton_step():
        for w, m, (exp_avg, exp_avg_sq) in zip(weights, model, moments):
            adam_update(w.data, w.grad, exp_avg, exp_avg_sq, m, step=5, lr=LR, betas=BETAS, eps=EPS,
                        weight_decay=WEIGHT_DECAY, decoupled=True, grad_factor=CLIP)

    triton_ms = time_ms(triton_step, args.steps)
    assert all(torch.equal(m, w.detach().to(torch.bfloat16)) for m, w in zip(model, weights))
    print(f"{count / 1e9:.3f}e9 weights")
    for name, ms, bytes_per_weight in (("torch fused AdamW (grad_scale) + copy to bf16", torch_ms, 38),
                                       ("bridge's Triton step, bf16 weight included", triton_ms, 30)):
        print(f"{name + ':':<47} {ms:6.2f} ms ({count * bytes_per_weight / ms / 1e9:.2f} TB/s)")


if __name__ == "__main__":
    main()
