"""A megatron-core GPTModel on the CPU for conversion, and its torch_dist checkpoint.

A conversion runs as one process (gloo, no tensor or pipeline parallelism, the ``torch`` layer
spec, no random initialisation). That is enough in both directions: torch_dist checkpoints store
global tensors, so what this model saves loads under any parallel layout and layer spec, and a
checkpoint saved under any layout loads into it.
"""

from __future__ import annotations

import functools
import warnings
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

from bridge_cli.checkpoint import state_dict, verify
from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.checkpoint.save import RUN_CONFIG

SINGLE_PROCESS = {
    "tensor_model_parallel_size": 1, "pipeline_model_parallel_size": 1, "virtual_pipeline_model_parallel_size": None,
    "context_parallel_size": 1, "sequence_parallel": False, "num_layers_in_first_pipeline_stage": None,
    "num_layers_in_last_pipeline_stage": None, "pipeline_model_parallel_layout": None,
    "account_for_embedding_in_pipeline_split": False, "account_for_loss_in_pipeline_split": False,
    # Layer names differ between specs only in the module tree; the checkpoint keys are the same.
    "spec": "torch",
    # Experts one module each (SequentialMLP), as the mapping names them: without Transformer Engine a grouped-GEMM
    # recipe would build megatron-core's legacy GroupedMLP (weight1/weight2); the checkpoint keys are the same.
    "moe_grouped_gemm": False,
    # Every weight is overwritten, so skip drawing random ones (minutes for a large model).
    "use_cpu_initialization": True, "perform_initialization": False,
}


def init_process(tensor_model_parallel_size: int = 1, expert_model_parallel_size: int = 1,
                 expert_tensor_parallel_size: Optional[int] = None):
    """Join a gloo process group (a world of one unless launched by torchrun) with megatron-core's groups
    (expert TP: the tensor-parallel size unless given)."""
    from bridge_cli.runtime.distributed import init_distributed

    return init_distributed("gloo", 30, tensor_model_parallel_size, 1,
                            expert_model_parallel_size=expert_model_parallel_size,
                            expert_tensor_parallel_size=expert_tensor_parallel_size)


def model_config(values: dict[str, Any], **overrides):
    """A GPTModelProvider for ``model:`` YAML values, set up for one CPU process (``overrides`` last)."""
    from bridge_cli.config import mcore_schema
    from bridge_cli.models.provider import GPTModelProvider

    known = {f.name for f in mcore_schema.schema_fields(GPTModelProvider)}
    fixed = {key: value for key, value in SINGLE_PROCESS.items() if key in known}
    return mcore_schema.build("model", GPTModelProvider, {**values, **fixed, **overrides})


def build_model(config):
    """The GPTModel of ``config`` with every weight in ``params_dtype``.

    megatron-core builds its torch norms in float32 and leaves the cast to its Float16Module
    wrapper in half-precision training, so the checkpoints of such runs hold half-precision norms.
    A router's expert bias stays float32, as megatron-core keeps it.
    """
    model = config.provide().to(config.params_dtype)
    for module in model.modules():  # megatron-core keeps a router's expert bias in float32 in every precision
        if getattr(module, "expert_bias", None) is not None:
            module.expert_bias.data = module.expert_bias.data.float()
    return model


def weights(model) -> dict[str, Any]:
    """The tensors a checkpoint holds of ``model``, by name: its parameters and persistent buffers (a
    router's expert bias)."""
    stored = set(model.state_dict(keep_vars=True))
    return {name: tensor for name, tensor in [*model.named_parameters(), *model.named_buffers()] if name in stored}


def saved_model_values(path: Path) -> dict[str, Any]:
    """The ``model:`` section of a checkpoint's run_config.yaml, completed with the schema's defaults."""
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from bridge_cli.config import mcore_schema
    from bridge_cli.models.provider import GPTModelProvider

    saved = verify.saved_config(path)
    if not saved or "model" not in saved:
        raise CheckpointError(f"{path} has no {RUN_CONFIG} with a model section; the model's shape is read from "
                              "it. Convert a checkpoint that `bridge pretrain` saved.")
    known = {f.name for f in mcore_schema.schema_fields(GPTModelProvider)}
    try:
        merged = OmegaConf.merge(_model_schema(), {k: v for k, v in saved["model"].items() if k in known})
    except OmegaConfBaseException as err:
        raise CheckpointError(f"{path / RUN_CONFIG}: model.{err.full_key}: {str(err).splitlines()[0]}") from err
    return OmegaConf.to_container(merged, resolve=True)


