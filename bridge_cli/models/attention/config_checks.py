"""Config rules of per-document attention, checked before any model is built."""

from __future__ import annotations

from bridge_cli.config.errors import ConfigError


def check_document_attention(cfg) -> None:
    """Rows of several documents (``dataset.reset_attention_mask``, packed SFT) need the torch spec,
    the one whose attention masks each document; another spec would let documents see each other."""
    from bridge_cli.config.data_configs import FinetuningDatasetConfig
    from bridge_cli.models.specs import default_spec_name

    data = cfg.dataset
    if isinstance(data, FinetuningDatasetConfig):
        key = "dataset.packed_sequence_specs.packed_sequence_size"
        documents = data.packed_sequence_specs.packed_sequence_size > 0
        fix = "or unpack the samples (dataset.packed_sequence_specs.packed_sequence_size=-1)"
    else:
        key = "dataset.reset_attention_mask"
        documents = getattr(data, "reset_attention_mask", False)
        fix = "or set dataset.reset_attention_mask=false"
    spec = cfg.model.spec or default_spec_name()
    if documents and spec != "torch":
        raise ConfigError(key, f"masks attention per document, which only the torch layer spec does "
                          f"(model.spec={spec}).", f"Set model.spec=torch, {fix}.")
