"""The forward step of ``finetune.objective=dpo``: a micro-batch of whole preference pairs through the
reference model (no gradient) and the policy, and the DPO loss of :mod:`bridge_cli.training.dpo_loss`.

The reference is the model training started from: with ``peft=lora``, the same model with its
adapters off (the frozen base; no second copy); otherwise a frozen copy loaded from
``checkpoint.pretrained_checkpoint``, built at the first micro-batch (``pretrain()`` builds the
policy and the process groups; the copy needs both) and kept in eval mode. Both passes see the
same rows, so the policy and the reference score the same tokens.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Iterator, Optional

import torch

from bridge_cli.logging.timers import timed
from bridge_cli.training.dpo_loss import dpo_loss
from bridge_cli.training.gpt_step import get_batch
from bridge_cli.training.state import GlobalState


def pair_layout(batch: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], torch.Tensor, int]:
    """(rows, bins, pairs) of a micro-batch from :mod:`bridge_cli.data.preference`.

    Unpacked pairs ``[N, 2, S]`` become 2N rows, pair p's chosen row then its rejected row, with bins
    ``2p`` and ``2p + 1``. Packed rows ``[N, S]`` number their sequences by ``document_ids`` (chosen even,
    rejected odd); row n's bins start at ``n * B``, B the even number above the most sequences a row holds.
    """
    tokens = batch["tokens"]
    if tokens.dim() == 3:
        pairs = tokens.shape[0]
        bins = torch.arange(2 * pairs, device=tokens.device).view(pairs, 2, 1).expand_as(tokens)
        rows = {key: value.flatten(0, 1) for key, value in batch.items()}
        return rows, bins.flatten(0, 1), pairs
    per_row = 2 * (tokens.shape[1] // 2 + 1)
    offsets = torch.arange(tokens.shape[0], device=tokens.device).view(-1, 1) * per_row
    return batch, offsets + batch["document_ids"].long(), tokens.shape[0] * per_row // 2


class DPOForwardStep:
    """``forward_step(state, data_iterator, model)`` for DPO; holds the reference between micro-batches."""

    def __init__(self):
        self.reference: Optional[list] = None
        """The frozen copy's model chunks (without peft), built at the first micro-batch."""
        self._adapted: dict[int, list] = {}

    def __call__(self, state: GlobalState, data_iterator: Iterator, model):
        cfg = state.cfg
        with timed(state.timers, "batch-generator", log_level=2):
            batch = get_batch(data_iterator, state.runtime.device, use_mask=False)
        batch, bins, pairs = pair_layout(batch)
        documents = {}
        if "document_ids" in batch:  # packed: attention and RoPE restart at each sequence
            from bridge_cli.models.attention.masks import batch_document_params

            documents["packed_seq_params"] = batch_document_params(cfg.model, batch.pop("document_ids"),
                                                                   batch["position_ids"], 1, 0)
        inputs = (batch["tokens"], batch["position_ids"], None)
        with torch.no_grad():
            reference_logps = -self.reference_forward(state, model, inputs, batch["labels"], documents).float()
        output = model(*inputs, labels=batch["labels"], **documents)
        dpo, checks = cfg.dpo, cfg.rerun_state_machine
        return output, functools.partial(dpo_loss, batch["loss_mask"], bins, pairs, reference_logps, beta=dpo.beta,
                                         label_smoothing=dpo.label_smoothing, loss_type=dpo.loss_type,
                                         check_for_nan_in_loss=checks.check_for_nan_in_loss,
                                         check_for_spiky_loss=checks.check_for_spiky_loss)

    def reference_forward(self, state: GlobalState, model, inputs: tuple, labels: torch.Tensor,
                          documents: dict) -> torch.Tensor:
        """The reference's per-token cross entropy of ``labels``."""
        if state.cfg.peft is not None:
            from bridge_cli.peft.adapters_off import adapted_layers, adapters_off

            if id(model) not in self._adapted:
                self._adapted[id(model)] = adapted_layers(model)
                _say("DPO reference: the base model, the LoRA adapters off")
            with adapters_off(self._adapted[id(model)]):
                return model(*inputs, labels=labels, **documents)
        if self.reference is None:
            self.reference = build_reference(state)
        return self.reference[0](*inputs, labels=labels, **documents)


def check_reference(cfg) -> None:
    """Without peft, the frozen copy is read from checkpoint.pretrained_checkpoint, which must be set."""
    from bridge_cli.config.errors import ConfigError

    if cfg.peft is None and cfg.checkpoint.pretrained_checkpoint is None:
        raise ConfigError("checkpoint.pretrained_checkpoint", "is not set; finetune.objective=dpo without peft "
                          "compares the model with a frozen copy of the one it started from, read from there.",
                          "Set checkpoint.pretrained_checkpoint=DIR (the DPO run's starting checkpoint), also when "
                          "resuming from or evaluating checkpoint.load.")


def build_reference(state: GlobalState) -> list:
    """A frozen copy of the starting model: ``checkpoint.pretrained_checkpoint``'s weights, eval mode, no gradients."""
    from bridge_cli.checkpoint.load import load_checkpoint
    from bridge_cli.convert.hf_training import converted_for_loading
    from bridge_cli.training.setup import build_model

    check_reference(state.cfg)
    cfg = copy.copy(state.cfg)
    # the starting weights even when resuming: checkpoint.load holds the policy's
    cfg.peft, cfg.checkpoint = None, dataclasses.replace(state.cfg.checkpoint, load=None)
    chunks = build_model(cfg, state.runtime)
    with converted_for_loading(cfg.checkpoint, state.runtime.local_rank) as pretrained:
        load_checkpoint(GlobalState(cfg=cfg, runtime=state.runtime), chunks, None, None, weights_only=True,
                        pretrained=pretrained)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    _say(f"DPO reference: a frozen copy of {cfg.checkpoint.pretrained_checkpoint}")
    return chunks


def _say(line: str) -> None:
    from bridge_cli.runtime.collectives import is_last_rank

    if is_last_rank():
        print(line, flush=True)
