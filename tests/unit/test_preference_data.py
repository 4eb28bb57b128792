"""Preference data for DPO: records become (chosen, rejected) rows whose loss falls on the response only, and a
micro-batch, packed or not, gives each pair's log-probabilities from its own two sequences."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from bridge_cli.config.data_configs import FinetuningDatasetConfig, PackedSequenceSpecs
from bridge_cli.config.errors import ConfigError
from bridge_cli.data.preference import build_preference_datasets, pair_segments, read_pairs
from bridge_cli.data.sft import build_sample, sample_row
from bridge_cli.data.tokenizers import ByteLevelTokenizer
from bridge_cli.training.dpo_loss import pair_logps
from bridge_cli.training.dpo_step import pair_layout

TOK = ByteLevelTokenizer()


def responses(record: dict, tokenizer=TOK) -> list[str]:
    """The label text each of chosen and rejected carries loss on (eod dropped by detokenize)."""
    rows = [sample_row(build_sample(segments, 256)) for segments in pair_segments(record, tokenizer)]
    return [tokenizer.detokenize([t for t, m in zip(row.labels, row.loss_mask) if m]) for row in rows]


def test_text_records_carry_loss_on_the_response_and_its_eod():
    chosen, rejected = (sample_row(build_sample(s, 64)) for s in
                        pair_segments({"prompt": "ab", "chosen": "C", "rejected": "DE"}, TOK))
    assert chosen.tokens[:2] == rejected.tokens[:2] == [97, 98]
    assert chosen.loss_mask == [0.0, 1.0, 1.0] and rejected.loss_mask == [0.0, 1.0, 1.0, 1.0]
    assert chosen.labels[-1] == rejected.labels[-1] == TOK.eod


def test_chat_records_count_only_the_response_not_earlier_assistant_turns():
    prompt = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"},
              {"role": "user", "content": "2+2"}]
    record = {"prompt": prompt, "chosen": [{"role": "assistant", "content": "4"}], "rejected": "5"}
    assert responses(record) == ["4", "5"]

    class Templated(ByteLevelTokenizer):
        def apply_chat_template(self, messages, add_generation_prompt=False):
            text = "".join(f"[{m['role']}]{m['content']}[end]" for m in messages)
            return text + ("[assistant]" if add_generation_prompt else "")

    assert responses(record, Templated()) == ["4[end]", "5[end]"]


@pytest.mark.parametrize("record, fragment", [
    ({"prompt": "a", "rejected": "b"}, "no 'chosen'; a preference record needs 'prompt', 'chosen' and 'rejected'"),
    ({"prompt": "a", "chosen": ["b"], "rejected": "c"}, "'chosen' must be a string when 'prompt' is one"),
    ({"prompt": [{"role": "user", "content": "a"}], "chosen": [{"role": "user", "content": "b"}], "rejected": "c"},
     "'chosen' must be a string or a list of messages with an assistant message"),
])
def test_bad_records_name_file_and_line(tmp_path, record, fragment):
    path = tmp_path / "training.jsonl"
    path.write_text(json.dumps({"prompt": "a", "chosen": "b", "rejected": "c"}) + "\n" + json.dumps(record) + "\n")
    with pytest.raises(ConfigError) as err:
        read_pairs(path, TOK, 64)
    assert f"{path}:2: {fragment}" in str(err.value)


def _cfg(root, **dataset):
    data = FinetuningDatasetConfig(dataset_root=str(root), seq_length=32, **dataset)
    return SimpleNamespace(dataset=data, model=SimpleNamespace(seq_length=32))


def _write(path, n):
    path.write_text("".join(json.dumps({"prompt": f"q{i}:", "chosen": f"c{i}", "rejected": f"r{i}x"}) + "\n"
                            for i in range(n)))


def fake_logps(rows: dict) -> torch.Tensor:
    """A per-token log-probability that depends only on the label and its position in its sequence."""
    return -(rows["labels"].float() * 0.01 + rows["position_ids"].float() * 0.1)


def test_packed_and_unpacked_micro_batches_give_every_pair_the_same_log_probs(tmp_path):
    _write(tmp_path / "training.jsonl", 6)
    unpacked, _, _ = build_preference_datasets(_cfg(tmp_path), TOK, [6, 0, 0])
    item = unpacked[0]
    assert item["tokens"].shape == (2, 32)
    shared = len(TOK.tokenize("q0:"))
    assert torch.equal(item["tokens"][0, :shared], item["tokens"][1, :shared])  # chosen and rejected share the order

    def per_pair(dataset, indices):
        batch = torch.utils.data.default_collate([dataset[i] for i in indices])
        rows, bins, pairs = pair_layout(batch)
        chosen, rejected, valid = pair_logps(fake_logps(rows), rows["loss_mask"], bins, pairs, average=False)
        return sorted(zip(chosen[valid].tolist(), rejected[valid].tolist()))

    # 6 pairs of 5 + 6 tokens (shifted): 2 per pack of 24, each response at most 12
    packed, _, _ = build_preference_datasets(
        _cfg(tmp_path, packed_sequence_specs=PackedSequenceSpecs(packed_sequence_size=24)), TOK, [3, 0, 0])
    assert [len(row.tokens) for row in packed.rows] == [22, 22, 22]
    # chosen even, rejected odd; the padding is one more sequence, with no loss
    assert packed[0]["document_ids"].tolist() == [0] * 5 + [1] * 6 + [2] * 5 + [3] * 6 + [4] * 10
    assert per_pair(packed, range(3)) == pytest.approx(per_pair(unpacked, range(6)))
    assert len(per_pair(packed, range(3))) == 6
