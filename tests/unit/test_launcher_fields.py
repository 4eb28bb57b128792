"""Launcher-level fields (bridge_cli/runtime/launcher_fields.py): the pipeline's communication backend reaches
megatron-core's process groups; the refusals are rows of test_validation.py's table."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.skipif(torch.distributed.is_ucc_available(), reason="this torch has UCC: the groups would build")
def test_the_pipeline_backend_reaches_megatron_core():
    """This torch has no UCC: building the pipeline groups with it fails in torch, so the value reached
    megatron-core's initialize_model_parallel (validation refuses ucc here before any run gets that far)."""
    from bridge_cli.runtime.distributed import destroy_distributed, init_distributed

    try:
        with pytest.raises(AssertionError, match="backend type UCC"):
            init_distributed("gloo", 1, 1, 1, pipeline_model_parallel_comm_backend="ucc")
    finally:
        destroy_distributed()
