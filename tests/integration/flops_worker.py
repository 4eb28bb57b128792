"""Run by test_flops_measured.py in its own process: the FLOPs autograd runs on the tiny models, against bridge's
count (bridge_cli/models/flops.py).

    python tests/integration/flops_worker.py CASES_JSON

CASES_JSON: a list of [recipe, [override, ...], mode]; mode ``train`` is a forward and a backward of the summed
per-token loss, ``reference`` a forward without gradients with any LoRA adapters off (DPO's reference). Prints one
line ``FLOPS {"measured": [...], "counted": [...]}``, per token of one row of model.seq_length.

torch's FlopCounterMode counts every matmul; the CPU attention kernel it does not know is counted as bridge's
convention has it: the causal half of the score matrix (a GPU kernel skips the masked blocks), its backward twice
its forward (without the GPU kernel's recomputation of the scores), and only where autograd runs it.
"""

from __future__ import annotations

import contextlib
import json
import sys

import torch
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

from bridge_cli.config.compose import compose
from bridge_cli.models.flops import forward_flops, training_flops
from bridge_cli.training.config import ConfigContainer


def _attention(query, key, value, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query, key, value) // 2


def _attention_backward(grad, query, key, value, *args, out_shape=None, **kwargs) -> int:
    return 2 * _attention(query, key, value)


ATTENTION = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu: _attention,
             torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward: _attention_backward}


def measure(recipe: str, overrides: list[str], mode: str) -> tuple[float, float]:
    from bridge_cli.peft.adapters_off import adapted_layers, adapters_off
    from bridge_cli.training.pretrain import run_session
    from bridge_cli.training.setup import build_model, initialize

    cfg = ConfigContainer.from_yaml_dict(compose(recipe, ["tokenizer=byte_level", *overrides]))
    with run_session(cfg) as state:
        model = build_model(cfg, initialize(state))[0]
        seq = cfg.derived.model.seq_length
        tokens = torch.randint(0, 256, (1, seq), generator=torch.Generator().manual_seed(0))
        positions = torch.arange(seq).view(1, -1)
        with FlopCounterMode(display=False, custom_mapping=ATTENTION) as counter:
            if mode == "train":
                model(tokens, positions, None, labels=tokens).float().sum().backward()
            else:
                with torch.no_grad(), adapters_off(adapted_layers(model)) if cfg.peft else contextlib.nullcontext():
                    model(tokens, positions, None, labels=tokens)
        counted = training_flops(cfg.derived.model, cfg.peft) if mode == "train" else forward_flops(cfg.derived.model)
        return counter.get_total_flops() / seq, counted / seq


def main(cases: str) -> None:
    results = [measure(*case) for case in json.loads(cases)]
    print("FLOPS " + json.dumps({"measured": [m for m, _ in results], "counted": [c for _, c in results]}))


if __name__ == "__main__":
    main(*sys.argv[1:])
