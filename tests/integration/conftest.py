"""Runs that tests in several modules compare against, made once per session."""

from __future__ import annotations

import pytest

from tests.conftest import bridge


@pytest.fixture(scope="session")
def single_process_curve() -> list[float]:
    """The loss curve of `bridge pretrain` on one process for test_pretrain_cpu.SHORT (12 iterations),
    which two processes and two nodes must reproduce."""
    from tests.integration.test_pretrain_cpu import SHORT, losses

    result = bridge("pretrain", *SHORT)
    assert result.returncode == 0, result.stderr[-3000:]
    curve = losses(result.stdout)
    assert len(curve) == 12
    return curve
