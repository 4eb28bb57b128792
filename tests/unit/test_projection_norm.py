"""model.qk_layernorm_across_heads (OLMoE's q/k norm over the whole projection): the settings it cannot
work with are ConfigErrors naming it, caught by `--dry-run`. Its numbers are tested against transformers'
OLMoE at TP=1 and TP=2 in tests/integration/test_convert_hf.py."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize("args, fragment", [
    ([], "qk_layernorm_across_heads needs qk_layernorm=true"),
    (["model.qk_layernorm=true", "model.num_query_groups=1", "model.tensor_model_parallel_size=2", "--world-size", "2"],
     "num_query_groups to be a multiple of tensor_model_parallel_size"),
])
def test_settings_it_cannot_work_with_are_refused(cli, args, fragment):
    result = cli("pretrain", "recipe=tiny", "model.qk_layernorm_across_heads=true", *args, "--dry-run")
    assert result.exit_code == 2, result.output
    assert result.stderr.startswith("error: model.qk_layernorm_across_heads") and fragment in result.stderr, result.stderr
