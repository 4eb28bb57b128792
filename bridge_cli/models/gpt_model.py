"""megatron-core's GPTModel, with RoPE at each token's own position in rows of packed documents.

megatron-core (0.16 to 0.19) rotates a ``[s, b]`` batch by positions 0..s-1 whatever the
``position_ids`` (only THD batches restart per sequence, through a per-layer host sync). When the
training step passes :class:`~bridge_cli.models.attention.masks.DocumentParams` with RoPE
positions, this gathers the rotary table at them once per forward, so every document is rotated
as if it ran alone; the layers apply the ``[s, b, 1, d]`` table as they apply the shared one.
Everything else, state-dict keys included, is megatron-core's.
"""

from __future__ import annotations

from megatron.core.models.gpt import GPTModel as MCoreGPTModel

from bridge_cli.models.attention.masks import DocumentParams


class GPTModel(MCoreGPTModel):
    """``GPTModel`` whose RoPE follows ``DocumentParams.rope_positions`` when a batch carries them."""

    def _preprocess(self, *args, **kwargs):
        output = super()._preprocess(*args, **kwargs)
        params = kwargs.get("packed_seq_params")  # megatron-core passes every argument by keyword
        rotary = output[1]
        if isinstance(params, DocumentParams) and params.rope_positions is not None and rotary is not None:
            if rotary.shape[0] != params.max_seqlen_q:  # cut to this context-parallel rank's part: want all
                rotary = self.rotary_pos_emb.get_emb(params.max_seqlen_q)
            # [S, 1, 1, d] table -> [s, b, 1, d]: row j of sample i is position rope_positions[i, j]
            rotary = rotary[:, 0][params.rope_positions.t()]
            output = (output[0], rotary, *output[2:])
        return output