@functools.cache
def _model_schema():
    """The ``model:`` section's structured config (merging copies it; built once: 70 ms)."""
    from omegaconf import OmegaConf

    from bridge_cli.config import mcore_schema
    from bridge_cli.models.provider import GPTModelProvider

    return OmegaConf.structured(mcore_schema.schema_dataclass(GPTModelProvider))


def save_weights(model, cfg, root: Path) -> Path:
    """Save ``model``'s weights as iteration 0 under ``root``, in the layout `bridge pretrain` writes.

    The checkpoint holds the weights and the progress counters of a run that has not started (no
    optimizer, scheduler or RNG state), so ``checkpoint.pretrained_checkpoint`` and
    ``checkpoint.load`` both start from it at iteration 0. ``cfg`` (a ConfigContainer) is saved as
    its run_config.yaml.
    """
    from bridge_cli.checkpoint.save import write_checkpoint
    from bridge_cli.checkpoint.train_state import TrainState

    metadata = state_dict.content_metadata(cfg.optimizer.use_distributed_optimizer)
    sharded = {**state_dict.header(TrainState()), "model": model.sharded_state_dict(metadata=metadata)}
    return write_checkpoint(root, 0, sharded, cfg.run_record(), content_metadata=metadata)[0]


def load_weights(model, model_cfg, path: Path) -> None:
    """Fill ``model`` (built for this process's layout from ``model_cfg``) with the weights of the
    checkpoint folder ``path``.

    Shapes are checked first, so another model's checkpoint fails naming the tensors that differ
    (and the settings its run_config.yaml has that ``model_cfg`` has not).
    """
    from megatron.core import dist_checkpointing

    template = _checked_template(model, model_cfg, path)
    with _quiet_loading():
        loaded = _read(path, lambda p: dist_checkpointing.load(template, p))
    model.load_state_dict(loaded["model"], strict=True)


def stream_weights(model, model_cfg, path: Path,
                   select: Optional[Callable[[str], bool]] = None) -> Iterator[dict[str, Any]]:
    """The weights of checkpoint ``path`` for ``model`` (one process, built from ``model_cfg``),
    read one decoder layer at a time (see :mod:`~bridge_cli.convert.layer_reader`):
    ``{parameter name: tensor}`` per layer, and per tensor outside the layers, in the model's order;
    only the parameters whose name ``select`` takes, where given (a LoRA checkpoint's adapters).

    Checked as load_weights checks. A group is read when it is asked for and is the caller's to
    drop, so the model is never resident whole (its own storage is never written).
    """
    from bridge_cli.convert.layer_reader import read_by_layer

    template = _checked_template(model, model_cfg, path, select)["model"]
    params = set(weights(model))
    groups = read_by_layer({name: value for name, value in template.items() if name in params}, path)
    with _quiet_loading():
        while (group := _read(path, lambda _: next(groups, None))) is not None:
            yield group


def _checked_template(model, model_cfg, path: Path, select: Optional[Callable[[str], bool]] = None) -> dict:
    """``{"model": model's sharded state dict}`` (the entries ``select`` takes, where given) for checkpoint
    ``path``, whose files and shapes match."""
    from megatron.core import dist_checkpointing
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    verify.check_files(path)
    sharded = model.sharded_state_dict(metadata=_read(path, dist_checkpointing.load_content_metadata))
    template = {"model": {name: entry for name, entry in sharded.items() if select is None or select(name)}}
    stored = _read(path, load_sharded_metadata)
    verify.check_model_matches(path, template, stored, model_cfg, verify.saved_config(path))
    return template


@contextmanager
def _quiet_loading():
    """Silence torch's and megatron-core's own deprecation notices about their internals: nothing to act on."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*(deprecating ShardedTensor|`load_state_dict` is deprecated)",
                                category=FutureWarning)
        yield


def _read(path: Path, read):
    """``read(str(path))``; a failure becomes a CheckpointError naming the checkpoint."""
    try:
        return read(str(path))
    except CheckpointError:
        raise
    except Exception as err:  # a damaged file surfaces as whatever its reader raises
        raise CheckpointError(f"{path}: cannot be read ({type(err).__name__}: {str(err)[:500]}).") from err
