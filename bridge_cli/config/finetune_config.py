"""Fine-tuning objective sections: `finetune.objective` (sft, dpo or distill), DPO's settings (`dpo.*`) and
knowledge distillation's (`distill.*`)."""

import dataclasses
from dataclasses import dataclass
from typing import Optional

from bridge_cli.config.errors import ConfigError
from bridge_cli.config.fields import one_of


@dataclass
class FinetuneConfig:
    """What `bridge finetune` optimizes."""

    objective: str = one_of("sft", "sft", "dpo", "distill")
    """sft: next-token loss on the answers; dpo: Direct Preference Optimization on prompt/chosen/rejected records;
    distill: knowledge distillation from distill.teacher_checkpoint."""


@dataclass
class DPOConfig:
    """Direct Preference Optimization (finetune.objective=dpo); the reference is the starting model."""

    beta: float = 0.1
    """Rewards are beta x the log-ratio of policy to reference; a larger beta keeps the policy closer to it."""

    loss_type: str = one_of("sigmoid", "sigmoid", "ipo")
    """sigmoid: DPO's -log sigmoid(beta h); ipo: (h - 1/(2 beta))^2 on log-probs averaged over response tokens."""

    label_smoothing: float = 0.0
    """cDPO: the assumed chance eps that a pair's preference is flipped; loss (1-eps) L(h) + eps L(-h). sigmoid only."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        problems = []
        if self.beta <= 0:
            problems.append(("beta", f"must be > 0, got {self.beta}."))
        if not 0.0 <= self.label_smoothing < 0.5:
            problems.append(("label_smoothing", f"must be in [0, 0.5), got {self.label_smoothing}."))
        elif self.label_smoothing and self.loss_type == "ipo":
            problems.append(("label_smoothing", "applies to loss_type=sigmoid (cDPO); IPO has no label smoothing. "
                             "Set dpo.label_smoothing=0 or dpo.loss_type=sigmoid."))
        return problems


@dataclass
class DistillConfig:
    """Knowledge distillation (finetune.objective=distill): a frozen teacher's logits train the model."""

    teacher_checkpoint: Optional[str] = None
    """The teacher: a folder `bridge pretrain`/`finetune` saved (or one iter_* in it) or a Hugging Face model folder."""

    temperature: float = 1.0
    """Both softmaxes divide the logits by it; the KL term is scaled by temperature^2 (Hinton et al. 2015)."""

    ce_weight: float = 0.0
    """w in the loss (1 - w) T^2 KL(teacher || model) + w CE(labels): 0 distills only, 1 is plain SFT."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        problems = []
        if self.temperature <= 0:
            problems.append(("temperature", f"must be > 0, got {self.temperature}."))
        if not 0.0 <= self.ce_weight <= 1.0:
            problems.append(("ce_weight", f"must be in [0, 1], got {self.ce_weight}."))
        return problems


def check_objective(cfg) -> None:
    """Cross-section rules of the objective: dpo.* only with objective=dpo and distill.* only with
    objective=distill; what DPO and distillation run with and on."""
    objective = cfg.finetune.objective
    for section, owner, what in (("dpo", "dpo", "train on preference pairs"),
                                 ("distill", "distill", "distill a teacher")):
        if objective != owner:
            values = getattr(cfg, section)
            for f in dataclasses.fields(values):
                if getattr(values, f.name) != f.default:
                    raise ConfigError(f"{section}.{f.name}", f"is set, but finetune.objective is {objective}.",
                                      f"Set finetune.objective={owner} to {what}, or drop the {section} override.")
    if objective == "distill":
        _refuse_layouts(cfg.model, objective, "distillation under context parallelism is not supported yet")
    if objective != "dpo":
        return
    from bridge_cli.config.data_configs import FinetuningDatasetConfig

    if not isinstance(cfg.dataset, FinetuningDatasetConfig):
        raise ConfigError("dataset", "finetune.objective=dpo reads preference records (prompt, chosen, rejected) "
                          "from JSONL files.", "Add dataset=finetune dataset.dataset_root=DIR.")
    _refuse_layouts(cfg.model, objective,
                    "DPO sums each response's log-probabilities within a rank, which context parallelism splits")
    pack = cfg.dataset.packed_sequence_specs.packed_sequence_size
    if 0 < pack < 4:
        raise ConfigError("dataset.packed_sequence_specs.packed_sequence_size",
                          f"is {pack}; with finetune.objective=dpo a pack holds whole pairs, each response at "
                          "most half the pack.", "Pack at least 4 tokens, or set it to -1 (no packing).")


def _refuse_layouts(m, objective: str, why_context: str) -> None:
    """Context parallelism, and multi-token prediction, which the objective does not train. (Pipeline parallelism
    runs the frozen model in the same schedule: bridge_cli/training/frozen_pipeline.py.)"""
    if m.context_parallel_size > 1:
        key = "model.context_parallel_size"
        raise ConfigError(key, f"is {m.context_parallel_size} with finetune.objective={objective}: {why_context}.",
                          f"Set {key}=1.")
    if m.mtp_num_layers:
        raise ConfigError("model.mtp_num_layers", f"adds a next-token loss, which finetune.objective={objective} "
                          "does not train.", "Set model.mtp_num_layers=null.")
