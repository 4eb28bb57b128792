"""The forward step of ``finetune.objective=dpo``: a micro-batch of whole preference pairs through the
reference model (no gradient) and the policy, and the DPO loss of :mod:`bridge_cli.training.dpo_loss`.

The reference is the model training started from: with ``peft=lora``, the same model with its
adapters off (the frozen base; no second copy); otherwise a frozen copy loaded from
``checkpoint.pretrained_checkpoint``, built once the policy and the process groups are (the copy needs
both), before the first micro-batch, and kept in eval mode. Both passes see the
same rows, so the policy and the reference score the same tokens.

Under pipeline parallelism the reference rides in the policy's schedule
(:mod:`bridge_cli.training.frozen_pipeline`): each stage runs its layers of the reference (no gradient) and of
the policy on a micro-batch and sends both outputs on as one tensor. A micro-batch holds whole pairs, so the
last stage has both sequences of every pair and both models' log-probabilities of them: the one-process loss.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from typing import Iterator, Optional

import torch

from bridge_cli.logging.timers import timed
from bridge_cli.training.dpo_loss import dpo_loss
from bridge_cli.training.frozen_pipeline import frozen_chunk, gpt_model, joined, received
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
        """The frozen copy's model chunks (without peft), built before the first micro-batch."""
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
        stage = gpt_model(model)
        rows = batch["tokens"].shape[0]
        policy_input, reference_input = received(model, rows, stage.config.hidden_size)
        with torch.no_grad():
            reference = self.reference_forward(state, model, inputs, batch["labels"], documents, reference_input)
        stage.set_input_tensor(policy_input)
        output = model(*inputs, labels=batch["labels"], **documents)
        if not stage.post_process:  # hidden states for the next stage
            return joined(output, reference), None
        dpo, checks = cfg.dpo, cfg.rerun_state_machine
        return output, functools.partial(dpo_loss, batch["loss_mask"], bins, pairs, -reference.float(), beta=dpo.beta,
                                         label_smoothing=dpo.label_smoothing, loss_type=dpo.loss_type,
                                         check_for_nan_in_loss=checks.check_for_nan_in_loss,
                                         check_for_spiky_loss=checks.check_for_spiky_loss)

    def build_frozen(self, state: GlobalState) -> None:
        """Build the frozen copy (without peft; once). Every rank calls this before the schedule runs
        (:func:`~bridge_cli.training.objectives.build_frozen_models`), as loading takes collectives."""
        if state.cfg.peft is None and self.reference is None:
            self.reference = build_reference(state)

    def reference_forward(self, state: GlobalState, model, inputs: tuple, labels: torch.Tensor,
                          documents: dict, previous: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The reference's stage of ``model``'s on this micro-batch: its per-token cross entropy of ``labels`` on
        the last pipeline stage, else its hidden states; ``previous``: the previous stage's (None on the first)."""
        if state.cfg.peft is not None:
            from bridge_cli.peft.adapters_off import adapted_layers, adapters_off

            if id(model) not in self._adapted:
                self._adapted[id(model)] = adapted_layers(model)
                _say("DPO reference: the base model, the LoRA adapters off")
            gpt_model(model).set_input_tensor(previous)
            with adapters_off(self._adapted[id(model)]):
                return model(*inputs, labels=labels, **documents)
        self.build_frozen(state)
        chunk = frozen_chunk(self.reference, model)
        gpt_model(chunk).set_input_tensor(previous)
        return chunk(*inputs, labels=labels, **documents)


def pipeline_rows(cfg) -> int:
    """The batch dimension of the activations a pipeline stage sends per micro-batch: the policy's rows (2 a pair
    unpacked, 1 a packed row) and as many of the reference's."""
    from bridge_cli.data.preference import rows_per_sample

    return 2 * rows_per_sample(cfg) * cfg.train.micro_batch_size


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
