"""Run pretrain() from Python with each forward-step signature and loss pattern.

Prints "VARIANT <name>" before each run; the runs' own log lines (log_interval=1) carry the
losses. Used by test_pretrain_cpu.py in one subprocess, so megatron-core is imported once.
"""

from __future__ import annotations

import functools
import sys

from bridge_cli.config.compose import compose
from bridge_cli.training.config import ConfigContainer
from bridge_cli.training.gpt_step import forward_step, get_batch
from bridge_cli.training.losses import masked_next_token_loss
from bridge_cli.training.pretrain import pretrain
from bridge_cli.training.state import GlobalState


def config() -> ConfigContainer:
    return ConfigContainer.from_yaml_dict(compose("tiny", ["train.train_iters=6", "logger.log_interval=1",
                                                           "train.eval_iters=0"]))


def _forward(data_iterator, model, loss_fn=masked_next_token_loss):
    device = next(model.parameters()).device
    batch = get_batch(data_iterator, device, use_mask=False)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(loss_fn, batch["loss_mask"])


def mean_loss_pattern(loss_mask, output_tensor):
    """The (loss, dict) pattern: a per-micro-batch mean, averaged over micro-batches by the loop."""
    loss, tokens, _ = masked_next_token_loss(loss_mask, output_tensor)
    mean = loss / tokens
    # clone: megatron-core's schedule divides the returned loss in place by the micro-batch count
    return mean, {"lm loss": mean.detach().clone()}


def two_args(data_iterator, model):
    return _forward(data_iterator, model)


def three_args_schedule_plan(data_iterator, model, return_schedule_plan=False):
    return _forward(data_iterator, model)


def three_args_state_by_hint(s: GlobalState, data_iterator, model):
    assert s.cfg.train.train_iters == 6 and s.runtime is not None
    return _forward(data_iterator, model)


def four_args_state_by_name(global_state, data_iterator, model, return_schedule_plan=False):
    assert isinstance(global_state, GlobalState)
    return _forward(data_iterator, model)


class Functor:
    def __call__(self, state, data_iterator, model):
        assert isinstance(state, GlobalState)
        return _forward(data_iterator, model)


def two_tuple_loss(data_iterator, model):
    return _forward(data_iterator, model, loss_fn=mean_loss_pattern)


def inference_forward(data_iterator, model):
    """The inference pattern: with non_loss_data the loss function returns arbitrary data (per-token losses)."""
    device = next(model.parameters()).device
    batch = get_batch(data_iterator, device, use_mask=False)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_or_data(output_tensor, non_loss_data=False):
        if non_loss_data:
            return output_tensor.detach()
        return masked_next_token_loss(batch["loss_mask"], output_tensor)

    return output, loss_or_data


def run_inference() -> None:
    """forward_only + collect_non_loss_data through evaluate(); prints what was collected."""
    from bridge_cli.runtime.distributed import destroy_distributed
    from bridge_cli.training.setup import setup
    from bridge_cli.training.train import evaluate

    cfg = config()
    cfg.train.eval_iters = 1
    cfg.validate()
    state = GlobalState(cfg=cfg)
    out = setup(state)
    seen = []
    _, collected = evaluate(state, inference_forward, out.valid_data_iterator, out.model, eval_iters=1,
                            process_non_loss_data_func=lambda data, step, writer: seen.append(data))
    shapes = [tuple(t.shape) for t in collected]
    print(f"COLLECTED {len(collected)} {shapes[0]}", flush=True)
    destroy_distributed()


VARIANTS = {
    "default": forward_step,
    "two_args": two_args,
    "three_args_schedule_plan": three_args_schedule_plan,
    "three_args_state_by_hint": three_args_state_by_hint,
    "four_args_state_by_name": four_args_state_by_name,
    "functor": Functor(),
    "two_tuple_loss": two_tuple_loss,
}

if __name__ == "__main__":
    if sys.argv[1:] == ["inference"]:
        run_inference()
        sys.exit(0)
    for name in sys.argv[1:] or VARIANTS:
        print(f"VARIANT {name}", flush=True)
        pretrain(config(), VARIANTS[name])
