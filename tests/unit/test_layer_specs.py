"""Settings a layer spec cannot honour are refused when the spec is built, naming the key and the fix."""

from __future__ import annotations

import pytest

from bridge_cli.cli.errors import report
from bridge_cli.models.specs import layer_spec
from bridge_cli.runtime.errors import RuntimeUnavailable


def config(**fields):
    from megatron.core.transformer.transformer_config import TransformerConfig

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm")
    return TransformerConfig(**{**base, **fields})


def test_context_parallelism_needs_the_te_or_torch_attention():
    with pytest.raises(RuntimeUnavailable, match=r"model.context_parallel_size=2 needs Transformer Engine's "
                                                 r"attention or the torch spec's.*model.spec=torch"):
        layer_spec("local", config(context_parallel_size=2))


def test_sequence_parallelism_needs_a_norm_that_shards_the_sequence():
    with pytest.raises(RuntimeUnavailable, match="model.sequence_parallel=true is not supported by the torch layer spec"):
        layer_spec("torch", config(sequence_parallel=True, tensor_model_parallel_size=2))


def test_the_error_line_drops_megatron_cores_module_trail(capsys):
    report(RuntimeUnavailable("model.window_size=4 is not supported. when instantiating SelfAttention "
                              "when instantiating TransformerLayer"))
    assert capsys.readouterr().err.strip() == "error: model.window_size=4 is not supported."
