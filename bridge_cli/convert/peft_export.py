"""`bridge peft export-hf`: a LoRA run's adapters -> a Hugging Face PEFT folder.

The folder holds ``adapter_config.json`` (``peft_type`` LORA, ``r`` = ``peft.dim``, ``lora_alpha`` =
``peft.alpha``, ``lora_dropout``, ``target_modules`` in the Hugging Face module names) and
``adapter_model.safetensors`` (``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``), so
``peft.PeftModel.from_pretrained(base, DIR)`` puts the adapters on the base model ``export-hf`` writes.

An adapter on a fused megatron-core projection (``linear_qkv``, SwiGLU's ``linear_fc1``) is one A ``[r, in]`` and
one B ``[out, r]`` whose rows follow the layer's weight. Each row of ``B A`` is that row of B times A, so B's
rows are rearranged exactly as the family rearranges the weight's (:func:`~bridge_cli.convert.hf_weights.to_hf`:
q/k/v out of the per-group interleave, gate and up apart, or kept fused for Phi-3's ``qkv_proj``) and every
Hugging Face module gets its rows of B and the whole A: the same ``(alpha / r) B A``, module by module.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

from bridge_cli.checkpoint import layout, verify
from bridge_cli.checkpoint.errors import CheckpointError
from bridge_cli.convert import families
from bridge_cli.convert.hf_files import check_output_free, staged, write_safetensors

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
ONE_FILE = 2**62
"""PEFT reads one adapter_model.safetensors: no size splits it."""
PREFIX = "base_model.model."
"""PEFT's prefix of a module's name in a saved adapter (its PeftModel wraps the transformers model)."""


@dataclass(frozen=True)
class ExportedAdapters:
    """What a PEFT export wrote, for the summary the CLI prints."""

    checkpoint: Path
    out_dir: Path
    model_type: str
    target_modules: list[str]


def export_peft(ckpt_dir: Path, out_dir: Path, step: Optional[int] = None, model_type: Optional[str] = None,
                base_model: Optional[str] = None) -> ExportedAdapters:
    """Write the LoRA adapters of the checkpoint under ``ckpt_dir`` (its latest, or iteration ``step``) into
    ``out_dir`` (new or empty) as a PEFT folder for the family ``model_type`` (default: as ``export-hf`` picks it);
    ``base_model`` is written as ``base_model_name_or_path``."""
    from bridge_cli.checkpoint.load import adapter_metadata
    from bridge_cli.config import mcore_schema
    from bridge_cli.config.peft_config import LoRAConfig
    from bridge_cli.convert import mcore_io
    from bridge_cli.convert.hf_weights import TRANSPOSES, Architecture
    from bridge_cli.models.provider import GPTModelProvider
    from bridge_cli.peft.lora import LoRAAdapter, apply_lora, is_adapter_key

    out_dir = Path(out_dir)
    check_output_free(out_dir)
    path = layout.require_checkpoint(Path(ckpt_dir), step).path
    saved = adapter_metadata(path)
    if saved is None:
        raise CheckpointError(
            f"{path} holds a whole model, not LoRA adapters, so there is no adapter to write as a PEFT folder. Give "
            f"the checkpoint.save folder of a peft=lora run, or export this model with `bridge convert-ckpt "
            f"export-hf {ckpt_dir} {out_dir}`.")
    lora = LoRAConfig(**{key: saved[key] for key in LoRAConfig.__dataclass_fields__ if key in saved})
    model_cfg = mcore_io.model_config(mcore_io.saved_model_values(path))
    values = mcore_schema.to_yaml_values("model", GPTModelProvider, model_cfg)
    recorded = ((verify.saved_config(path) or {}).get("checkpoint") or {}).get("export_hf_model_type")
    family = families.for_export(values, model_type, path, recorded)
    arch = Architecture.of(model_cfg)
    _refuse_experts(path, lora, arch)
    pairs = {pair.mcore_names[0]: pair for pair in family.pairs(arch)}

    mcore_io.init_process()
    model = mcore_io.build_model(model_cfg)
    apply_lora([model], lora, seed=0)  # the adapters' modules, to read them into; A is drawn and overwritten
    adapted = [name for name, module in model.named_modules() if isinstance(module, LoRAAdapter)]
    targets = {name: _hf_modules(pairs, name.rsplit(".", 1)[0], path) for name in adapted}
    tensors, modules = {}, set()
    for group in mcore_io.stream_weights(model, model_cfg, path, select=is_adapter_key):
        for name in [name for name in adapted if f"{name}.linear_in.weight" in group]:
            a, b = group[f"{name}.linear_in.weight"], group[f"{name}.linear_out.weight"]
            for module, rows in _split_b(targets[name], b, arch):
                tensors[f"{PREFIX}{module}.lora_A.weight"] = a.clone()
                tensors[f"{PREFIX}{module}.lora_B.weight"] = rows
                modules.add(module.rsplit(".", 1)[-1])

    config = peft_config(lora, sorted(modules), base_model,
                         fan_in_fan_out=any(targets[name][0].layout in TRANSPOSES for name in adapted))
    with staged(out_dir) as staging:
        (staging / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
        (written,) = write_safetensors(staging, tensors.items(), max_shard_bytes=ONE_FILE)
        written.rename(staging / WEIGHTS)
    return ExportedAdapters(path, out_dir, family.model_type, config["target_modules"])


def peft_config(lora, target_modules: list[str], base_model: Optional[str], fan_in_fan_out: bool) -> dict:
    """The ``adapter_config.json`` of LoRA adapters with settings ``lora`` on ``target_modules`` (PEFT's LoraConfig
    fields; PEFT fills in the rest with its defaults)."""
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
            "r": lora.dim, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "target_modules": target_modules,
            "bias": "none", "fan_in_fan_out": fan_in_fan_out, "use_rslora": False, "use_dora": False,
            "modules_to_save": None, "inference_mode": True}


def _refuse_experts(path: Path, lora, arch) -> None:
    """PEFT adapts Linear modules, and transformers holds a layer's routed experts as stacked parameters."""
    on_experts = [name for name in lora.target_modules if name in ("linear_fc1", "linear_fc2")]
    if arch.num_experts and on_experts:
        raise CheckpointError(
            f"{path}: its LoRA adapters include the routed experts' {'/'.join(on_experts)} (peft.target_modules "
            f"{list(lora.target_modules)} on a model with {arch.num_experts} experts per MoE layer), which a PEFT "
            "folder cannot hold: transformers keeps a layer's experts as stacked parameters (MixtralExperts' "
            "gate_up_proj and down_proj, say), not as the Linear modules PEFT's LoRA adapts. Merge the adapters "
            "instead (`bridge peft merge`, then `bridge convert-ckpt export-hf` of the merged checkpoint), or train "
            "them with peft.target_modules=[linear_qkv,linear_proj].")


