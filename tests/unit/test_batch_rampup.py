"""train.rampup_batch_size ramps the batch as Megatron-LM does on every supported megatron-core: 0.19
ignores the field itself, so bridge hands it over as a step schedule."""

from __future__ import annotations

import pytest

from bridge_cli.training.setup import init_microbatch_calculator, rampup_steps


def megatron_lm_batch(consumed: int, start: int, increment: int, samples: int, global_batch: int) -> int:
    """The batch Megatron-LM's ramp gives after ``consumed`` samples (its RampupBatchsizeNumMicroBatchesCalculator)."""
    if consumed > samples:
        return global_batch
    per_increment = samples / ((global_batch - start) // increment)
    return start + int(consumed / per_increment) * increment


@pytest.mark.parametrize("start, increment, samples, global_batch", [
    (8, 8, 96, 32), (16, 16, 300000, 1024), (4, 4, 10, 64), (4, 12, 7, 40), (32, 32, 1000, 64)])
def test_the_calculator_follows_megatron_lm_ramp_at_every_consumed_count(start, increment, samples, global_batch):
    from megatron.core.num_microbatches_calculator import (destroy_num_microbatches_calculator,
                                                           get_current_global_batch_size, get_num_microbatches,
                                                           update_num_microbatches)

    init_microbatch_calculator(0, [start, increment, samples], global_batch, micro_batch=2, data_parallel=2)
    try:
        for consumed in sorted({*range(0, min(samples, 5000) + 50), samples - 1, samples, samples + 1}):
            update_num_microbatches(consumed, consistency_check=True)
            expected = megatron_lm_batch(consumed, start, increment, samples, global_batch)
            assert get_current_global_batch_size() == expected, consumed
            assert get_num_microbatches() == expected // 4
    finally:
        destroy_num_microbatches_calculator()


def test_the_step_schedule_of_a_ramp():
    assert rampup_steps([8, 8, 96], 32) == "0:8 32:16 64:24 96:32"
    assert rampup_steps([8, 8, 2], 32) == "0:8 1:16 2:32"  # more increments than samples: the later step wins
