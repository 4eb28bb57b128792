"""The forward step of ``finetune.objective=distill``: a micro-batch through the frozen teacher (no gradient)
and the model, and the loss of :mod:`bridge_cli.training.distill_loss` on their logits.

The teacher is ``distill.teacher_checkpoint``: a checkpoint bridge saved, or a Hugging Face folder converted
as ``checkpoint.pretrained_checkpoint`` is (:func:`~bridge_cli.convert.hf_training.converted_for_loading`).
Its shape (depth, width, heads, ...) is its own, read from the checkpoint's run_config.yaml or config.json;
how it runs is the model's: the same tensor- and pipeline-parallel layout (so both hold the same slice of the
vocabulary, and each stage its share of the teacher's layers), precision, layer spec and sequence length. It
must have the model's vocabulary. It is built once the model and the process groups are (``pretrain()`` builds
both), before the first micro-batch, kept in eval mode, without gradients, outside the optimizer and the
checkpoints. Under pipeline parallelism the teacher's activations ride in the model's schedule
(:mod:`bridge_cli.training.frozen_pipeline`), so the last stage has both models' logits of the same micro-batch.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from pathlib import Path
from typing import Any, Iterator, Optional

import torch

from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.config.errors import ConfigError
from bridge_cli.logging.timers import timed
from bridge_cli.training.distill_loss import distill_loss
from bridge_cli.training.frozen_pipeline import frozen_chunk, frozen_rows, gpt_model, joined, received
from bridge_cli.training.gpt_step import get_batch
from bridge_cli.training.state import GlobalState

FIELD = "distill.teacher_checkpoint"

STUDENT_FIELDS = ("spec", "make_vocab_size_divisible_by", "seq_length", "compile_layers", "sdpa_backend",
                  "attention_backend", "first_last_layers_bf16", "num_layers_at_start_in_bf16",
                  "num_layers_at_end_in_bf16")
"""Teacher fields taken from the model's (with megatron-core's ModelParallelConfig fields: the parallel layout
and precision, and the fp8/fp4 ones): how the model runs, not what it computes."""


class DistillForwardStep:
    """``forward_step(state, data_iterator, model)`` for distillation; holds the teacher between micro-batches."""

    def __init__(self):
        self.teacher: Optional[list] = None
        """The frozen teacher's chunks, one per (virtual) pipeline stage, built before the first micro-batch."""

    def __call__(self, state: GlobalState, data_iterator: Iterator, model):
        cfg = state.cfg
        use_mask = not getattr(cfg.dataset, "skip_getting_attention_mask_from_dataset", True)
        with timed(state.timers, "batch-generator", log_level=2):
            batch = get_batch(data_iterator, state.runtime.device, use_mask)
        self.build_frozen(state)
        inputs = (batch["tokens"], batch["position_ids"], batch.get("attention_mask"))
        documents = batch.pop("document_ids", None)
        stage, teacher = gpt_model(model), frozen_chunk(self.teacher, model)
        model_input, teacher_input = received(model, batch["tokens"].shape[0], teacher.config.hidden_size)
        gpt_model(teacher).set_input_tensor(teacher_input)
        with torch.no_grad():
            teacher_logits = teacher(*inputs, **_packed(teacher.config, documents, batch))
        stage.set_input_tensor(model_input)
        logits = model(*inputs, **_packed(cfg.model, documents, batch))
        if not stage.post_process:  # hidden states (both models') for the next stage
            return joined(logits, teacher_logits), None
        distill, checks = cfg.distill, cfg.rerun_state_machine
        return logits, functools.partial(distill_loss, batch["loss_mask"], batch["labels"], teacher_logits,
                                         temperature=distill.temperature, ce_weight=distill.ce_weight,
                                         vocab_size=cfg.derived.vocab_size, group=_tensor_parallel_group(cfg),
                                         check_for_nan_in_loss=checks.check_for_nan_in_loss,
                                         check_for_spiky_loss=checks.check_for_spiky_loss)


    def build_frozen(self, state: GlobalState) -> None:
        """Build the teacher (once). Every rank calls this before the schedule runs
        (:func:`~bridge_cli.training.objectives.build_frozen_models`), as loading takes collectives."""
        if self.teacher is None:
            self.teacher = build_teacher(state)


def pipeline_rows(cfg) -> int:
    """The batch dimension of the activations a pipeline stage sends per micro-batch: the model's rows and the
    teacher's, laid out as rows of the model's hidden size."""
    rows = cfg.train.micro_batch_size
    if cfg.model.pipeline_model_parallel_size == 1:
        return rows
    return rows + frozen_rows(rows, _teacher_hidden_size(cfg.distill.teacher_checkpoint), cfg.model.hidden_size)


@functools.lru_cache(maxsize=None)
def _teacher_hidden_size(teacher: str) -> int:
    """Read once: the schedules ask at every step."""
    return saved_model_values_of(teacher)[0]["hidden_size"]


