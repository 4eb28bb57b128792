"""Attention settings from YAML: windows and sinks reach megatron-core; documents need the torch spec."""

from __future__ import annotations

import pytest
import torch

from bridge_cli.config.compose import compose
from bridge_cli.data.documents import WithDocumentIds, documents_from_eod
from bridge_cli.data.sft import Sample, SFTDataset, pack_rows, sample_row
from bridge_cli.training.config import ConfigContainer
from tests.unit.test_cli_errors import assert_user_error


def container(*overrides: str) -> ConfigContainer:
    c = ConfigContainer.from_yaml_dict(compose("tiny", list(overrides)))
    c.validate(1)
    return c


def test_window_and_sinks_are_settable_by_megatron_core_names():
    model = container("model.window_size=[15,0]", "model.window_attn_skip_freq=[1,0]",
                      "model.softmax_type=learnable").model
    assert model.window_size == (15, 0) and model.window_attn_skip_freq == [1, 0]
    assert model.softmax_type == "learnable"
    assert container("model.window_attn_skip_freq=4").model.window_attn_skip_freq == 4


@pytest.mark.parametrize("args, fragments", [
    (["model.spec=local", "dataset.reset_attention_mask=true"],
     ["dataset.reset_attention_mask: masks attention per document", "model.spec=torch"]),
    (["model.window_attn_skip_freq={a:1}"], ["model.window_attn_skip_freq", "neither one int nor a list"]),
    (["model.context_parallel_size=3", "--world-size", "3"],
     ["model.context_parallel_size: 3 cuts each row into 6 chunks", "multiple of 6"]),
    (["model.context_parallel_size=2", "dataset.skip_getting_attention_mask_from_dataset=false", "--world-size", "2"],
     ["dataset.skip_getting_attention_mask_from_dataset: must stay true"]),
])
def test_refusals_name_the_key(cli, args, fragments):
    assert_user_error(cli("config", "validate", *args), *fragments)


def test_packed_sft_needs_the_torch_spec(cli, tmp_path):
    (tmp_path / "training.jsonl").write_text('{"input": "a", "output": "b"}\n')
    assert_user_error(cli("config", "validate", "recipe=tiny_sft", "model.spec=local", f"dataset.dataset_root={tmp_path}",
                          "dataset.packed_sequence_specs.packed_sequence_size=64"),
                      "dataset.packed_sequence_specs.packed_sequence_size: masks attention per document")


def test_end_of_document_tokens_close_their_document():
    tokens = torch.tensor([[4, 9, 2, 9, 9, 5], [9, 1, 1, 1, 1, 1]])
    assert documents_from_eod(tokens, eod=9).tolist() == [[0, 0, 1, 1, 2, 3], [0, 1, 1, 1, 1, 1]]


class _Tokenizer:
    eod, pad = 9, 9


def test_a_pad_token_equal_to_eod_is_refused():
    from bridge_cli.config.errors import ConfigError

    with pytest.raises(ConfigError, match="dataset.reset_attention_mask: needs an end-of-document token"):
        WithDocumentIds([], _Tokenizer())


def test_packed_sft_rows_number_their_samples_and_the_padding():
    rows = [sample_row(Sample(list(range(n + 1)), [True] * (n + 1))) for n in (3, 2, 4)]
    row = SFTDataset(pack_rows(rows, 16), 12, 0, 1, None, packed=True)[0]
    assert row["document_ids"].tolist() == [0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3]
    assert row["position_ids"][:9].tolist() == [0, 1, 2, 0, 1, 0, 1, 2, 3]
    assert "document_ids" not in SFTDataset(rows, 12, 0, 1, None)[0]
