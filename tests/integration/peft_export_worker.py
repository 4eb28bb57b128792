"""Run by test_peft_export.py in its own process: the logits of bridge's LoRA model (the base plus its adapter
checkpoint, as training computes them) for fixed tokens.

    python tests/integration/peft_export_worker.py RECIPE ADAPTERS TOKENS OUT [OVERRIDE ...]

TOKENS and OUT are torch.save files: the token ids in, the fp32 logits out (vocabulary padding dropped).
OVERRIDEs are the LoRA run's peft settings.
"""

from __future__ import annotations

import sys

import torch

from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer


def main(recipe: str, adapters: str, tokens_file: str, out: str, *overrides: str) -> None:
    from bridge_cli.checkpoint.load import load_checkpoint
    from bridge_cli.training.pretrain import run_session
    from bridge_cli.training.setup import adapter_policy, build_model, initialize

    tokens = torch.load(tokens_file)
    cfg = ConfigContainer.from_yaml_dict(compose(recipe, [*overrides, f"checkpoint.load={adapters}"]))
    with run_session(cfg) as state:
        model = build_model(cfg, initialize(state))
        load_checkpoint(state, model, None, None, weights_only=True, adapters=adapter_policy(cfg))
        model[0].eval()
        with torch.no_grad():
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            logits = model[0](tokens, positions, None).float()
    torch.save(logits[..., : cfg.model.vocab_size].contiguous(), out)


if __name__ == "__main__":
    main(*sys.argv[1:])
