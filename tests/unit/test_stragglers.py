"""straggler.*: off unless log_straggler; on, megatron-core's detector needs NVML's Python bindings, and says so."""

from __future__ import annotations

import importlib.util

import pytest

from bridge_cli.config.runtime_configs import StragglerDetectionConfig
from bridge_cli.logging.stragglers import start_straggler_detector
from bridge_cli.runtime.errors import RuntimeUnavailable


def test_no_detector_unless_asked():
    assert start_straggler_detector(None) is None
    assert start_straggler_detector(StragglerDetectionConfig()) is None


@pytest.mark.skipif(importlib.util.find_spec("pynvml") is not None, reason="nvidia-ml-py is installed")
def test_without_nvml_bindings_the_run_is_refused_naming_the_package():
    with pytest.raises(RuntimeUnavailable, match=r"straggler.log_straggler=true: .*`pip install nvidia-ml-py`"):
        start_straggler_detector(StragglerDetectionConfig(log_straggler=True))
