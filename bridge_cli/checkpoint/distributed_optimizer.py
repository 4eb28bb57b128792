"""The distributed optimizer's state saved per weight (megatron-core's ``fully_reshardable``), loaded under any layout.

megatron-core's DistributedOptimizer keeps each data-parallel rank's slice of the flattened weights, laid
out by its grad buffers. Saved ``dp_reshardable`` (Megatron-LM's default), the state is those buffer slices
as they are: it loads only where tensor, pipeline and expert parallelism are the saving run's. Saved
``fully_reshardable`` (Megatron-LM's ``--dist-ckpt-optim-fully-reshardable``), each data-parallel group
gathers its state and cuts it per weight, under the weight's own key and global shape
(``optimizer.state.{param,exp_avg,exp_avg_sq}.<weight>``, ``param`` being the fp32 main weight), so it loads
under any TP, PP, EP or DP; the param groups and the step count go into the common state. Bridge saves
that way with ``checkpoint.dist_ckpt_optim_fully_reshardable=true``
(:func:`bridge_cli.checkpoint.state_dict.content_metadata`; off by default, as in Megatron-LM, since saving
gathers each data-parallel group's whole state on every rank of the group) and loads either.

Loading needs two things megatron-core 0.16-0.19 does not do for torch's Adam (no Transformer Engine or
Apex), both done by :func:`load`:

- torch's Adam keeps a ``step`` tensor in each weight's state beside the moments, and megatron-core's
  ``load_parameter_state_from_fully_reshardable`` copies every tensor of that state from the checkpoint's,
  which has none (the count is saved in the param groups): it stops with ``KeyError: 'step'``. The step
  tensors are set aside while megatron-core loads the moments and main weights, then put back (the count
  itself loads with the param groups).
- with EP > 1 megatron-core chains a second distributed optimizer for the expert weights (EP=1 has one): the
  moments load into either chain, being keyed by weight, but the param groups are saved per member of the
  chain. Where the checkpoint's do not match this run's member, the member keeps its own param groups (their
  learning rate and weight decay follow the scheduler, which loads as usual) with the checkpoint's step count.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

FULLY_RESHARDABLE = "fully_reshardable"
"""The sharding ``checkpoint.dist_ckpt_optim_fully_reshardable`` saves, the one that loads under another layout."""


def saved_sharding(common: dict) -> Optional[str]:
    """How the checkpoint whose common state is ``common`` saved a distributed optimizer (None: not recorded)."""
    from megatron.core.dist_checkpointing.serialization import load_content_metadata

    return (load_content_metadata(preloaded_state_dict=common) or {}).get("distrib_optim_sharding_type")


def reshards(sharding: Optional[str]) -> bool:
    """Whether state saved with ``sharding`` loads under another TP, PP or expert layout."""
    return sharding == FULLY_RESHARDABLE


@torch.no_grad()
def load(optimizer, loaded: dict) -> None:
    """Load ``loaded`` (what ``dist_checkpointing.load`` filled in for ``optimizer.sharded_state_dict``, with the
    checkpoint's common state merged in) into ``optimizer``, a DistributedOptimizer or a chain of them, whose
    torch state exists already (a template for loading is built from it)."""
    from bridge_cli.runtime.optimizer_chain import members

    chain = members(optimizer)
    step = _saved_step(loaded)
    for index, member in enumerate(chain):
        filled = loaded[index] if len(chain) > 1 else loaded
        member.load_state_dict(_param_groups(member, filled, loaded, step))
        _load_moments(member, filled["param_state"])


def _param_groups(member, filled: dict, loaded: dict, step: Any) -> dict:
    """The state dict megatron-core's ``load_state_dict`` takes, without the tensors: the checkpoint's param
    groups (and loss scale) for this member where they match its own, else its own with the checkpoint's step."""
    from megatron.core.optimizer.optimizer import param_group_identifier_keys

    def identity(group: dict) -> tuple:
        return tuple(group.get(key) for key in param_group_identifier_keys)

    saved = filled.get("optimizer")
    if isinstance(saved, dict) and "param_groups" in saved:
        saved_groups = {identity(group) for group in saved["param_groups"]}
        if all(identity(group) in saved_groups for group in member.optimizer.param_groups):
            return {key: value for key, value in filled.items() if key in ("optimizer", "grad_scaler")}
    own = member.state_dict()
    if step is not None:
        for group in own["optimizer"]["param_groups"]:
            group["step"] = step
    scaler = _find(loaded, "grad_scaler")
    if scaler is not None and "grad_scaler" in own:
        own["grad_scaler"] = scaler
    return own


def _load_moments(member, param_state: dict) -> None:
    """megatron-core's load of the per-weight tensors, with torch Adam's ``step`` tensors out of its way."""
    states = member.optimizer.state
    steps = {param: state.pop("step") for param, state in states.items() if "step" in state}
    try:
        member.load_parameter_state_from_fully_reshardable(param_state)
    finally:
        for param, value in steps.items():
            states[param]["step"] = value


def _saved_step(loaded: Any) -> Any:
    """The step count in the checkpoint's param groups (megatron-core saves one count for all of them)."""
    groups = _find(loaded, "param_groups")
    steps = {group["step"] for group in groups or [] if "step" in group}
    return steps.pop() if len(steps) == 1 else None


def _find(tree: Any, key: str) -> Any:
    """The first value under ``key`` in nested dicts (depth first, dicts in insertion order)."""
    if not isinstance(tree, dict):
        return None
    if key in tree:
        return tree[key]
    for value in tree.values():
        found = _find(value, key)
        if found is not None:
            return found
    return None
