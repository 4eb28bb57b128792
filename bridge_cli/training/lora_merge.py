"""Merge LoRA adapters into their base model: a whole-model torch_dist checkpoint of ``W + (alpha / dim) B A``.

The result loads like any pretrained checkpoint (``checkpoint.pretrained_checkpoint``,
``checkpoint.load`` for ``bridge eval``), without ``peft``. It holds the weights alone, at the
adapters' iteration, in the tensor/pipeline layout of the merging run (torch_dist reshards it
on load anyway).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Optional

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.config.peft_config import LoRAConfig
from bridge_cli.training.config import ConfigContainer


def merge_adapters(config: ConfigContainer, adapters: str, output: str, base: Optional[str] = None) -> Path:
    """Load ``base`` (default: the base the adapters name) plus ``adapters``, fold them, save to ``output``.

    ``config`` gives the model (it must be the fine-tuning run's); the LoRA settings are the
    adapters' own. Returns the checkpoint folder written.
    """
    from bridge_cli.checkpoint import layout, state_dict
    from bridge_cli.checkpoint.load import adapter_metadata, load_checkpoint
    from bridge_cli.checkpoint.save import write_checkpoint
    from bridge_cli.convert.hf_training import converted_for_loading
    from bridge_cli.peft.lora import adapter_policy, merge_lora
    from bridge_cli.training.pretrain import run_session
    from bridge_cli.training.setup import build_model, initialize

    found = layout.require_checkpoint(Path(adapters))
    saved = adapter_metadata(found.path)
    if saved is None:
        raise CheckpointError(f"{found.path} holds a whole model, not LoRA adapters: there is nothing to merge.")
    if layout.find_checkpoint(Path(output)).path is not None:
        raise CheckpointError(f"{output} already holds a checkpoint; give an empty or new folder for the merged model.")
    lora = LoRAConfig(**{f.name: saved[f.name] for f in dataclasses.fields(LoRAConfig) if f.name in saved})
    # a new config for the merging run: the adapters' settings, loading the adapters onto their base
    run = dataclasses.replace(config, peft=lora, checkpoint=dataclasses.replace(
        config.checkpoint, load=str(found.path), pretrained_checkpoint=base or saved.get("base_checkpoint"),
        ckpt_step=None))
    with run_session(run) as state:
        runtime = initialize(state)
        model = build_model(run, runtime)
        with converted_for_loading(run.checkpoint, runtime.local_rank, base_needed=True) as pretrained:
            load_checkpoint(state, model, None, None, weights_only=True, adapters=adapter_policy(lora),
                            pretrained=pretrained)
        merge_lora(model)
        state.train_state.step = found.iteration
        metadata = state_dict.content_metadata(run.optimizer.use_distributed_optimizer)
        sharded = {**state_dict.header(state.train_state), **state_dict.model_sharded_state_dict(model, metadata)}
        # the merged checkpoint is a plain model, and its run_config.yaml says so
        return write_checkpoint(Path(output), found.iteration, sharded, {**run.run_record(), "peft": None},
                                content_metadata=metadata)[0]
