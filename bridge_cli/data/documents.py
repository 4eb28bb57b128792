"""Document ids: which document of a packed row each token belongs to.

A pretraining row concatenates documents, each ending with the tokenizer's end-of-document
token. With ``dataset.reset_attention_mask=true`` every sample also carries ``document_ids``
(``[s]``, int32, counting from 0): the training step turns them into per-document attention
masks, so no token attends across an end-of-document token (megatron-core's own
``reset_attention_mask`` mask is ``[s, s]`` per sample, which the torch spec never needs).
"""

from __future__ import annotations

import torch

from bridge_cli.config.errors import ConfigError


def documents_from_eod(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """Document id of each token: the end-of-document token belongs to the document it ends."""
    is_eod = (tokens == eod).to(torch.int32)
    return torch.cumsum(is_eod, dim=-1, dtype=torch.int32) - is_eod


class WithDocumentIds(torch.utils.data.Dataset):
    """A megatron-core GPT dataset whose samples also carry ``document_ids``."""

    def __init__(self, dataset, tokenizer):
        if tokenizer.pad == tokenizer.eod:
            # megatron-core rewrites padding ids to 0 in the tokens, which would erase the boundaries
            raise ConfigError("dataset.reset_attention_mask", "needs an end-of-document token that is not also the "
                              f"padding token (both are {tokenizer.eod}).",
                              "Use a tokenizer with a distinct pad id, or set dataset.reset_attention_mask=false.")
        self.dataset, self.eod = dataset, tokenizer.eod

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index) -> dict[str, torch.Tensor]:
        sample = dict(self.dataset[index])
        sample["document_ids"] = documents_from_eod(sample["tokens"], self.eod)
        return sample
