"""Tokenizers: byte-level, Hugging Face and SentencePiece files trained here, vocab padding, errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from bridge_cli.config.data_configs import TokenizerConfig
from bridge_cli.config.errors import ConfigError
from bridge_cli.data.tokenizers import ByteLevelTokenizer, NullTokenizer, Tokenizer, build_tokenizer

TEXT = "def héllo(x):\n    return x + 1  # ünïcode, tabs\tand  spaces\n"


def train_bpe(texts: list[str], folder: Path, vocab_size: int = 300) -> Path:
    """A byte-level BPE trained on ``texts``, saved as a Hugging Face tokenizer folder."""
    from tokenizers import Tokenizer as RustTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = RustTokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(str(folder))
    return folder


def python_sources() -> list[str]:
    import json

    return [Path(p).read_text() for p in sorted(Path(json.__file__).parent.glob("*.py"))]


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    return train_bpe(python_sources(), tmp_path_factory.mktemp("hf"))


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece

    folder = tmp_path_factory.mktemp("sp")
    corpus = folder / "corpus.txt"
    corpus.write_text("\n".join(python_sources()))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "sp"), vocab_size=200,
                                             model_type="bpe", minloglevel=2)
    return folder / "sp.model"


def hf(path) -> TokenizerConfig:
    return TokenizerConfig(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=str(path))


def sp(path) -> TokenizerConfig:
    return TokenizerConfig(tokenizer_type="SentencePieceTokenizer", tokenizer_model=str(path))


def test_byte_level_round_trips_any_text_and_puts_specials_after_the_bytes():
    tok = build_tokenizer(TokenizerConfig(tokenizer_type="ByteLevelTokenizer"))
    assert isinstance(tok, ByteLevelTokenizer) and isinstance(tok, Tokenizer)
    ids = tok.tokenize(TEXT)
    assert len(ids) == len(TEXT.encode()) and max(ids) < 256
    assert tok.detokenize([tok.bos, *ids, tok.eod, tok.pad]) == TEXT
    assert (tok.eod, tok.bos, tok.pad, tok.vocab_size) == (256, 257, 258, 259)
    assert tok.unique_identifiers["cls"] == "bridge_cli.ByteLevelTokenizer"


def test_null_tokenizer_is_unchanged():
    tok = build_tokenizer(TokenizerConfig(vocab_size=None), 1024)
    assert isinstance(tok, NullTokenizer) and isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.eod, tok.pad, tok.bos) == (1024, 1023, -1, None)
    assert tok.tokenize("3 14 15") == [3, 14, 15] and tok.detokenize([3, 14]) == "3 14"


def test_hugging_face_tokenizer_from_a_locally_trained_folder(hf_folder):
    tok = build_tokenizer(hf(hf_folder))
    assert isinstance(tok, Tokenizer)
    assert tok.vocab_size == 300 and tok.eod == 0  # <|endoftext|>, its only special token
    assert tok.bos is None and tok.pad == -1
    ids = tok.tokenize(TEXT)
    assert len(ids) < len(TEXT.encode()) and tok.eod not in ids
    assert tok.detokenize(ids + [tok.eod]) == TEXT
    assert tok.unique_identifiers["path"] == str(hf_folder.resolve())


def test_sentencepiece_tokenizer_from_a_locally_trained_model(sp_model):
    tok = build_tokenizer(sp(sp_model))
    assert isinstance(tok, Tokenizer)
    assert (tok.vocab_size, tok.bos, tok.eod, tok.pad) == (200, 1, 2, -1)  # sentencepiece's defaults
    text = "import json\ndef dumps(obj): return obj"
    ids = tok.tokenize(text)
    assert tok.eod not in ids and tok.detokenize(ids + [tok.eod]) == text.replace("\n", " ")


@pytest.mark.parametrize("config, fragment", [
    (hf("/nonexistent/tokenizer"), "tokenizer.tokenizer_model: no tokenizer folder at /nonexistent/tokenizer"),
    (TokenizerConfig(tokenizer_type="HuggingFaceTokenizer"), "tokenizer.tokenizer_model: is not set"),
    (sp("/nonexistent/sp.model"), "tokenizer.tokenizer_model: no SentencePiece model file at /nonexistent/sp.model"),
    (sp(__file__), "is not a SentencePiece model"),
])
def test_missing_or_wrong_tokenizer_files_name_the_key(config, fragment):
    with pytest.raises(ConfigError, match="tokenizer.tokenizer_model") as err:
        build_tokenizer(config)
    assert fragment in str(err.value)


def test_a_folder_without_tokenizer_files_is_named(tmp_path):
    with pytest.raises(ConfigError) as err:
        build_tokenizer(hf(tmp_path))
    assert f"{tmp_path} holds none of tokenizer.json, tokenizer_config.json" in str(err.value)


def test_missing_transformers_suggests_the_hf_extra(hf_folder, monkeypatch):
    import bridge_cli.data.tokenizers as tokenizers

    tokenizers._from_files.cache_clear()  # as in a fresh process: nothing loaded yet
    monkeypatch.setitem(sys.modules, "transformers", None)  # what `import transformers` meets when absent
    with pytest.raises(ConfigError) as err:
        build_tokenizer(hf(hf_folder))
    assert "transformers package, which is not installed" in str(err.value)
    assert "pip install 'bridge-cli[hf]'" in str(err.value)


def container(*overrides: str, world_size: int = 1):
    from bridge_cli.config.compose import compose
    from bridge_cli.training.config import ConfigContainer

    c = ConfigContainer.from_yaml_dict(compose("tiny", list(overrides)))
    c.validate(world_size)
    return c


@pytest.mark.parametrize("vocab, divisible_by, tp, padded", [
    (50257, 128, 1, 50304), (50257, 128, 2, 50432), (259, 128, 1, 384), (1024, 128, 1, 1024), (300, 8, 4, 320),
])
def test_vocab_padding_is_megatron_lms(vocab, divisible_by, tp, padded):
    from bridge_cli.models.provider import GPTModelProvider

    provider = GPTModelProvider(num_layers=1, hidden_size=16, num_attention_heads=4, vocab_size=vocab,
                                make_vocab_size_divisible_by=divisible_by, tensor_model_parallel_size=tp)
    assert provider.padded_vocab_size == padded


def test_the_tokenizer_sets_the_models_vocab_size(hf_folder):
    # derived for the run; the model section keeps what the recipe says
    assert container("tokenizer=byte_level").derived.vocab_size == 259
    tp2 = container("tokenizer=byte_level", "model.tensor_model_parallel_size=2", world_size=2)
    assert tp2.derived.padded_vocab_size == 256 * 2
    assert container("tokenizer=huggingface", f"tokenizer.tokenizer_model={hf_folder}").derived.vocab_size == 300
    null = container()  # mock data: the recipe's vocab, as before
    assert (null.derived.vocab_size, null.derived.padded_vocab_size, null.tokenizer.vocab_size) == (1024, 1024, 1024)


def test_a_tokenizer_option_without_its_files_is_a_config_error():
    with pytest.raises(ConfigError, match="tokenizer.tokenizer_model: is not set"):
        container("tokenizer=sentencepiece")


@pytest.mark.parametrize("override, key", [
    ("tokenizer.make_vocab_size_divisible_by=64", "tokenizer.make_vocab_size_divisible_by: 64 differs from model"),
    ("tokenizer.vocab_extra_ids=100", "tokenizer.vocab_extra_ids: is not supported"),
])
def test_tokenizer_fields_bridge_does_not_honour_are_errors(override, key):
    with pytest.raises(ConfigError, match=key):
        container(override)
    assert container("model.make_vocab_size_divisible_by=64").tokenizer.make_vocab_size_divisible_by == 64


def test_a_hugging_face_chat_template_renders_fine_tuning_chats(hf_folder, tmp_path):
    import shutil

    from bridge_cli.data.sft import record_segments

    plain = build_tokenizer(hf(hf_folder))
    assert not hasattr(plain, "apply_chat_template")  # no template: bridge's own is used
    folder = tmp_path / "chat"
    shutil.copytree(hf_folder, folder)
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}[assistant] {% endif %}")
    config_file.write_text(json.dumps(config))
    chat = build_tokenizer(hf(folder))
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    segments = record_segments({"messages": messages}, chat)
    text = {answer: chat.detokenize([i for ids, a in segments if a == answer for i in ids]) for answer in (False, True)}
    assert text == {False: "[user] hi\n[assistant] ", True: "hello\n"}