def _packed(model_config, documents: Optional[torch.Tensor], batch: dict) -> dict:
    """Packed rows: attention and RoPE restart at each sequence (masks for the windows of this model's layers)."""
    if documents is None:
        return {}
    from bridge_cli.models.attention.masks import batch_document_params

    return {"packed_seq_params": batch_document_params(model_config, documents, batch["position_ids"], 1, 0)}


def _tensor_parallel_group(cfg):
    if cfg.model.tensor_model_parallel_size == 1:
        return None
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


def teacher_model_values(cfg) -> tuple[dict[str, Any], str]:
    """(the teacher's ``model:`` fields, where they were read) from ``distill.teacher_checkpoint``; a ConfigError or
    CheckpointError naming the field when it is unset or holds no model. A Hugging Face folder gives its
    config.json's fields (the ones import-hf maps), a bridge checkpoint its run_config.yaml's model section."""
    teacher = cfg.distill.teacher_checkpoint
    if teacher is None:
        raise ConfigError(FIELD, "is not set; finetune.objective=distill trains the model on a teacher's logits.",
                          f"Set {FIELD}=DIR (a checkpoint bridge saved, or a Hugging Face model folder).")
    return saved_model_values_of(teacher)


def saved_model_values_of(teacher: str) -> tuple[dict[str, Any], str]:
    """:func:`teacher_model_values` of the teacher folder ``teacher``."""
    from bridge_cli.checkpoint import verify
    from bridge_cli.checkpoint.layout import is_hugging_face_folder, require_checkpoint
    from bridge_cli.convert.hf_training import model_fields
    from bridge_cli.convert.mcore_io import saved_model_values

    if is_hugging_face_folder(teacher):
        return model_fields(teacher)[1], str(Path(teacher) / "config.json")
    with as_teacher(teacher):
        found = require_checkpoint(Path(teacher), label=f"{FIELD}={teacher}")
        saved = verify.saved_config(found.path) or {}
        base = (saved.get("checkpoint") or {}).get("pretrained_checkpoint")
        refuse_adapters(teacher, found.path, saved.get("peft"), base)
        return saved_model_values(found.path), str(found.path / "run_config.yaml")


def refuse_adapters(teacher: str, path: Path, adapters: Optional[dict], base: Optional[str]) -> None:
    """A LoRA run's checkpoint holds its adapters (``adapters``: its peft settings), not a model: the teacher is
    loaded whole, so it is refused, before the loader would advise peft=lora, which puts adapters on the student."""
    if not adapters:
        return
    raise ConfigError(FIELD, f"{teacher} holds LoRA adapters ({path}), not a whole model; the teacher is loaded whole "
                      "and frozen, and peft=lora would add adapters to the model trained, not to the teacher.",
                      f"Merge the adapters into their base first: bridge peft merge {teacher} MERGED_DIR "
                      "recipe=RECIPE (the recipe they were trained with" + (f"; their base: {base}" if base else "")
                      + f"), then set {FIELD}=MERGED_DIR.")


@contextlib.contextmanager
def as_teacher(teacher: str):
    """Checkpoint errors raised while reading the teacher name ``distill.teacher_checkpoint``: the loader reads it
    as ``checkpoint.pretrained_checkpoint`` and names that key."""
    try:
        yield
    except CheckpointError as err:
        text = str(err)
        if text.startswith(FIELD):
            raise
        raise CheckpointError(f"{FIELD}={teacher}: " + text.replace("checkpoint.pretrained_checkpoint", FIELD)) from err
    except ConfigError as err:
        if err.key != "checkpoint.pretrained_checkpoint":
            raise
        raise ConfigError(FIELD, err.message.replace("checkpoint.pretrained_checkpoint", FIELD),
                          err.hint and err.hint.replace("checkpoint.pretrained_checkpoint", FIELD)) from err


def check_teacher(cfg) -> dict[str, Any]:
    """Before any device work: the teacher exists, has the model's vocabulary and fits its tensor-parallel
    layout; returns its model fields."""
    values, where = teacher_model_values(cfg)
    vocab = cfg.derived.vocab_size
    if values.get("vocab_size") != vocab:
        raise ConfigError(FIELD, f"the teacher's vocabulary has {values.get('vocab_size')} tokens ({where}), the "
                          f"model's {vocab} (its tokenizer); distillation compares their next-token distributions "
                          "token by token, so they must share one vocabulary.",
                          "Use a teacher trained with this run's tokenizer, or set tokenizer= to the teacher's.")
    tp = cfg.model.tensor_model_parallel_size
    for key in ("num_attention_heads", "num_query_groups"):
        count = values.get(key) or values.get("num_attention_heads")
        if count % tp:
            raise ConfigError(FIELD, f"the teacher has {key}={count} ({where}), which "
                              f"model.tensor_model_parallel_size={tp} does not divide; the teacher runs in the "
                              "model's tensor-parallel layout.", "Choose a tensor-parallel size that divides both.")
    stages = cfg.model.pipeline_model_parallel_size * (cfg.model.virtual_pipeline_model_parallel_size or 1)
    if values.get("num_layers", 0) % stages:
        raise ConfigError(FIELD, f"the teacher has {values.get('num_layers')} layers ({where}), which the model's "
                          f"{stages} pipeline stages (model.pipeline_model_parallel_size x "
                          "virtual_pipeline_model_parallel_size) do not divide; each stage runs its share of the "
                          "teacher's layers.", "Choose a pipeline size that divides both models' layers.")
    if values.get("position_embedding_type") == "learned_absolute" and \
            cfg.model.seq_length > values.get("seq_length", cfg.model.seq_length):
        raise ConfigError("model.seq_length", f"is {cfg.model.seq_length}; the teacher's learned position embeddings "
                          f"stop at {values['seq_length']} ({where}).", f"Set model.seq_length={values['seq_length']}.")
    return values


