"""Hooks that change a built GPTModel before it is wrapped: a value head, frozen MoE routers.

A hook takes the list of model chunks this rank holds (one per virtual pipeline stage) and
returns it, as Megatron-Bridge's pre-wrap hooks do; RLHF and reward-model trainers call them
between ``provide()`` and the DDP wrap.
"""

from __future__ import annotations

from typing import Callable, Optional, Union

import torch

ModelList = list
ModelHook = Callable[[ModelList], ModelList]


class LinearForLastLayer(torch.nn.Linear):
    """A replicated projection that stands in for GPTModel's output layer (value or reward head).

    GPTModel calls its output layer as ``output_layer(hidden, weight=..., runtime_gather_output=...)``
    and expects ``(output, bias)``; this head accepts and ignores those arguments. Its weight is
    the same on every tensor-parallel rank; with sequence parallelism the hidden states arrive
    split along the sequence, so the output is gathered back to the full sequence.
    """

    def __init__(self, input_size: int, output_size: int, sequence_parallel: bool):
        super().__init__(in_features=input_size, out_features=output_size, bias=False)
        self.sequence_parallel = sequence_parallel
        if sequence_parallel:
            # Marks the weight for megatron-core's all-reduce of sequence-parallel grads across TP.
            self.weight.sequence_parallel = True

    def forward(self, input_: torch.Tensor, weight: Optional[torch.Tensor] = None,
                runtime_gather_output: Optional[bool] = None) -> tuple[torch.Tensor, None]:
        output = super().forward(input_).float()
        if self.sequence_parallel:
            from megatron.core.tensor_parallel import gather_from_sequence_parallel_region

            output = gather_from_sequence_parallel_region(output, tensor_parallel_output_grad=False)
        return output, None


def _ensure_model_list(model: Union[ModelList, torch.nn.Module]) -> ModelList:
    return list(model) if isinstance(model, (list, tuple)) else [model]


def _unwrapped(chunk: torch.nn.Module) -> torch.nn.Module:
    """The GPTModel inside Float16Module / DDP wrappers."""
    while not hasattr(chunk, "output_layer") and hasattr(chunk, "module"):
        chunk = chunk.module
    return chunk


def create_value_head_hook(hidden_size: int, sequence_parallel: bool, output_size: int = 1) -> ModelHook:
    """A hook that replaces the output layer of the last pipeline stage with a ``LinearForLastLayer``.

    The model then returns ``[batch, seq, output_size]`` values instead of vocabulary logits when
    called without labels. Chunks that are not the last stage (no ``post_process``) are left alone.
    """

    def hook(model: ModelList) -> ModelList:
        chunks = _ensure_model_list(model)
        for chunk in chunks:
            gpt = _unwrapped(chunk)
            if not getattr(gpt, "post_process", False):
                continue
            old = gpt.output_layer
            head = LinearForLastLayer(hidden_size, output_size, sequence_parallel)
            reference = next(old.parameters(), None) or next(gpt.parameters())
            gpt.output_layer = head.to(device=reference.device, dtype=reference.dtype)
            # The embedding no longer doubles as the output projection.
            gpt.share_embeddings_and_output_weights = False
        return chunks

    return hook


def make_value_model(hidden_size: int, sequence_parallel: bool) -> ModelHook:
    """The value-head hook with one output per token (the critic of PPO-style trainers)."""
    return create_value_head_hook(hidden_size, sequence_parallel, output_size=1)


def _freeze_parameter_if_present(module: object, name: str) -> None:
    param = getattr(module, name, None)
    if isinstance(param, torch.nn.Parameter):
        param.requires_grad_(False)


def freeze_moe_router(model: Union[ModelList, torch.nn.Module]) -> ModelList:
    """Freeze every MoE router's weights (and expert bias) and every shared-expert gate, in place.

    Call before the DDP wrap and the optimizer are built, so neither allocates state for them.
    """
    from megatron.core.transformer.moe.router import Router

    chunks = _ensure_model_list(model)
    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, Router):
                for name in ("weight", "bias", "expert_bias"):
                    _freeze_parameter_if_present(module, name)
            shared = getattr(module, "shared_experts", None)
            if shared is not None:
                _freeze_parameter_if_present(shared, "gate_weight")
    return chunks
