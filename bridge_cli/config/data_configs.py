"""Data sections: dataloader, GPT / mock / finetuning datasets, tokenizer."""

import re
from dataclasses import dataclass, field
from typing import Optional

from bridge_cli.config.fields import one_of


@dataclass
class DataloaderConfig:
    """Settings shared by every dataset's dataloader."""

    dataloader_type: Optional[str] = one_of(None, "single", "cyclic", "external")
    """Single-pass ('single', the default) or repeating ('cyclic'); 'external' (a loader built outside,
    Megatron-Bridge's name) is refused: bridge builds the loader from its own datasets."""

    num_workers: int = 8
    """Dataloader worker processes."""

    data_sharding: bool = True
    """Shard the data across data-parallel ranks."""

    pin_memory: bool = True
    """Pin host memory for faster host-to-GPU copies."""

    persistent_workers: bool = False
    """Keep dataloader workers alive across epochs."""


    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        if self.dataloader_type == "external":
            return [("dataloader_type", "external is a loader built outside bridge, which neither the command line nor "
                     "pretrain() takes: bridge builds the loader from its datasets. Use single (one pass) or cyclic "
                     "(repeating epochs).")]
        return []


@dataclass
class GPTDatasetConfig(DataloaderConfig):
    """Pretraining data from Megatron indexed datasets (megatron-core GPTDatasetConfig, flattened)."""

    random_seed: int = 1234
    """Seed for all RNG during dataset index building."""

    seq_length: Optional[int] = None
    """Tokens per sample; must equal the model's seq_length (megatron-core's sequence_length)."""

    blend: Optional[list[str]] = None
    """Megatron --data-path list: [prefix, ...] or [weight, prefix, weight, prefix, ...]; None means mock data."""

    blend_per_split: Optional[list[Optional[list[str]]]] = None
    """Three blends (train, valid, test), each like `blend` or None; used instead of `blend` and `split`."""

    split: Optional[str] = "969,30,1"
    """Comma-separated train,valid,test weights for carving splits out of `blend`."""

    multiple_validation_sets: Optional[bool] = None
    """Treat each validation blend entry as a separate validation set."""

    full_validation: Optional[bool] = None
    """Run a full epoch of validation each time validation runs."""

    num_dataset_builder_threads: int = 1
    """Threads used to build dataset indices."""

    path_to_cache: Optional[str] = None
    """Directory for reusable dataset index caches (default: next to the data)."""

    mmap_bin_files: bool = True
    """Memory-map the .bin files instead of reading through file pointers."""

    mid_level_dataset_surplus: float = 0.005
    """Sample surplus built for mid-level datasets of a multi-source blend."""

    allow_ambiguous_pad_tokens: Optional[bool] = False
    """Keep pad tokens that share an id with other special tokens unmasked (not recommended)."""

    fast_cache_load: bool = False
    """Load dataset caches on the fast path; needs path_to_cache with all caches built and no `blend`."""

    defer_npy_index_mmap: bool = False
    """Defer mmap of the .npy indices to first access; needs path_to_cache with all caches built."""

    reset_position_ids: bool = False
    """Restart position ids after each end-of-document token."""

    reset_attention_mask: bool = False
    """Block attention across end-of-document tokens."""

    eod_mask_loss: bool = False
    """Exclude end-of-document tokens from the loss."""

    create_attention_mask: bool = True
    """Build attention masks in the dataset; disable when the attention kernel generates them."""

    skip_getting_attention_mask_from_dataset: bool = True
    """Pass a None attention mask to the model and let the attention backend build it."""

    drop_last_partial_validation_sequence: bool = True
    """Drop the last partial sequence of the validation split."""

    add_extra_token_to_sequence: bool = True
    """Draw seq_length + 1 tokens per sample so inputs and shifted labels both have seq_length tokens."""

    object_storage_cache_path: Optional[str] = None
    """Local cache directory for indices when reading data from S3 or MSC object storage."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        problems = super().check()
        if self.blend_per_split is not None:
            if self.blend is not None:
                problems.append(("blend_per_split", "cannot be combined with blend; set one of them."))
            if len(self.blend_per_split) != 3:
                problems.append(
                    ("blend_per_split", f"needs 3 entries (train, valid, test), got {len(self.blend_per_split)}.")
                )
        elif self.blend is not None and self.split is None:
            problems.append(("split", "must be set when blend is set, e.g. '969,30,1'."))
        if self.split is not None and not _is_split(self.split):
            problems.append(("split", f"{self.split!r} is not up to three non-negative weights (train,valid,test) "
                             "with a positive sum, e.g. '969,30,1'."))
        if self.fast_cache_load and self.path_to_cache is None:
            problems.append(("fast_cache_load", "needs path_to_cache."))
        if self.fast_cache_load and self.blend is not None:
            problems.append(("fast_cache_load", "cannot be combined with blend; use blend_per_split."))
        if self.defer_npy_index_mmap and self.path_to_cache is None:
            problems.append(("defer_npy_index_mmap", "needs path_to_cache."))
        return problems


@dataclass
class MockGPTDatasetConfig(GPTDatasetConfig):
    """GPTDatasetConfig that generates random tokens instead of reading files."""

    blend: Optional[list[str]] = None
    """Always None: mock data reads no files."""

    blend_per_split: Optional[list[Optional[list[str]]]] = None
    """Always None: mock data reads no files."""

    mock: bool = True
    """Always True: samples are generated by megatron-core's MockGPTDataset."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        problems = super().check()
        real_data = "to read files, choose the file-backed dataset: dataset=gpt on the command line, GPTDatasetConfig from Python."
        for name in ("blend", "blend_per_split"):
            if getattr(self, name) is not None:
                problems.append((name, f"must be None for the mock dataset, which reads no files; {real_data}"))
        if not self.mock:
            problems.append(("mock", f"must be true for the mock dataset; {real_data}"))
        return problems


