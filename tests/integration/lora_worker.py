"""Run by test_finetune.py in its own process: LoRA through the library API.

    python tests/integration/lora_worker.py BASE DATA ADAPTERS MERGED

FROZEN: two optimizer steps of a peft=lora model; every base weight is bitwise what it was, the
adapters moved. LOGITS: the base plus the adapter checkpoint, and the merged checkpoint alone,
give the same logits.
"""

from __future__ import annotations

import sys

import torch

from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer

COMMON = ["tokenizer=byte_level", "model.seq_length=64", "train.micro_batch_size=8"]


def config(*overrides: str) -> ConfigContainer:
    return ConfigContainer.from_yaml_dict(compose("tiny", [*COMMON, *overrides]))


def frozen(base: str, data: str) -> None:
    from bridge_cli.peft.lora import is_adapter_key
    from bridge_cli.training.gpt_step import forward_step
    from bridge_cli.training.pretrain import run_session
    from bridge_cli.training.setup import setup
    from bridge_cli.training.train import train_step
    from bridge_cli.training.utils.train_utils import prepare_forward_step_func

    cfg = config("peft=lora", "dataset=finetune", f"dataset.dataset_root={data}",
                 f"checkpoint.pretrained_checkpoint={base}", "train.train_iters=2")
    with run_session(cfg) as state:
        out = setup(state)
        params = dict(out.model[0].module.named_parameters())
        before = {name: p.detach().clone() for name, p in params.items()}
        step = prepare_forward_step_func(forward_step, state)
        for _ in range(2):
            train_step(step, out.train_data_iterator, out.model, out.optimizer, out.scheduler, state)
        base_same = all(torch.equal(p, before[n]) for n, p in params.items() if not is_adapter_key(n))
        moved = sum(not torch.equal(p, before[n]) for n, p in params.items() if is_adapter_key(n))
        adapters = sum(is_adapter_key(n) for n in params)
        trainable = sorted({n for n, p in params.items() if p.requires_grad} ^ {n for n in params if is_adapter_key(n)})
    print(f"FROZEN base_unchanged={base_same} adapters_moved={moved}/{adapters} other_trainable={trainable}")


def logits(cfg: ConfigContainer, tokens: torch.Tensor) -> torch.Tensor:
    from bridge_cli.checkpoint.load import load_checkpoint
    from bridge_cli.training.pretrain import run_session
    from bridge_cli.training.setup import adapter_policy, build_model, initialize

    with run_session(cfg) as state:
        model = build_model(cfg, initialize(state))
        load_checkpoint(state, model, None, None, weights_only=True, adapters=adapter_policy(cfg))
        model[0].eval()
        with torch.no_grad():
            positions = torch.arange(tokens.shape[1]).expand_as(tokens)
            return model[0](tokens, positions, None).float()


def main(base: str, data: str, adapters: str, merged: str) -> None:
    frozen(base, data)
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with_adapters = logits(config("peft=lora", f"checkpoint.load={adapters}"), tokens)
    from_merged = logits(config(f"checkpoint.load={merged}"), tokens)
    from_base = logits(config(f"checkpoint.load={base}"), tokens)
    print(f"LOGITS max_diff={(with_adapters - from_merged).abs().max().item():.3e} "
          f"adapter_effect={(with_adapters - from_base).abs().max().item():.3e}")


if __name__ == "__main__":
    main(*sys.argv[1:])
