"""The range of every numeric field a run can get wrong, checked once by the validation pass.

A value outside its range is a ConfigError naming the full key and the range, before any process
group or model exists; megatron-core and torch would otherwise fail later with a traceback (a
negative learning rate, a dropout of 2), hang (``train.train_iters=1e30``) or kill the process
(``model.seq_length=0``). None (unset) is always allowed; floats must also be finite.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional

from bridge_cli.config.errors import ConfigError


@dataclass(frozen=True)
class Range:
    low: Optional[float] = None
    high: Optional[float] = None
    low_open: bool = False
    """True: low itself is outside the range."""
    high_open: bool = False
    """True: high itself is outside the range."""

    def holds(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or not (value > self.high or (self.high_open and value == self.high))

    def describe(self) -> str:
        low = "" if self.low is None else f"{'>' if self.low_open else '>='} {self.low:g}"
        high = "" if self.high is None else f"{'<' if self.high_open else '<='} {self.high:g}"
        return "must be a finite number " + " and ".join(part for part in (low, high) if part)


AT_LEAST_0, AT_LEAST_1, POSITIVE = Range(0), Range(1), Range(0, low_open=True)
PROBABILITY = Range(0, 1)
BETA = Range(0, 1, high_open=True)

MAX_ITERATIONS = 10**10
"""More than any run: megatron-core sizes its dataset indices by iterations x global batch."""

RANGES: dict[str, Range] = {
    "model.num_layers": AT_LEAST_1, "model.hidden_size": AT_LEAST_1, "model.num_attention_heads": AT_LEAST_1,
    "model.num_query_groups": AT_LEAST_1, "model.ffn_hidden_size": AT_LEAST_1, "model.kv_channels": AT_LEAST_1,
    "model.seq_length": AT_LEAST_1, "model.linear_cross_entropy_chunk": AT_LEAST_1, "model.vocab_size": AT_LEAST_1, "model.make_vocab_size_divisible_by": AT_LEAST_1,
    "model.hidden_dropout": PROBABILITY, "model.attention_dropout": PROBABILITY, "model.init_method_std": AT_LEAST_0,
    "model.layernorm_epsilon": POSITIVE, "model.rotary_base": POSITIVE, "model.rotary_percent": Range(0, 1, low_open=True),
    "model.tensor_model_parallel_size": AT_LEAST_1, "model.pipeline_model_parallel_size": AT_LEAST_1,
    "model.context_parallel_size": AT_LEAST_1, "model.expert_model_parallel_size": AT_LEAST_1,
    "model.virtual_pipeline_model_parallel_size": AT_LEAST_1,
    "model.attn_logit_softcapping": POSITIVE, "model.final_logit_softcapping": POSITIVE,
    "optimizer.lr": AT_LEAST_0, "optimizer.min_lr": AT_LEAST_0, "optimizer.weight_decay": AT_LEAST_0,
    "optimizer.adam_beta1": BETA, "optimizer.adam_beta2": BETA, "optimizer.adam_eps": POSITIVE,
    "optimizer.sgd_momentum": PROBABILITY, "optimizer.clip_grad": AT_LEAST_0, "optimizer.initial_loss_scale": POSITIVE,
    "optimizer.min_loss_scale": POSITIVE, "optimizer.loss_scale": POSITIVE,
    "scheduler.lr_warmup_iters": AT_LEAST_0, "scheduler.lr_warmup_fraction": PROBABILITY,
    "scheduler.lr_decay_iters": AT_LEAST_1, "scheduler.lr_wsd_decay_iters": AT_LEAST_1,
    "scheduler.lr_warmup_init": AT_LEAST_0, "scheduler.start_weight_decay": AT_LEAST_0,
    "scheduler.end_weight_decay": AT_LEAST_0,
    "train.train_iters": Range(1, MAX_ITERATIONS), "train.micro_batch_size": AT_LEAST_1,
    "train.global_batch_size": AT_LEAST_1, "train.eval_iters": AT_LEAST_0, "train.eval_interval": AT_LEAST_0,
    "train.exit_interval": AT_LEAST_1, "train.exit_duration_in_mins": AT_LEAST_1, "train.manual_gc_interval": AT_LEAST_0,
    "train.train_sync_interval": AT_LEAST_1, "train.check_weight_hash_across_dp_replicas_interval": AT_LEAST_1,
    "rng.seed": Range(0, 2**32 - 1),
    "dataset.num_workers": AT_LEAST_0, "dataset.seq_length": AT_LEAST_1, "dataset.random_seed": Range(0, 2**32 - 1),
    "logger.log_interval": AT_LEAST_1, "logger.tensorboard_log_interval": AT_LEAST_1,
    "dist.distributed_timeout_minutes": AT_LEAST_1,
    "checkpoint.save_interval": AT_LEAST_1, "checkpoint.non_persistent_save_interval": AT_LEAST_1,
    "rerun_state_machine.error_injection_rate": AT_LEAST_0,
    "straggler.straggler_ctrlr_port": Range(1, 65535), "straggler.straggler_minmax_count": AT_LEAST_1,
}
"""Full key -> its range."""


def check_ranges(cfg: Any) -> None:
    """Raise ConfigError for the first field of RANGES whose value in ``cfg`` is outside its range."""
    for section in dict.fromkeys(key.split(".")[0] for key in RANGES):
        obj = getattr(cfg, section, None)
        if obj is not None:
            check_values(section, vars(obj))


def check_values(section: str, values: dict[str, Any]) -> None:
    """The same for one section's raw values; megatron-core's config classes get them checked before
    their ``__post_init__`` divides by a head count or a size."""
    for key, allowed in RANGES.items():
        if not key.startswith(section + "."):
            continue
        value = values.get(key.split(".")[1])
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        if not allowed.holds(value):
            raise ConfigError(key, f"{allowed.describe()}, got {value!r}.")