def _hf_modules(pairs: dict, module: str, path: Path):
    """The family's Pair of the weight of megatron-core's ``module``: the Hugging Face modules that weight becomes."""
    from bridge_cli.convert.hf_weights import TRANSPOSES, Layout

    pair = pairs.get(f"{module}.weight")
    allowed = (Layout.SAME, Layout.QKV, Layout.FUSED_QKV, Layout.GATE_UP, *TRANSPOSES)
    if pair is None or pair.layout not in allowed:
        why = ("no tensor of the family holds its weight" if pair is None else
               f"the family stores its weight in the {pair.layout.value} layout")
        raise CheckpointError(f"{path}: the adapter on {module} has no Hugging Face Linear module to go on ({why}), "
                              "so a PEFT folder cannot hold it. Merge the adapters instead (`bridge peft merge`).")
    return pair, [name.removesuffix(".weight") for name in pair.hf_names]


def _split_b(target, b, arch):
    """(Hugging Face module, its rows of B) for one adapter: B's rows rearranged as its layer's weight rows are."""
    from bridge_cli.convert.hf_weights import TRANSPOSES, to_hf

    pair, modules = target
    # a Conv1D stores its weight [in, out], but PEFT's lora_B is [out, r] on it too: rearrange B as [out, in] rows
    rows = to_hf(replace(pair, layout=TRANSPOSES.get(pair.layout, pair.layout)), [b], arch)
    return zip(modules, rows)
