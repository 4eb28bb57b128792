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
    from lora_worker import logits  # beside this script: the LoRA model's logits as the merge test reads them

    tokens = torch.load(tokens_file)
    cfg = ConfigContainer.from_yaml_dict(compose(recipe, [*overrides, f"checkpoint.load={adapters}"]))
    torch.save(logits(cfg, tokens)[..., : cfg.model.vocab_size].contiguous(), out)


if __name__ == "__main__":
    main(*sys.argv[1:])
