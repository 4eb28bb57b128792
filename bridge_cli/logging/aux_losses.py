"""The auxiliary losses (MoE routers', multi-token prediction's) on the log line and in the metric
writers, as Megatron-LM's training_log does.

megatron-core's routers record each MoE layer's load-balancing loss (``load_balancing_loss``,
``seq_load_balancing_loss``, ``global_load_balancing_loss``) and ``z_loss`` in a tracker summed
over the step's micro-batches. ``track_moe_metrics`` (megatron-core 0.16 to 0.19) reduces it over
the pipeline and data-parallel ranks, writes the mean over MoE layers (and with
``model.moe_per_layer_logging`` each layer, ``moe/<name>_layer_<i>``) to a SummaryWriter-shaped
writer, adds it to a running dict, and clears the tracker. Multi-token prediction
(``model.mtp_num_layers``) records each MTP layer's loss (``mtp_<k> loss``, averaged over the
data-parallel ranks of the last pipeline stage) in a tracker of its own, which
``MTPLossLoggingHelper.track_mtp_metrics`` reads the same way. Both are collectives: every rank
calls ``after_step`` every step.
"""

from __future__ import annotations

import torch

from bridge_cli.models.moe_compat import router_loss_names


class _ScalarSink:
    """``add_scalar`` onto bridge's MetricWriter, so the values reach TensorBoard, W&B, MLflow and Comet."""

    def __init__(self, writer):
        self.writer = writer

    def add_scalar(self, name: str, value, step: int) -> None:
        self.writer.add_scalars({name: float(value)}, step)


class _Totals:
    """Running totals of tracked losses between two log lines."""

    def __init__(self):
        self.totals: dict[str, torch.Tensor] = {}

    def line_fields(self, iterations: int) -> tuple[str, ...]:
        """``name value`` per tracked loss, averaged over the ``iterations`` since the last line; resets."""
        fields = tuple(f"{name} {float(total) / iterations:.6f}" for name, total in self.totals.items())
        self.totals = {}
        return fields


class MoEMetrics(_Totals):
    def __init__(self, model_cfg):
        super().__init__()
        self.cfg = model_cfg
        self.track_names = router_loss_names(model_cfg)

    def after_step(self, step: int, num_microbatches: int, writer=None) -> None:
        """Fold this step's MoE losses into the interval totals; ``writer`` (on the writing rank, at
        writer steps) receives them too."""
        from megatron.core.transformer.moe.moe_utils import track_moe_metrics

        m = self.cfg
        track_moe_metrics(
            loss_scale=1.0 / num_microbatches, iteration=step, writer=_ScalarSink(writer) if writer else None,
            total_loss_dict=self.totals, per_layer_logging=bool(getattr(m, "moe_per_layer_logging", False)),
            force_initialize=True, track_names=self.track_names, num_layers=m.num_layers,
            moe_layer_freq=m.moe_layer_freq, mtp_num_layers=m.mtp_num_layers)


class MTPMetrics(_Totals):
    def after_step(self, step: int, num_microbatches: int, writer=None) -> None:
        """Fold this step's MTP losses into the interval totals (and ``writer``, as MoEMetrics)."""
        from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

        MTPLossLoggingHelper.track_mtp_metrics(loss_scale=1.0 / num_microbatches, iteration=step,
                                               writer=_ScalarSink(writer) if writer else None,
                                               total_loss_dict=self.totals)


def auxiliary_losses_for(model_cfg) -> list[_Totals]:
    """The tracker readers of this model: its MoE losses, its MTP losses, both or none."""
    return ([MoEMetrics(model_cfg)] if model_cfg.num_moe_experts else []) + (
        [MTPMetrics()] if model_cfg.mtp_num_layers else [])
