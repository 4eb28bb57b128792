"""Logits of bridge checkpoints under given tensor- and expert-parallel sizes; run alone or under torchrun.

Used by test_convert_hf.py. For each ``--tp`` size (experts split as the attention is, biased ones
not), each ``--ep`` size (at TP=1, mixture-of-experts checkpoints only) and each ``--ckpt NAME=DIR``,
the model of the checkpoint's run_config.yaml is built for that layout, the checkpoint is loaded
into it (megatron-core reshards it), and rank 0 writes the logits of the tokens in ``--tokens`` over
the real vocabulary (padding rows dropped) to ``OUT/NAME_tp<N>.pt`` (``OUT/NAME_ep<N>.pt``), and those of a model's
multi-token-prediction layers, stacked, to ``OUT/mtp/NAME_tp<N>.pt``. With ``--resave``, each checkpoint loaded at the
largest TP size, and each loaded at an EP size, is saved again under ``OUT/NAME_tp<N>_saved``
(``_ep<N>_saved``) in that layout (its tensors split across the ranks), for export to read back.
One launch serves every checkpoint, since starting the processes costs far more than the models.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from bridge_cli.checkpoint import layout
from bridge_cli.checkpoint.save import RUN_CONFIG
from bridge_cli.convert import mcore_io


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt", nargs="+", required=True, help="NAME=DIR, repeated")
    parser.add_argument("--tokens", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tp", type=int, nargs="+", default=[1])
    parser.add_argument("--ep", type=int, nargs="*", default=[])
    parser.add_argument("--resave", action="store_true")
    args = parser.parse_args()

    tokens = torch.load(args.tokens)
    checkpoints = {name: layout.require_checkpoint(Path(folder)).path
                   for name, folder in (item.split("=", 1) for item in args.ckpt)}
    values = {name: mcore_io.saved_model_values(path) for name, path in checkpoints.items()}  # read once
    for tp in args.tp:
        for etp in sorted({expert_tp(values[name], tp) for name in checkpoints}):
            mcore_io.init_process(tp, expert_tensor_parallel_size=etp)
            for name, path in checkpoints.items():
                if expert_tp(values[name], tp) == etp:
                    run(name, path, values[name], tokens, args.out, f"tp{tp}", args.resave and tp == max(args.tp),
                        tensor_model_parallel_size=tp, expert_tensor_parallel_size=etp)
    for ep in args.ep:
        mcore_io.init_process(1, ep)
        for name, path in checkpoints.items():
            if values[name].get("num_moe_experts"):
                run(name, path, values[name], tokens, args.out, f"ep{ep}", args.resave, expert_model_parallel_size=ep)
    dist.barrier()


def expert_tp(model: dict, tp: int) -> int:
    """The expert tensor-parallel size to load a checkpoint of ``model`` (its saved model values) at under TP
    ``tp``: the same, but 1 for experts with biases (GPT-OSS), which megatron-core computes at expert TP 1 only."""
    return 1 if model.get("num_moe_experts") and model.get("add_bias_linear") else tp


def run(name: str, path: Path, model_values: dict, tokens: torch.Tensor, out: Path, layout_name: str,
        resave_it: bool, **sizes) -> None:
    """Load checkpoint ``path`` (of ``model_values``) under the parallel ``sizes``; write its logits (and, with
    ``resave_it``, the checkpoint in that layout)."""
    # parallel_output=False gathers the vocabulary shards of the logits onto every rank
    config = mcore_io.model_config(model_values, parallel_output=False, **sizes)
    model = mcore_io.build_model(config)
    mcore_io.load_weights(model, config, path)
    model.eval()
    with torch.no_grad():
        if config.mtp_num_layers:
            logits, *mtp = logits_with_mtp(model, tokens)
        else:
            logits, mtp = model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None), []
    if dist.get_rank() == 0:
        torch.save(logits[..., : config.vocab_size].clone(), out / f"{name}_{layout_name}.pt")
        if mtp:
            (out / "mtp").mkdir(exist_ok=True)
            torch.save(torch.stack(mtp)[..., : config.vocab_size].clone(), out / "mtp" / f"{name}_{layout_name}.pt")
    if resave_it:
        resave(model, path, out / f"{name}_{layout_name}_saved")


def logits_with_mtp(model, tokens: torch.Tensor) -> list[torch.Tensor]:
    """The logits of a model with multi-token-prediction layers, then those of each MTP layer ([batch, seq, vocab]
    each). megatron-core's forward turns the MTP layers' logits into their loss and needs labels for it, so the
    hidden states come from the MTP block's output (the model's, then each layer's, along the sequence axis)."""
    captured = []
    handle = model.mtp.register_forward_hook(lambda module, args, output: captured.append(output))
    model(tokens, torch.arange(tokens.shape[1]).expand_as(tokens), None, labels=tokens)
    handle.remove()
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    return [model.output_layer(hidden, weight=weight)[0].transpose(0, 1)
            for hidden in captured[0].chunk(1 + model.config.mtp_num_layers, dim=0)]


def resave(model, path: Path, root: Path) -> None:
    """``model``'s weights as iteration 0 of ``root``, each rank writing its part, with ``path``'s run_config."""
    from megatron.core import dist_checkpointing

    folder = root / "iter_0000000"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True)
        shutil.copy(path / RUN_CONFIG, folder / RUN_CONFIG)
        layout.write_tracker(root, 0)
    dist.barrier()
    dist_checkpointing.save({"model": model.sharded_state_dict()}, str(folder))


if __name__ == "__main__":
    main()
