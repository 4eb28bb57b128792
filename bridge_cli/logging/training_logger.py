"""What train() reports each step: the console line, TensorBoard/W&B scalars, memory and throughput.

Every rank calls it (the params norm is a collective); only the last rank, which holds the loss
on the last pipeline stage, prints and writes.
"""

from __future__ import annotations

import math
import time
from typing import Optional

import torch
import torch.distributed as dist

from bridge_cli.logging.console import ConsoleLog, IntervalStats
from bridge_cli.logging.aux_losses import auxiliary_losses_for
from bridge_cli.logging.reports import (
    calc_params_l2_norm,
    report_l2_norm_grad,
    report_memory,
    report_runtime,
    report_throughput,
)
from bridge_cli.logging.timers import interval_report
from bridge_cli.logging.writers import MetricWriter

PEAK_BF16_TFLOPS = {"GB200": 2500.0, "B200": 2250.0, "H200": 989.0, "H100": 989.0, "H800": 989.0,
                    "A100": 312.0, "A800": 312.0, "L40S": 362.0, "L4": 121.0, "A10": 125.0}
"""Dense bf16 peak per GPU by name fragment; logger.gpu_peak_tflops overrides it."""


class TrainingDiverged(RuntimeError):
    """The loss or gradient became NaN/Inf; the message names the iteration."""


def peak_tflops(configured: Optional[float]) -> Optional[float]:
    if configured:
        return configured
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    return next((peak for fragment, peak in PEAK_BF16_TFLOPS.items() if fragment in name), None)


def memory_report(when: str, across_pipeline: bool = True) -> str:
    """CUDA memory in GiB; ``across_pipeline``: the maximum over pipeline stages (the first stage
    usually peaks highest), a collective over the pipeline group, so only where every rank calls it."""
    from megatron.core import parallel_state

    from bridge_cli.runtime.collectives import reduce_max_memory_across_pp_group

    gib = 2 ** 30
    memory = {"allocated": torch.cuda.memory_allocated() / gib, "peak allocated": torch.cuda.max_memory_allocated() / gib,
              "reserved": torch.cuda.memory_reserved() / gib}
    stages = parallel_state.get_pipeline_model_parallel_world_size() if across_pipeline else 1
    if stages > 1:
        memory = reduce_max_memory_across_pp_group(memory, parallel_state.get_pipeline_model_parallel_group())
    where = f"max over {stages} pipeline stages" if stages > 1 else f"rank {dist.get_rank()}"
    return f"memory {when} ({where}): " + " | ".join(f"{k} {v:.2f} GiB" for k, v in memory.items())


EP_LOAD = "moe/ep-load-max-over-mean"
"""The expert work expert-parallel ranks wait for over the work they have, exchange by exchange
(bridge_cli/logging/expert_load.py)."""


