"""Tokenizers: the `Tokenizer` interface every one of them has, and `build_tokenizer`."""

from __future__ import annotations

import functools
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Optional, Protocol, runtime_checkable

from bridge_cli.config.data_configs import TokenizerConfig
from bridge_cli.config.errors import ConfigError


@runtime_checkable
class Tokenizer(Protocol):
    """What datasets, preprocessing and fine-tuning may rely on (megatron-core's datasets read
    `vocab_size`, `eod`, `pad` and `unique_identifiers`).

    - `tokenize(text)`: token ids of `text`, without bos/eod (callers append `eod` themselves).
    - `detokenize(ids)`: the text back; special tokens are dropped.
    - `vocab_size`: the real vocabulary size, specials included, before any padding of the
      model's embedding (model.padded_vocab_size).
    - `eod`: end-of-document id, appended after every document.
    - `bos`: beginning-of-sequence id, or None when the tokenizer has none.
    - `pad`: id to pad sequences with, or -1 when the tokenizer has none (then nothing in the
      data is masked as padding; pad with `eod` and mask the loss instead).
    - `unique_identifiers`: what identifies this tokenizer in megatron-core's dataset caches.
    """

    vocab_size: int
    eod: int
    bos: Optional[int]
    pad: int

    def tokenize(self, text: str) -> list[int]: ...

    def detokenize(self, ids: Iterable[int]) -> str: ...

    @property
    def unique_identifiers(self) -> OrderedDict: ...


