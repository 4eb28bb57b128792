"""Whole-model attention checks in a process of its own (megatron-core needs its process groups).

Used by test_attention_models.py; prints one JSON object of measured differences.

``packed``   a tiny fp32 Llama-style model on one packed SFT row (bridge's own packing and training
             step inputs) against the same samples run one by one: per-token losses and gradients.
``mistral``  a Mistral checkpoint imported by ``bridge convert-ckpt import-hf``, built with a sliding
             window shorter than the tokens, against transformers' logits of the same model.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from bridge_cli.checkpoint import layout
from bridge_cli.convert import mcore_io


def per_token_loss(model, tokens, labels, **kwargs) -> torch.Tensor:
    positions = kwargs.pop("position_ids", torch.arange(tokens.shape[1]).expand_as(tokens))
    return model(tokens, positions, None, labels=labels, **kwargs)


def packed(args) -> dict:
    from bridge_cli.data.sft import Sample, SFTDataset, pack_rows, sample_row
    from bridge_cli.models.attention.masks import batch_document_params

    config = mcore_io.model_config(dict(num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4,
                                        num_query_groups=2, vocab_size=256, seq_length=48,
                                        position_embedding_type="rope", normalization="RMSNorm",
                                        gated_linear_unit=True, activation_func="silu", add_bias_linear=False,
                                        attention_dropout=0.0, hidden_dropout=0.0,
                                        share_embeddings_and_output_weights=False,
                                        **({"window_size": [args.window - 1, 0], "window_attn_skip_freq": 2}
                                           if args.window else {})),
                                   perform_initialization=True)
    torch.manual_seed(0)
    model = mcore_io.build_model(config)
    generator = torch.Generator().manual_seed(1)
    samples = []
    for length in (9, 17, 5, 12):
        ids = torch.randint(0, 256, (length,), generator=generator).tolist()
        samples.append(Sample(ids, [i >= length // 3 for i in range(length)]))  # the last two thirds are answers
    rows = [sample_row(s) for s in samples]
    batch = SFTDataset(pack_rows(rows, 48), 48, 0, 1, None, packed=True)[0]
    batch = {key: value.unsqueeze(0) for key, value in batch.items()}

    def packed_losses(documents: bool):
        model.zero_grad()
        extra = {"packed_seq_params": batch_document_params(config, batch["document_ids"], batch["position_ids"])} \
            if documents else {}
        losses = per_token_loss(model, batch["tokens"], batch["labels"], position_ids=batch["position_ids"], **extra)
        (losses * batch["loss_mask"]).sum().backward()
        return losses.detach()[0], {n: p.grad.clone() for n, p in model.named_parameters()}

    losses, grads = packed_losses(documents=True)
    model.zero_grad()
    alone_losses = []
    for row in rows:
        tokens, labels = torch.tensor([row.tokens]), torch.tensor([row.labels])
        loss = per_token_loss(model, tokens, labels)
        (loss * torch.tensor([row.loss_mask])).sum().backward()
        alone_losses.append(loss.detach()[0])
    alone_losses = torch.cat(alone_losses)
    alone_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    crossing_losses, _ = packed_losses(documents=False)  # what packing computed before documents were masked
    real = len(alone_losses)
    return {
        "tokens": real,
        "loss_diff": (losses[:real] - alone_losses).abs().max().item(),
        "grad_diff": max((grads[n] - alone_grads[n]).abs().max().item() for n in grads),
        "grad_scale": max(g.abs().max().item() for g in alone_grads.values()),
        "crossing_loss_diff": (crossing_losses[:real] - alone_losses).abs().max().item(),
    }


def mistral(args) -> dict:
    import transformers

    hf = transformers.MistralForCausalLM.from_pretrained(args.hf, torch_dtype=torch.float32).eval()
    window = hf.config.sliding_window
    tokens = torch.randint(0, hf.config.vocab_size, (2, args.seq), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = hf(tokens).logits
    path = layout.require_checkpoint(args.ckpt).path
    values = mcore_io.saved_model_values(path)
    results = {"window": window}
    for name, overrides in {"windowed": {"window_size": [window - 1, 0]}, "full": {"window_size": None}}.items():
        config = mcore_io.model_config(values, seq_length=args.seq, **overrides)
        model = mcore_io.build_model(config)
        mcore_io.load_weights(model, config, path)
        model.eval()
        with torch.no_grad():
            logits = model(tokens, torch.arange(args.seq).expand_as(tokens), None)[..., : hf.config.vocab_size]
        results[f"{name}_diff"] = (logits - expected).abs().max().item()
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("check", choices=["packed", "mistral"])
    parser.add_argument("--window", type=int, default=0, help="packed: sliding window of every other layer")
    parser.add_argument("--hf", type=Path, help="mistral: the Hugging Face folder")
    parser.add_argument("--ckpt", type=Path, help="mistral: its import")
    parser.add_argument("--seq", type=int, default=24, help="mistral: tokens per row")
    args = parser.parse_args()
    mcore_io.init_process(1)
    torch.use_deterministic_algorithms(True)
    print(json.dumps({"packed": packed, "mistral": mistral}[args.check](args)))


if __name__ == "__main__":
    main()