class TrainingLogger:
    def __init__(self, global_state, model: list):
        self.state = global_state
        self.cfg = global_state.cfg
        self.model = model
        from bridge_cli.runtime.collectives import is_last_rank

        self.is_logging_rank = is_last_rank()
        ts = global_state.train_state
        self.console = ConsoleLog(self.cfg.train.train_iters, ts.step, enabled=self.is_logging_rank,
                                  peak_tflops=peak_tflops(self.cfg.logger.gpu_peak_tflops))
        self.writer = MetricWriter(self.cfg.logger, run_config=self.cfg.run_record(), enabled=self.is_logging_rank)
        self.stats = IntervalStats()
        self.first_iter, self.run_started = ts.step, time.time()
        self.history_wct: list[float] = [self.run_started]
        self.timers = global_state.timers
        self.aux_losses = auxiliary_losses_for(self.cfg.model)
        self.expert_load = None
        if self.cfg.model.num_moe_experts:
            from bridge_cli.logging.expert_load import ExpertLoad

            self.expert_load = ExpertLoad.of(model)
        from bridge_cli.data.preference import rows_per_sample

        self.tokens_per_sample = self.cfg.model.seq_length * rows_per_sample(self.cfg)
        """What tokens/s counts per sample: the rows the model runs (DPO's unpacked pair is two)."""
        self.stragglers = None
        if global_state.straggler_timer is not None:
            from bridge_cli.logging.stragglers import StragglerReport

            self.stragglers = StragglerReport(global_state.straggler_timer, self.cfg.logger.log_interval)
        self.energy = None
        if self.cfg.logger.log_energy:
            from bridge_cli.logging.energy import EnergyMonitor

            self.energy = EnergyMonitor(global_state.runtime.device)

    def exclude(self, seconds: float) -> None:
        """Time spent evaluating or checkpointing does not count into ms/iter and tokens/s."""
        self.stats.started += seconds
        self.history_wct = [t + seconds for t in self.history_wct]

    def after_step(self, loss_dict: dict, skipped: int, grad_norm: Optional[float], num_zeros: Optional[int],
                   optimizer, batch_size: int, flops: float) -> None:
        ts, log = self.state.train_state, self.cfg.logger
        self.stats.add(loss_dict, skipped)
        if grad_norm is not None and not math.isfinite(grad_norm):
            self.stats.nan_or_inf += 1  # fp16: the loss scaler skipped this step
        self.history_wct.append(time.time())
        if ts.step == self.first_iter + 1 and self.state.runtime.is_cuda:
            self.console.print(memory_report("after the first step"))
        log_step = ts.step % log.log_interval == 0
        write_step = ts.step % log.tensorboard_log_interval == 0
        # Collectives first, on every rank at the same steps; only the logging rank prints and writes.
        params_norm = calc_params_l2_norm(self.model) if log.log_params_norm and log_step else None
        if self.stragglers is not None:
            self.stragglers.after_step(ts.step, flops)
        collected = self._collect(log_step, write_step)
        if self.aux_losses:
            from megatron.core.num_microbatches_calculator import get_num_microbatches

            for losses in self.aux_losses:
                losses.after_step(ts.step, get_num_microbatches(), self.writer if self.writer.active and write_step else None)
        if self.writer.active and write_step:
            self._write_scalars(loss_dict, grad_norm, num_zeros, params_norm, optimizer, batch_size, flops, collected)
        if not log_step:
            self.console.advance(ts.step)
            return
        extra = ()
        if "energy" in collected:
            extra = (f"energy/gpu {collected['iter-energy/gpu']:.1f} J/iter", f"power/gpu {collected['power/gpu']:.0f} W")
        for losses in self.aux_losses:
            extra += losses.line_fields(self.stats.iterations)
        if EP_LOAD in collected:
            extra += (f"ep load max/mean {collected[EP_LOAD]:.3f}",)
        loss = self.console.training_line(
            ts.step, self.stats, ts.consumed_train_samples, optimizer.param_groups[0]["lr"], grad_norm,
            float(optimizer.get_loss_scale()), batch_size * self.tokens_per_sample, flops, dist.get_world_size(),
            time.time() - self.run_started, self.first_iter, params_norm, extra)
        if collected.get("timers"):
            self.console.print(collected["timers"])
        if loss is not None and not math.isfinite(loss):
            raise TrainingDiverged(f"iteration {ts.step}: the loss is {loss}. Lower optimizer.lr or check the data.")
        self.console.advance(ts.step, loss)
        self.stats = IntervalStats()

    def _collect(self, log_step: bool, write_step: bool) -> dict:
        """The reports that need every rank: timers and energy each log interval; gradient norms and
        memory (max over pipeline stages) each metric-writer interval."""
        from megatron.core import parallel_state

        from bridge_cli.runtime.collectives import reduce_max_memory_across_pp_group

        log, collected = self.cfg.logger, {}
        if log_step and self.timers is not None:
            collected["timers"], timer_scalars = interval_report(self.timers, log.log_interval)
            if log.log_timers_to_tensorboard:
                collected.update(timer_scalars)
        if log_step and self.expert_load is not None:
            collected[EP_LOAD] = self.expert_load.lap()
        if log_step and self.energy is not None:
            joules, seconds = self.energy.lap()
            world = dist.get_world_size()
            collected.update({"energy": joules, "iter-energy/gpu": joules / world / self.stats.iterations,
                              "power/gpu": joules / world / seconds})
        if not write_step:
            return collected
        if log.log_l2_norm_grad_to_tensorboard:
            collected.update(report_l2_norm_grad(self.model))
        if log.log_memory_to_tensorboard:
            collected.update(reduce_max_memory_across_pp_group(
                report_memory(), parallel_state.get_pipeline_model_parallel_group()))
        return collected

    def _write_scalars(self, loss_dict, grad_norm, num_zeros, params_norm, optimizer, batch_size, flops,
                       collected: dict) -> None:
        cfg, ts, log = self.cfg, self.state.train_state, self.cfg.logger
        step, samples = ts.step, ts.consumed_train_samples
        values = {"learning-rate": optimizer.param_groups[0]["lr"], "batch-size": batch_size,
                  "grad-norm": grad_norm, "num-zeros": num_zeros, "params-norm": params_norm}
        values.update({key: float(value) for key, value in loss_dict.items()})
        if log.log_loss_scale_to_tensorboard:
            values["loss-scale"] = float(optimizer.get_loss_scale())
        if log.log_world_size_to_tensorboard:
            values["world-size"] = dist.get_world_size()
        iteration_time = self.history_wct[-1] - self.history_wct[-2]
        if log.log_timers_to_tensorboard:
            values["iteration-time"] = iteration_time
        if log.log_throughput:
            values["throughput"] = flops / iteration_time / dist.get_world_size() / 1e12
            values.update(report_throughput(step, batch_size, self.tokens_per_sample, self.history_wct,
                                            log.log_interval, dist.get_world_size()))
        if log.log_runtime_to_tensorboard:
            values.update(report_runtime(step, samples, self.run_started, cfg.model.seq_length,
                                         cfg.train.train_iters, self.first_iter, log.runtime_time_unit))
        values.update({k: v for k, v in collected.items() if k not in ("timers", "energy")})
        self.writer.add_scalars(values, step)
        vs_samples = ("learning-rate", "batch-size", "grad-norm", "loss-scale", *loss_dict)
        self.writer.add_scalars({f"{k} vs samples": values[k] for k in vs_samples if values.get(k) is not None}, samples)

    def validation(self, label: str, results: dict[str, float], split: str = "validation") -> None:
        from bridge_cli.logging.reports import is_cross_entropy, perplexity

        if not results:
            return
        self.console.print(f"{label} | " + " | ".join(
            f"{k} {v:.6f}" + (f" | {k} PPL {perplexity(v):.3f}" if is_cross_entropy(k) else "")
            for k, v in results.items()))
        ts = self.state.train_state
        values = {f"{k} {split}": v for k, v in results.items()}
        if self.cfg.logger.log_validation_ppl_to_tensorboard:
            values.update({f"{k} {split} ppl": perplexity(v) for k, v in results.items() if is_cross_entropy(k)})
        self.writer.add_scalars(values, ts.step)
        self.writer.add_scalars({f"{k} vs samples": v for k, v in values.items()}, ts.consumed_train_samples)

    def close(self) -> None:
        if self.state.runtime.is_cuda:
            # Local only: close() also runs when one rank stopped early (a NaN loss), where a collective would hang.
            self.console.print(memory_report("at the end of training", across_pipeline=False))
        self.console.close()
        self.writer.close()