class NullTokenizer:
    """Token ids 0..vocab_size-1 with no text behind them; the last id marks end-of-document.
    Text is ids written in decimal, separated by spaces (Megatron-LM's NullTokenizer)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size
        self.eod = vocab_size - 1
        self.bos = None
        self.pad = -1  # never produced, so megatron-core masks nothing as padding

    def tokenize(self, text: str) -> list[int]:
        return [int(x) for x in text.split()]

    def detokenize(self, ids: Iterable[int]) -> str:
        return " ".join(str(int(i)) for i in ids)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(cls="bridge_cli.NullTokenizer", vocab_size=self.vocab_size)


class ByteLevelTokenizer:
    """UTF-8 bytes as ids 0..255, then eod, bos and pad: needs no files and encodes any text."""

    def __init__(self):
        self.eod, self.bos, self.pad = 256, 257, 258
        self.vocab_size = 259

    def tokenize(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def detokenize(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if 0 <= int(i) < 256).decode("utf-8", errors="replace")

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(cls="bridge_cli.ByteLevelTokenizer", vocab_size=self.vocab_size)


HF_EXTRA = "pip install 'bridge-cli[hf]'"
_HF_FILES = ("tokenizer.json", "tokenizer_config.json")


class HuggingFaceTokenizer:
    """A Hugging Face tokenizer saved in a local folder (tokenizer.json / tokenizer_config.json);
    end-of-document is its eos token. Never touches the network."""

    def __init__(self, path: str, trust_remote_code: bool = False):
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError("tokenizer.tokenizer_model", f"no tokenizer folder at {path}.",
                              "Give a local folder holding tokenizer.json or tokenizer_config.json "
                              "(what `save_pretrained` writes).")
        if not any((folder / name).is_file() for name in _HF_FILES):
            raise ConfigError("tokenizer.tokenizer_model", f"{path} holds none of {', '.join(_HF_FILES)}.",
                              "Point it at the folder `save_pretrained` wrote.")
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise ConfigError("tokenizer.tokenizer_model", "HuggingFaceTokenizer needs the transformers package, "
                              "which is not installed.", f"Install it: {HF_EXTRA}.") from None
        try:
            self._tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True,
                                                            trust_remote_code=trust_remote_code)
        except (OSError, ValueError) as e:
            raise ConfigError("tokenizer.tokenizer_model", f"cannot load a Hugging Face tokenizer from {path}: {e}",
                              "Check the files (and tokenizer.trust_remote_code for custom tokenizers).") from None
        if self._tokenizer.eos_token_id is None:
            raise ConfigError("tokenizer.tokenizer_model", f"the tokenizer in {path} has no eos token to end "
                              "documents with.", "Set eos_token in its tokenizer_config.json.")
        self.path = str(folder.resolve())
        self.vocab_size = len(self._tokenizer)  # added tokens included, as Megatron-LM counts them
        self.eod = self._tokenizer.eos_token_id
        self.bos = self._tokenizer.bos_token_id
        self.pad = -1 if self._tokenizer.pad_token_id is None else self._tokenizer.pad_token_id
        if getattr(self._tokenizer, "chat_template", None):
            # Only then: fine-tuning renders chats with the model's own template when the tokenizer
            # has one, and with bridge's simple template otherwise (bridge_cli.data.sft).
            self.apply_chat_template = self._apply_chat_template

    def _apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def tokenize(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._tokenizer.decode([int(i) for i in ids], skip_special_tokens=True)

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(cls="bridge_cli.HuggingFaceTokenizer", path=self.path, vocab_size=self.vocab_size)


class SentencePieceTokenizer:
    """A SentencePiece `.model` file; its eos piece ends documents, its bos/pad pieces are used if present."""

    def __init__(self, path: str):
        if not Path(path).is_file():
            raise ConfigError("tokenizer.tokenizer_model", f"no SentencePiece model file at {path}.",
                              "Give the path of a local .model file.")
        try:
            import sentencepiece
        except ImportError:
            raise ConfigError("tokenizer.tokenizer_model", "SentencePieceTokenizer needs the sentencepiece package, "
                              "which is not installed.", f"Install it: {HF_EXTRA}.") from None
        try:
            self._processor = sentencepiece.SentencePieceProcessor(model_file=path)
        except (OSError, RuntimeError) as e:
            raise ConfigError("tokenizer.tokenizer_model", f"{path} is not a SentencePiece model: {e}") from None
        if self._processor.eos_id() < 0:
            raise ConfigError("tokenizer.tokenizer_model", f"the SentencePiece model {path} has no eos piece "
                              "to end documents with.", "Train it with an eos piece (the default, eos_id=2).")
        self.path = str(Path(path).resolve())
        self.vocab_size = self._processor.get_piece_size()
        self.eod = self._processor.eos_id()
        self.bos = self._processor.bos_id() if self._processor.bos_id() >= 0 else None
        self.pad = self._processor.pad_id()  # -1 when the model has no pad piece

    def tokenize(self, text: str) -> list[int]:
        return self._processor.encode(text)

    def detokenize(self, ids: Iterable[int]) -> str:
        return self._processor.decode([int(i) for i in ids])

    @property
    def unique_identifiers(self) -> OrderedDict:
        return OrderedDict(cls="bridge_cli.SentencePieceTokenizer", path=self.path, vocab_size=self.vocab_size)


@functools.lru_cache(maxsize=4)
def _from_files(kind: str, path: str, trust_remote_code: bool) -> Tokenizer:
    """Loaded once per process: validation (which sizes the model's vocabulary from it) and the
    data pipeline ask for the same tokenizer, and a large one takes a second to read."""
    if kind == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(path, trust_remote_code)
    return SentencePieceTokenizer(path)


def build_tokenizer(config: TokenizerConfig, vocab_size: Optional[int] = None) -> Tokenizer:
    """The tokenizer ``config`` names; ``vocab_size`` is the model's, used by the null tokenizer
    when the config has none."""
    kind = config.tokenizer_type
    if kind == "NullTokenizer":
        return NullTokenizer(config.vocab_size or vocab_size)
    if kind == "ByteLevelTokenizer":
        return ByteLevelTokenizer()
    if kind in ("HuggingFaceTokenizer", "SentencePieceTokenizer"):
        if not config.tokenizer_model:
            raise ConfigError("tokenizer.tokenizer_model", f"is not set; {kind} reads its vocabulary from local files.",
                              "Set tokenizer.tokenizer_model=PATH (a folder for HuggingFaceTokenizer, "
                              "a .model file for SentencePieceTokenizer).")
        return _from_files(kind, config.tokenizer_model, config.trust_remote_code)
    raise ConfigError("tokenizer.tokenizer_type", f"{kind} is not a tokenizer bridge knows.",
                      "Use NullTokenizer, ByteLevelTokenizer, HuggingFaceTokenizer or SentencePieceTokenizer.")

