"""Config rules of the torch spec's attention (documents, context parallelism) and of the fused QKV RoPE
(:mod:`bridge_cli.models.qkv_rope`), checked before any model is built."""

from __future__ import annotations

from bridge_cli.config.errors import ConfigError


def check_attention(cfg) -> None:
    """Every rule below; the validation pass (training/validation.py) calls this."""
    check_document_attention(cfg)
    check_context_parallel(cfg)
    check_fused_qkv_rope(cfg)


def check_document_attention(cfg) -> None:
    """Rows of several documents (``dataset.reset_attention_mask``, packed SFT) need the torch spec,
    the one whose attention masks each document; another spec would let documents see each other."""
    from bridge_cli.models.specs import default_spec_name

    documents, key, fix = document_rows(cfg.dataset)
    spec = cfg.model.spec or default_spec_name()
    if documents and spec != "torch":
        raise ConfigError(key, f"masks attention per document, which only the torch layer spec does "
                          f"(model.spec={spec}).", f"Set model.spec=torch, {fix}.")


def document_rows(data) -> tuple[bool, str, str]:
    """Whether the dataset's rows hold several documents, the key that says so, and how to turn it off."""
    if hasattr(data, "packed_sequence_specs"):  # the fine-tuning dataset
        key = "dataset.packed_sequence_specs.packed_sequence_size"
        return (data.packed_sequence_specs.packed_sequence_size > 0, key,
                "or unpack the samples (dataset.packed_sequence_specs.packed_sequence_size=-1)")
    return (getattr(data, "reset_attention_mask", False), "dataset.reset_attention_mask",
            "or set dataset.reset_attention_mask=false")


def check_context_parallel(cfg) -> None:
    """Each context-parallel rank holds two chunks of every row, cut from document ids, not from a dense mask."""
    cp = cfg.model.context_parallel_size
    if cp == 1:
        return
    seq = cfg.model.seq_length
    if seq % (2 * cp):
        raise ConfigError("model.context_parallel_size", f"{cp} cuts each row into {2 * cp} chunks, which "
                          f"model.seq_length={seq} is not a multiple of.",
                          f"Make model.seq_length a multiple of {2 * cp}.")
    if not getattr(cfg.dataset, "skip_getting_attention_mask_from_dataset", True):
        raise ConfigError("dataset.skip_getting_attention_mask_from_dataset", "must stay true with "
                          f"model.context_parallel_size={cp}: the attention cannot cut a dense [s, s] mask.",
                          "Use dataset.reset_attention_mask=true for per-document masks instead.")


def check_fused_qkv_rope(cfg) -> None:
    """Refuse ``model.fused_single_qkv_rope`` where megatron-core would not take the fused path (its attention
    asserts at the first step) or the path would not apply the model's RoPE."""
    if not cfg.model.fused_single_qkv_rope:
        return
    documents, key, _ = document_rows(cfg.dataset)
    found = model_blockers(cfg.model) + ([f"{key} (megatron-core takes the fused path without packed sequences "
                                          "only)"] if documents else [])
    if found:
        raise ConfigError("model.fused_single_qkv_rope", f"cannot be combined with {'; '.join(found)}.",
                          "Set model.fused_single_qkv_rope=false.")


def model_blockers(model) -> list[str]:
    """The model settings (attributes, megatron-core's defaults where absent) that keep it off the fused path."""
    position = getattr(model, "position_embedding_type", "learned_absolute")
    norms = getattr(model, "qk_layernorm", False) or getattr(model, "qk_l2_norm", False)
    reasons = [
        (position != "rope", f"model.position_embedding_type={position} (it rotates by plain RoPE angles: "
                             "no YaRN scale)"),
        (getattr(model, "multi_latent_attention", False), "model.multi_latent_attention=true (its attention has "
                                                          "its own RoPE)"),
        (norms, "q/k norms (they run between the split and RoPE)"),
        (getattr(model, "rotary_interleaved", False), "model.rotary_interleaved=true (it rotates the two halves of "
                                                      "each head)"),
    ]
    return [reason for hit, reason in reasons if hit]
