"""megatron-core's GPTModel, with RoPE at each token's own position in rows of packed documents, and
two model options megatron-core lacks.

megatron-core (0.16 to 0.19) rotates a ``[s, b]`` batch by positions 0..s-1 whatever the
``position_ids`` (only THD batches restart per sequence, through a per-layer host sync). When the
training step passes :class:`~bridge_cli.models.attention.masks.DocumentParams` with RoPE
positions, this gathers the rotary table at them once per forward, so every document is rotated
as if it ran alone; the layers apply the ``[s, b, 1, d]`` table as they apply the shared one.

``model.scale_embeddings`` multiplies the input embeddings by sqrt(hidden_size) (Gemma),
``model.local_rotary_base`` gives the sliding-window layers a rotary table of their own
(:mod:`~bridge_cli.models.local_rope`), ``model.final_logit_softcapping`` soft-caps the output
logits (Gemma 2), on each tensor-parallel rank's share of the vocabulary, and
``model.fused_linear_cross_entropy`` computes the loss without the whole logits
(:mod:`~bridge_cli.models.linear_cross_entropy`), and ``model.cross_entropy_fusion_impl=triton`` without their fp32
copy (:mod:`~bridge_cli.models.cross_entropy`); with ``model.gradient_accumulation_fusion`` the word embedding adds its
gradient into ``main_grad`` too (:mod:`~bridge_cli.models.embedding_wgrad`). Everything else, state-dict keys included,
is megatron-core's.
"""

from __future__ import annotations

import torch
from megatron.core.models.gpt import GPTModel as MCoreGPTModel

from bridge_cli.models import cross_entropy, embedding_wgrad, linear_cross_entropy
from bridge_cli.models.attention.masks import DocumentParams


class GPTModel(MCoreGPTModel):
    """``GPTModel`` whose RoPE follows ``DocumentParams.rope_positions`` when a batch carries them, with
    ``model.local_rotary_base``, ``model.scale_embeddings``, ``model.final_logit_softcapping`` and
    ``model.fused_linear_cross_entropy`` and ``model.cross_entropy_fusion_impl=triton`` when its config sets them."""

    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        if getattr(config, "local_rotary_base", None) is not None and self.position_embedding_type == "rope":
            from bridge_cli.models.local_rope import LocalGlobalRotaryEmbedding

            self.rotary_pos_emb = LocalGlobalRotaryEmbedding(
                local_rotary_base=config.local_rotary_base, kv_channels=config.kv_channels,
                rotary_percent=config.rotary_percent, rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=config.seq_len_interpolation_factor, rotary_base=config.rotary_base,
                rope_scaling=config.rope_scaling, rope_scaling_factor=config.rope_scaling_factor,
                use_cpu_initialization=config.use_cpu_initialization, cp_group=self.pg_collection.cp)
        if getattr(config, "scale_embeddings", False) and hasattr(self, "embedding"):
            self.embedding.register_forward_hook(_scale_by_sqrt_hidden)
        if config.gradient_accumulation_fusion and hasattr(self, "embedding"):
            embedding_wgrad.use_main_grad_embedding(self.embedding.word_embeddings)
        self._fused_loss = bool(getattr(config, "fused_linear_cross_entropy", False)) and hasattr(self, "output_layer")
        self._defer = False  # set for one forward that has labels
        self._deferred: list = []  # (hidden states, weight) the output layer handed on unprojected
        self.loss_chunk_math = linear_cross_entropy.EAGER  # regional compilation swaps in the compiled passes
        if self._fused_loss:
            self.output_layer.forward = self._defer_projection(self.output_layer.forward)
        elif getattr(config, "final_logit_softcapping", None) and hasattr(self, "output_layer"):
            self.output_layer.register_forward_hook(_soft_cap_logits)

    def forward(self, *args, **kwargs):
        # with labels, the loss is all the last stage returns: its logits need never exist whole
        labels = kwargs["labels"] if "labels" in kwargs else (args[4] if len(args) > 4 else None)
        self._defer = self._fused_loss and labels is not None
        try:
            return super().forward(*args, **kwargs)
        finally:
            self._defer = False
            self._deferred.clear()

    def _defer_projection(self, project):
        """The output layer's forward, which under ``_defer`` hands on its input, as the projection
        would see it (gathered over the sequence, its gradient summed over tensor-parallel ranks),
        for compute_language_model_loss to project chunk by chunk."""
        from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region, \
            gather_from_sequence_parallel_region

        def forward(hidden_states, weight=None, runtime_gather_output=None):
            if not self._defer:
                return project(hidden_states, weight=weight, runtime_gather_output=runtime_gather_output)
            tp = self.pg_collection.tp
            if self.output_layer.sequence_parallel:
                hidden_states = gather_from_sequence_parallel_region(hidden_states, group=tp)
            elif tp.size() > 1:
                hidden_states = copy_to_tensor_model_parallel_region(hidden_states, group=tp)
            self._deferred.append((hidden_states, self.output_layer.weight if weight is None else weight))
            return hidden_states, None

        return forward

    def compute_language_model_loss(self, labels, logits):
        deferred = next((weight for hidden, weight in self._deferred if hidden is logits), None)
        tp = self.pg_collection.tp
        group = tp if tp.size() > 1 else None
        if deferred is None:
            if cross_entropy.selected(self.config):
                return cross_entropy.language_model_loss(labels, logits, group)
            return super().compute_language_model_loss(labels, logits)
        seq, batch, hidden = logits.shape
        losses = linear_cross_entropy.LinearCrossEntropy.apply(
            logits.reshape(seq * batch, hidden), deferred, labels.t().reshape(-1), group,
            self.config.linear_cross_entropy_chunk, self.config.final_logit_softcapping, self.loss_chunk_math)
        return losses.view(seq, batch).t().contiguous()  # [s, b] -> [b, s], as megatron-core returns it

    def _preprocess(self, *args, **kwargs):
        output = super()._preprocess(*args, **kwargs)
        params = kwargs.get("packed_seq_params")  # megatron-core passes every argument by keyword
        rotary = output[1]
        if isinstance(params, DocumentParams) and params.rope_positions is not None and rotary is not None:
            if rotary.shape[0] != params.max_seqlen_q:  # cut to this context-parallel rank's part: want all
                rotary = self.rotary_pos_emb.get_emb(params.max_seqlen_q)
                if isinstance(rotary, tuple):  # YaRN's comes with its cos/sin scale, which the layers read again
                    rotary = rotary[0]
            # [S, 1, 1, d] table -> [s, b, 1, d]: row j of sample i is position rope_positions[i, j]
            rotary = rotary[:, 0][params.rope_positions.t()]
            output = (output[0], rotary, *output[2:])
        return output


def _scale_by_sqrt_hidden(embedding, inputs, output: torch.Tensor) -> torch.Tensor:
    """``model.scale_embeddings``, as a forward hook of the embedding. The factor is rounded to the
    embeddings' dtype, as Gemma rounds it (sqrt(3072) is 55.5 in bfloat16), on the host: a Python
    number, not a device tensor, so that no micro-batch waits for a copy."""
    return output * torch.tensor(embedding.config.hidden_size ** 0.5, dtype=output.dtype).item()


def _soft_cap_logits(output_layer, inputs, output: tuple) -> tuple:
    """``model.final_logit_softcapping``, as a forward hook of the output layer (which returns logits and bias)."""
    cap = output_layer.config.final_logit_softcapping
    logits, bias = output
    return torch.tanh(logits / cap) * cap, bias
