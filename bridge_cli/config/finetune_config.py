"""Fine-tuning objective sections: `finetune.objective` (sft or dpo) and DPO's settings (`dpo.*`)."""

import dataclasses
from dataclasses import dataclass

from bridge_cli.config.errors import ConfigError
from bridge_cli.config.fields import one_of


@dataclass
class FinetuneConfig:
    """What `bridge finetune` optimizes."""

    objective: str = one_of("sft", "sft", "dpo")
    """sft: next-token loss on the answers; dpo: Direct Preference Optimization on prompt/chosen/rejected records."""


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


def check_objective(cfg) -> None:
    """Cross-section rules of the objective: dpo.* only with objective=dpo; what DPO runs with and on."""
    objective = cfg.finetune.objective
    if objective != "dpo":
        for f in dataclasses.fields(cfg.dpo):
            if getattr(cfg.dpo, f.name) != f.default:
                raise ConfigError(f"dpo.{f.name}", f"is set, but finetune.objective is {objective}.",
                                  "Set finetune.objective=dpo to train on preference pairs, or drop the dpo override.")
        return
    from bridge_cli.config.data_configs import FinetuningDatasetConfig

    if not isinstance(cfg.dataset, FinetuningDatasetConfig):
        raise ConfigError("dataset", "finetune.objective=dpo reads preference records (prompt, chosen, rejected) "
                          "from JSONL files.", "Add dataset=finetune dataset.dataset_root=DIR.")
    m = cfg.model
    for key, value, why in (
            ("model.pipeline_model_parallel_size", m.pipeline_model_parallel_size,
             "DPO under pipeline parallelism is not supported yet"),
            ("model.context_parallel_size", m.context_parallel_size,
             "DPO sums each response's log-probabilities within a rank, which context parallelism splits")):
        if value > 1:
            raise ConfigError(key, f"is {value} with finetune.objective=dpo: {why}.", f"Set {key}=1.")
    if m.mtp_num_layers:
        raise ConfigError("model.mtp_num_layers", "adds a next-token loss, which finetune.objective=dpo does not "
                          "train.", "Set model.mtp_num_layers=null.")
    pack = cfg.dataset.packed_sequence_specs.packed_sequence_size
    if 0 < pack < 4:
        raise ConfigError("dataset.packed_sequence_specs.packed_sequence_size",
                          f"is {pack}; with finetune.objective=dpo a pack holds whole pairs, each response at "
                          "most half the pack.", "Pack at least 4 tokens, or set it to -1 (no packing).")