def teacher_config(cfg, values: dict[str, Any]):
    """The teacher's GPTModelProvider: its own model fields, run as the model runs (:data:`STUDENT_FIELDS`)."""
    from megatron.core.model_parallel_config import ModelParallelConfig

    from bridge_cli.config import mcore_schema
    from bridge_cli.models.provider import GPTModelProvider

    student = mcore_schema.to_yaml_values("model", GPTModelProvider, cfg.derived.model)
    run = {f.name for f in dataclasses.fields(ModelParallelConfig)} | set(STUDENT_FIELDS)
    run |= {key for key in student if key.startswith(("fp8", "fp4"))}
    known = {f.name for f in mcore_schema.schema_fields(GPTModelProvider)}
    merged = {key: value for key, value in values.items() if key in known}
    merged.update({key: student[key] for key in run if key in student})
    # every weight is loaded, so draw none (and leave the run's random state as it is: a resumed run builds
    # the teacher at another iteration); no multi-token-prediction head, whose loss is not trained here
    merged.update(vocab_size=cfg.derived.vocab_size, perform_initialization=False, mtp_num_layers=None)
    return mcore_schema.build("model", GPTModelProvider, merged)


def build_teacher(state: GlobalState) -> list:
    """The frozen teacher's chunks: ``distill.teacher_checkpoint``'s weights in the model's layout (one chunk per
    (virtual) pipeline stage of this rank), eval mode, no gradients."""
    from megatron.core.transformer.module import Float16Module

    from bridge_cli.checkpoint.layout import require_checkpoint
    from bridge_cli.checkpoint.load import adapter_metadata, load_checkpoint
    from bridge_cli.convert.hf_training import converted_for_loading
    from bridge_cli.convert.mcore_io import saved_model_values

    cfg = copy.copy(state.cfg)
    teacher = cfg.distill.teacher_checkpoint
    values = check_teacher(cfg)
    _say(f"distillation teacher: loading {teacher} (the lines below name it checkpoint.pretrained_checkpoint)")
    cfg.peft = None
    cfg.checkpoint = dataclasses.replace(state.cfg.checkpoint, pretrained_checkpoint=teacher, load=None,
                                         ckpt_step=None, finetune=False)
    with as_teacher(teacher), converted_for_loading(cfg.checkpoint, state.runtime.local_rank) as converted:
        if converted is not None:  # the import's run_config.yaml has every field, config.json only the mapped ones
            values = saved_model_values(require_checkpoint(Path(converted)).path)
        else:  # the common state is what the loader reads adapters by
            found = require_checkpoint(Path(teacher)).path
            refuse_adapters(teacher, found, adapter_metadata(found), None)
        config = teacher_config(cfg, values)
        cfg.derived = dataclasses.replace(state.cfg.derived, model=config)
        chunks = []
        for pre, post, stage in _pipeline_stages(cfg.model.virtual_pipeline_model_parallel_size):
            chunk = config.provide(pre_process=pre, post_process=post, vp_stage=stage).to(state.runtime.device)
            chunks.append(Float16Module(config, chunk) if config.fp16 or config.bf16 else chunk)
        load_checkpoint(GlobalState(cfg=cfg, runtime=state.runtime), chunks, None, None, weights_only=True,
                        pretrained=converted)
    for chunk in chunks:
        chunk.eval()
        chunk.requires_grad_(False)
    _say(f"distillation teacher: {teacher} ({config.num_layers} layers, hidden {config.hidden_size}), frozen: eval "
         "mode, no gradients, no optimizer state")
    return chunks


def _pipeline_stages(vpp: Optional[int]) -> list[tuple[bool, bool, Optional[int]]]:
    """(first stage, last stage, virtual stage) of each model chunk this rank holds, as the model's are built."""
    from megatron.core import parallel_state

    if not vpp:
        return [(parallel_state.is_pipeline_first_stage(), parallel_state.is_pipeline_last_stage(), None)]
    return [(parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=stage),
             parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=stage), stage)
            for stage in range(vpp)]


def _say(line: str) -> None:
    from bridge_cli.runtime.collectives import is_last_rank

    if is_last_rank():
        print(line, flush=True)
