"""Run by test_distill.py in its own process: the teacher through the library API.

    python tests/integration/distill_worker.py TEACHER DATA

FROZEN: after three distillation steps the teacher is in eval mode, has no parameter that requires a
gradient or holds one, its
weights are bitwise those it was loaded with, and the model's have moved.
OPTIMIZER: the optimizer holds as many elements as the model has, none of the teacher's (so no state for it).
SHAPES: the teacher has its own shape (the tiny recipe's two layers of 128) beside the model's (tiny_distill:
one layer of 64).
"""

from __future__ import annotations

import sys

import torch

from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer


def main(teacher: str, data: str) -> None:
    from bridge_cli.training.distill_step import DistillForwardStep
    from bridge_cli.training.pretrain import run_session
    from bridge_cli.training.setup import setup
    from bridge_cli.training.train import train_step
    from bridge_cli.training.utils.train_utils import prepare_forward_step_func

    cfg = ConfigContainer.from_yaml_dict(compose("tiny_distill", [
        f"dataset.dataset_root={data}", f"distill.teacher_checkpoint={teacher}", "train.train_iters=4"]))
    with run_session(cfg) as state:
        out = setup(state)
        distill = DistillForwardStep()
        step = prepare_forward_step_func(distill, state)
        train_step(step, out.train_data_iterator, out.model, out.optimizer, out.scheduler, state)
        loaded = {name: p.detach().clone() for name, p in distill.teacher[0].named_parameters()}
        student = {name: p.detach().clone() for name, p in out.model[0].named_parameters()}
        for _ in range(2):
            train_step(step, out.train_data_iterator, out.model, out.optimizer, out.scheduler, state)
        teacher = distill.teacher[0]
        params = dict(teacher.named_parameters())
        optimized = sum(p.numel() for group in out.optimizer.param_groups for p in group["params"])
        unchanged = all(torch.equal(loaded[name], p) for name, p in params.items())
        moved = sum(not torch.equal(student[name], p) for name, p in out.model[0].named_parameters())
        print(f"FROZEN eval={not teacher.training and not any(m.training for m in teacher.modules())} "
              f"requires_grad={sum(p.requires_grad for p in params.values())} "
              f"grads={sum(p.grad is not None for p in params.values())} "
              f"unchanged={unchanged} student_moved={moved > 0}")
        print(f"OPTIMIZER elements={optimized} student={sum(p.numel() for p in out.model[0].parameters())} "
              f"teacher={sum(p.numel() for p in params.values())}")
        print(f"SHAPES teacher={teacher.config.num_layers}x{teacher.config.hidden_size} "
              f"student={cfg.model.num_layers}x{cfg.model.hidden_size}")


if __name__ == "__main__":
    main(*sys.argv[1:])
