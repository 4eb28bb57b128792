"""Tokenizers the datasets need. Only the null tokenizer (mock data) exists so far."""

from __future__ import annotations

from collections import OrderedDict

from bridge_cli.config.data_configs import TokenizerConfig
from bridge_cli.config.errors import ConfigError


class NullTokenizer:
    """Token ids 0..vocab_size-1 with no text behind them; the last id marks end-of-document."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.pad = -1  # never produced, so megatron-core masks nothing as padding

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(cls="bridge_cli.NullTokenizer", vocab_size=self.vocab_size)


def build_tokenizer(config: TokenizerConfig, vocab_size: int):
    """The tokenizer ``config`` names; ``vocab_size`` is the model's, used when the config has none."""
    if config.tokenizer_type == "NullTokenizer":
        return NullTokenizer(config.vocab_size or vocab_size)
    raise ConfigError("tokenizer.tokenizer_type", f"{config.tokenizer_type} is not supported by this version of bridge yet.",
                      "Use tokenizer.tokenizer_type=NullTokenizer with mock or pre-tokenized data.")
