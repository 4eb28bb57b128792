"""The default forward step for GPT pretraining: one micro-batch through the model, and its loss."""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

from bridge_cli.logging.timers import timed
from bridge_cli.training.losses import masked_next_token_loss
from bridge_cli.training.state import GlobalState


def get_batch(data_iterator: Iterator, device: torch.device, use_mask: bool) -> dict[str, torch.Tensor]:
    """The next micro-batch on ``device``, copied without blocking the host."""
    batch = next(data_iterator)
    keys = ("tokens", "labels", "loss_mask", "position_ids", "document_ids") + (("attention_mask",) if use_mask else ())
    return {k: batch[k].to(device, non_blocking=True) for k in keys if k in batch}


def forward_step(state: GlobalState, data_iterator: Iterator, model, return_schedule_plan: bool = False):
    """Forward one micro-batch; return the per-token losses and the function that reduces them."""
    use_mask = not getattr(state.cfg.dataset, "skip_getting_attention_mask_from_dataset", True)
    with timed(state.timers, "batch-generator", log_level=2), _straggler_timed(state, batch=True):
        batch = get_batch(data_iterator, state.runtime.device, use_mask)
    cp_size = state.cfg.model.context_parallel_size
    cp_rank = _context_parallel_rank() if cp_size > 1 else 0
    documents = {}
    if "document_ids" in batch:  # rows of several documents: attention and RoPE restart at each
        from bridge_cli.models.attention.masks import batch_document_params

        documents["packed_seq_params"] = batch_document_params(state.cfg.model, batch.pop("document_ids"),
                                                               batch["position_ids"], cp_size, cp_rank)
    if cp_size > 1:  # this rank's part of every row
        from bridge_cli.models.attention.context_parallel import slice_rows

        batch = {key: slice_rows(value, cp_size, cp_rank) for key, value in batch.items()}
    with _straggler_timed(state):
        output = model(batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
                       **documents)
    checks = state.cfg.rerun_state_machine
    return output, functools.partial(masked_next_token_loss, batch["loss_mask"],
                                     check_for_nan_in_loss=checks.check_for_nan_in_loss,
                                     check_for_spiky_loss=checks.check_for_spiky_loss)


def _straggler_timed(state: GlobalState, batch: bool = False):
    """The straggler detector's timing context (``batch``: host time of loading a batch), or none."""
    timer = state.straggler_timer
    return contextlib.nullcontext() if timer is None else timer(bdata=batch)


def _context_parallel_rank() -> int:
    from megatron.core import parallel_state

    return parallel_state.get_context_parallel_rank()
