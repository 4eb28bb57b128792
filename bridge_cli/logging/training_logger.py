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
from bridge_cli.logging.reports import calc_params_l2_norm, report_memory, report_throughput
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


def memory_report(when: str) -> str:
    """This rank's CUDA memory, in GiB."""
    gib = 2 ** 30
    return (f"memory {when} (rank {dist.get_rank()}): allocated {torch.cuda.memory_allocated() / gib:.2f} GiB | "
            f"peak allocated {torch.cuda.max_memory_allocated() / gib:.2f} GiB | "
            f"reserved {torch.cuda.memory_reserved() / gib:.2f} GiB")


class TrainingLogger:
    def __init__(self, global_state, model: list):
        self.state = global_state
        self.cfg = global_state.cfg
        self.model = model
        from bridge_cli.training.utils.train_utils import is_last_rank

        self.is_logging_rank = is_last_rank()
        ts = global_state.train_state
        self.console = ConsoleLog(self.cfg.train.train_iters, ts.step, enabled=self.is_logging_rank,
                                  peak_tflops=peak_tflops(self.cfg.logger.gpu_peak_tflops))
        self.writer = MetricWriter(self.cfg.logger, run_config=self.cfg.to_dict(), enabled=self.is_logging_rank)
        self.stats = IntervalStats()
        self.first_iter, self.run_started = ts.step, time.time()
        self.history_wct: list[float] = [self.run_started]

    def exclude(self, seconds: float) -> None:
        """Time spent evaluating or checkpointing does not count into ms/iter and tokens/s."""
        self.stats.started += seconds
        self.history_wct = [t + seconds for t in self.history_wct]

    def after_step(self, loss_dict: dict, skipped: int, grad_norm: Optional[float], num_zeros: Optional[int],
                   optimizer, batch_size: int, flops: float) -> None:
        cfg, ts, log = self.cfg, self.state.train_state, self.cfg.logger
        self.stats.add(loss_dict, skipped)
        if grad_norm is not None and not math.isfinite(grad_norm):
            self.stats.nan_or_inf += 1  # fp16: the loss scaler skipped this step
        self.history_wct.append(time.time())
        if ts.step == self.first_iter + 1 and self.state.runtime.is_cuda:
            self.console.print(memory_report("after the first step"))
        params_norm = calc_params_l2_norm(self.model) if log.log_params_norm and ts.step % log.log_interval == 0 else None
        if self.writer.active and ts.step % log.tensorboard_log_interval == 0:
            self._write_scalars(loss_dict, grad_norm, num_zeros, params_norm, optimizer, batch_size, flops)
        if ts.step % log.log_interval == 0:
            loss = self.console.training_line(
                ts.step, self.stats, ts.consumed_train_samples, optimizer.param_groups[0]["lr"], grad_norm,
                float(optimizer.get_loss_scale()), batch_size * cfg.model.seq_length, flops, dist.get_world_size(),
                time.time() - self.run_started, self.first_iter, params_norm)
            if loss is not None and not math.isfinite(loss):
                raise TrainingDiverged(f"iteration {ts.step}: the loss is {loss}. Lower optimizer.lr or check the data.")
            self.console.advance(ts.step, loss)
            self.stats = IntervalStats()
        else:
            self.console.advance(ts.step)

    def _write_scalars(self, loss_dict, grad_norm, num_zeros, params_norm, optimizer, batch_size, flops) -> None:
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
            values.update(report_throughput(step, batch_size, cfg.model.seq_length, self.history_wct,
                                            log.log_interval, dist.get_world_size()))
        if log.log_memory_to_tensorboard:
            values.update(report_memory())
        self.writer.add_scalars(values, step)
        vs_samples = ("learning-rate", "batch-size", "grad-norm", "loss-scale", *loss_dict)
        self.writer.add_scalars({f"{k} vs samples": values[k] for k in vs_samples if values.get(k) is not None}, samples)

    def validation(self, label: str, results: dict[str, float], split: str = "validation") -> None:
        from bridge_cli.training.utils.train_utils import perplexity

        if not results:
            return
        self.console.print(f"{label} | " + " | ".join(
            f"{k} {v:.6f} | {k} PPL {perplexity(v):.3f}" for k, v in results.items()))
        ts = self.state.train_state
        values = {f"{k} {split}": v for k, v in results.items()}
        if self.cfg.logger.log_validation_ppl_to_tensorboard:
            values.update({f"{k} {split} ppl": perplexity(v) for k, v in results.items()})
        self.writer.add_scalars(values, ts.step)
        self.writer.add_scalars({f"{k} vs samples": v for k, v in values.items()}, ts.consumed_train_samples)

    def close(self) -> None:
        if self.state.runtime.is_cuda:
            self.console.print(memory_report("at the end of training"))
        self.console.close()
        self.writer.close()
