"""rerun_state_machine.rerun_mode=report_determinism_stats on a GPU (megatron-core >= 0.19; refused before):
every step is run twice on the same data and megatron-core reports how far the repeated losses differ,
while training goes on as without the check."""

from __future__ import annotations

import pytest

from tests.conftest import bridge
from tests.integration.test_pretrain_cpu import losses

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

RUN = ["recipe=tiny", "train.train_iters=4", "logger.log_interval=1", "train.eval_iters=0"]


def test_determinism_stats_are_reported_and_training_is_unchanged():
    from bridge_cli.runtime.mcore_import import megatron_core_version

    if megatron_core_version() < (0, 19):
        pytest.skip("report_determinism_stats needs megatron-core 0.19 (refused before, tested in test_validation)")
    plain = bridge("pretrain", *RUN)
    checked = bridge("pretrain", *RUN, "rerun_state_machine.rerun_mode=report_determinism_stats")
    assert plain.returncode == 0 and checked.returncode == 0, checked.stderr[-3000:]
    output = checked.stdout + checked.stderr
    assert "Stats on computation determinism in validation calls" in output, output[-3000:]
    assert "From validation call 'found NaN in local forward loss calculation'" in output
    assert "Traceback" not in output
    assert losses(checked.stdout) == pytest.approx(losses(plain.stdout), rel=1e-5)
