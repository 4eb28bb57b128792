"""A frozen model's activations beside the trained model's in one pipeline schedule: DPO's reference,
distillation's teacher.

megatron-core's schedules pass one tensor ``[s, b, h]`` between stages per micro-batch, ``h`` the trained
model's hidden size and ``b`` what :func:`~bridge_cli.training.objectives.pipeline_micro_batch` tells them. Each
stage runs its layers of both models on the micro-batch; :func:`joined` lays the frozen model's output
``[s, rows, h_f]`` out as :func:`frozen_rows` more rows of ``h`` after the trained model's rows (zero-padded when
``rows x h_f`` is not a multiple of ``h``), and the next stage takes the two apart with :func:`received`. So the
last stage has both models' outputs of the same micro-batch. The frozen rows get a zero gradient on the way back;
the trained rows' gradient flows as it would without them.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def frozen_rows(rows: int, frozen_hidden: int, hidden: int) -> int:
    """Rows of ``hidden`` that ``rows`` rows of a frozen model's ``frozen_hidden`` take."""
    return -(-rows * frozen_hidden // hidden)


def gpt_model(chunk):
    """The GPTModel inside a model chunk's wrappers (DDP, Float16Module)."""
    from megatron.core.utils import get_attr_wrapped_model

    return get_attr_wrapped_model(chunk, "decoder", return_model_obj=True)


def frozen_chunk(chunks: list, chunk):
    """The frozen model's chunk of the same (virtual) pipeline stage as the trained model's ``chunk``."""
    return chunks[gpt_model(chunk).vp_stage or 0]


def received(chunk, rows: int, frozen_hidden: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
    """(trained, frozen) inputs of this stage from what the previous one sent (the schedule set it on ``chunk``);
    (None, None) on the first stage. The trained part is a slice of the received tensor, so its gradient flows
    back into it; the frozen part is detached."""
    model = gpt_model(chunk)
    if model.pre_process:
        return None, None
    tensor = model.decoder.input_tensor
    length = tensor.shape[0]
    frozen = tensor[:, rows:].detach().reshape(length, -1)[:, :rows * frozen_hidden]
    return tensor[:, :rows], frozen.reshape(length, rows, frozen_hidden).contiguous()


def joined(trained: torch.Tensor, frozen: torch.Tensor) -> torch.Tensor:
    """What this stage sends on: ``trained`` ``[s, rows, h]`` then ``frozen`` ``[s, rows, h_f]`` as rows of h."""
    length, rows, hidden = trained.shape
    extra = frozen_rows(rows, frozen.shape[-1], hidden)
    flat = F.pad(frozen.detach().reshape(length, -1), (0, extra * hidden - rows * frozen.shape[-1]))
    return torch.cat([trained, flat.view(length, extra, hidden).to(trained.dtype)], dim=1)