@dataclass
class PackedSequenceSpecs:
    """Sequence packing for fine-tuning: several short samples share one row of seq_length tokens."""

    packed_sequence_size: int = -1
    """Tokens per pack; samples are packed whole, in order, until the next one would not fit. <= 0 disables packing."""


@dataclass
class FinetuningDatasetConfig(DataloaderConfig):
    """Supervised finetuning data: training/validation/test.jsonl with input/output or chat messages."""

    dataset_root: Optional[str] = None
    """Directory holding the training, validation and test JSONL files."""

    seq_length: Optional[int] = None
    """Tokens per row (a sample or a pack); at most model.seq_length. Longer samples lose the end of their answer."""

    seed: int = 1234
    """Seed of the per-epoch shuffle of the training samples."""

    memmap_workers: int = 1
    """Kept for Megatron-Bridge configs; bridge tokenizes the JSONL files in one pass and ignores it."""

    max_train_samples: Optional[int] = None
    """Use only the first N records of training.jsonl (None: all of them)."""

    packed_sequence_specs: PackedSequenceSpecs = field(default_factory=PackedSequenceSpecs)
    """Sequence packing; off (one sample per row, padded) unless packed_sequence_size > 0. Megatron-Bridge's default is None."""

    do_validation: bool = True
    """Build the validation dataset."""

    do_test: bool = True
    """Build the test dataset."""

    def check(self) -> list[tuple[str, str]]:
        """(field, message) for each problem; empty when the section is consistent."""
        problems = super().check()
        if problems:
            return problems
        size = self.packed_sequence_specs.packed_sequence_size
        if size > 0 and self.seq_length is not None and size > self.seq_length:
            return [("packed_sequence_specs.packed_sequence_size",
                     f"{size} is longer than dataset.seq_length ({self.seq_length}); a pack must fit in one row.")]
        if self.max_train_samples is not None and self.max_train_samples < 1:
            return [("max_train_samples", f"must be >= 1 (or null for all records), got {self.max_train_samples}.")]
        return []


@dataclass
class TokenizerConfig:
    """Which tokenizer to build and from where."""

    tokenizer_type: Optional[str] = one_of(
        "NullTokenizer", "NullTokenizer", "HuggingFaceTokenizer", "SentencePieceTokenizer", "ByteLevelTokenizer"
    )
    """Tokenizer implementation; NullTokenizer maps integers to themselves and needs vocab_size."""

    tokenizer_model: Optional[str] = None
    """Local path to the tokenizer files (HuggingFace directory or SentencePiece .model file)."""

    vocab_size: Optional[int] = None
    """Vocabulary size of the NullTokenizer; ignored by tokenizers that carry their own vocabulary."""

    make_vocab_size_divisible_by: int = 128
    """Follows model.make_vocab_size_divisible_by, which pads the embedding; a different value is an error."""

    vocab_extra_ids: int = 0
    """Extra sentinel tokens to add to the vocabulary (T5-style); no bridge tokenizer adds them, so must be 0."""

    trust_remote_code: bool = False
    """Allow a HuggingFace tokenizer to run code shipped with its files."""


_SPLIT = re.compile(r"^\s*\d+(\.\d*)?(\s*[,/]\s*\d+(\.\d*)?){0,2}\s*$")


def _is_split(split: str) -> bool:
    """What megatron-core's split parser reads without dropping characters: 1-3 weights, sum > 0."""
    return bool(_SPLIT.match(split)) and sum(float(w) for w in re.split(r"[,/]", split)) > 0
