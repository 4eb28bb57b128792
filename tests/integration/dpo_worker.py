"""Run by test_dpo.py in its own process: the two DPO references through the library API.

    python tests/integration/dpo_worker.py BASE DATA

REFERENCE: after two DPO steps of a peft=lora model (the adapters have moved), the per-token
log-probabilities of the model with its adapters off equal those of a frozen copy loaded from the
base checkpoint; the policy's differ from both.
"""

from __future__ import annotations

import sys

import torch

from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer


def main(base: str, data: str) -> None:
    from bridge_cli.training.dpo_step import DPOForwardStep, build_reference, pair_layout
    from bridge_cli.training.gpt_step import get_batch
    from bridge_cli.training.pretrain import run_session
    from bridge_cli.training.setup import setup
    from bridge_cli.training.train import train_step
    from bridge_cli.training.utils.train_utils import prepare_forward_step_func

    cfg = ConfigContainer.from_yaml_dict(compose("tiny_dpo", [
        "peft=lora", f"dataset.dataset_root={data}", f"checkpoint.pretrained_checkpoint={base}",
        "train.train_iters=3", "optimizer.lr=1e-2"]))
    with run_session(cfg) as state:
        out = setup(state)
        dpo = DPOForwardStep()
        step = prepare_forward_step_func(dpo, state)
        for _ in range(2):
            train_step(step, out.train_data_iterator, out.model, out.optimizer, out.scheduler, state)
        rows, _, _ = pair_layout(get_batch(out.train_data_iterator, state.runtime.device, use_mask=False))
        inputs, labels = (rows["tokens"], rows["position_ids"], None), rows["labels"]
        model = out.model[0]
        with torch.no_grad():
            adapters_off = dpo.reference_forward(state, model, inputs, labels, {})
            frozen_copy = build_reference(state)[0](*inputs, labels=labels)
            policy = model(*inputs, labels=labels)
    mask = rows["loss_mask"] > 0
    diff = (adapters_off - frozen_copy)[mask].abs().max().item()
    moved = (policy - frozen_copy)[mask].abs().max().item()
    print(f"REFERENCE max_diff={diff:.3e} policy_moved={moved:.3e}")


if __name__ == "__main__":
    main(*sys.argv[1:])
