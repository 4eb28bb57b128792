"""``model.fused_single_qkv_rope`` without Transformer Engine: the QKV split and RoPE as one kernel each way.

megatron-core's attention splits the fused QKV projection ``[s, b, groups, (q_per_group + 2) x head]``
into query, key and value views and rotates query and key with ``apply_rotary_pos_emb``; under
``model.compile_layers`` inductor turns that into kernels that index the interleaved layout element by
element and take cos and sin of the angle table for every element. On one H100 (the 1.5B proxy, micro-batch
4) those passes and the backward's reassembly of the QKV gradient took 0.70 ms a layer and micro-batch, about
five times what their bytes cost at the GPU's bandwidth (docs/performance.md).

With ``fused_single_qkv_rope`` megatron-core hands the unsplit projection to Transformer Engine's
``apply_fused_qkv_rotary_pos_emb``; where Transformer Engine does not import, :func:`install` gives it
:func:`apply_fused_qkv_rotary_pos_emb` from here. The forward reads each token's projection once and
writes the rotated query and key and the value, in the ``[s, b, heads, head]`` layout the attention takes;
the backward reads their three gradients once and writes the projection's: 0.17 ms a layer and micro-batch
there, the proxy's step 542 -> 529 ms and 1.25 GiB less at its peak (docs/performance.md). Angles come from
megatron-core's table (``[s, 1, 1, rotary dim]`` or one row per token), cos and sin computed in fp32 once per
token and group of heads; a rotary dimension below the head's (``rotary_percent``) leaves the rest of each head
as it is. On CUDA both passes are Triton kernels; elsewhere (the CPU) the same math runs as torch ops.

megatron-core takes this path only with RoPE and without packed sequences or q/k norms;
:func:`~bridge_cli.models.attention.config_checks.check_fused_qkv_rope` refuses the rest before a model is built.
"""

from __future__ import annotations

import functools

import torch

from bridge_cli.runtime.triton_support import available as triton_available

BLOCK_TOKENS = 32
WARPS = 4


def apply_fused_qkv_rotary_pos_emb(mixed_qkv: torch.Tensor, q_freqs: torch.Tensor, k_freqs: torch.Tensor,
                                   split_arg_list: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Transformer Engine's contract as megatron-core calls it: ``mixed_qkv`` ``[s, b, groups, (r + 2) x head]``,
    ``split_arg_list`` ``[r x head, head, head]`` -> query ``[s, b, groups x r, head]``, key and value
    ``[s, b, groups, head]``, query and key rotated by their angle tables."""
    if q_freqs is not k_freqs:  # megatron-core's self-attention passes its one table twice
        raise NotImplementedError("bridge's fused QKV RoPE rotates queries and keys by one angle table")
    head = split_arg_list[1]
    return torch.ops.bridge.qkv_rope(mixed_qkv, q_freqs, split_arg_list[0] // head)


@torch.library.custom_op("bridge::qkv_rope", mutates_args=())
def qkv_rope(mixed_qkv: torch.Tensor, freqs: torch.Tensor, q_per_group: int) -> tuple[torch.Tensor, torch.Tensor,
                                                                                      torch.Tensor]:
    """Split ``mixed_qkv``, rotate its query and key heads by ``freqs`` (:func:`apply_fused_qkv_rotary_pos_emb`)."""
    mixed_qkv, freqs = mixed_qkv.contiguous(), _angles(freqs)
    if mixed_qkv.is_cuda and triton_available():
        query, key, value = _empty_outputs(mixed_qkv, q_per_group)
        _launch(0, mixed_qkv, freqs, query, key, value, q_per_group)
        return query, key, value
    query, key, value = _split(mixed_qkv, q_per_group)
    return _rotate(query, freqs, inverse=False), _rotate(key, freqs, inverse=False), value.clone()


@qkv_rope.register_fake
def _(mixed_qkv, freqs, q_per_group):
    return _empty_outputs(mixed_qkv, q_per_group)


@torch.library.custom_op("bridge::qkv_rope_backward", mutates_args=())
def qkv_rope_backward(grad_query: torch.Tensor, grad_key: torch.Tensor, grad_value: torch.Tensor,
                      freqs: torch.Tensor) -> torch.Tensor:
    """The gradient of :func:`qkv_rope`'s input from its outputs' gradients: ``[s, b, groups, (r + 2) x head]``."""
    grad_query, grad_key, grad_value = (t.contiguous() for t in (grad_query, grad_key, grad_value))
    freqs = _angles(freqs)
    q_per_group = grad_query.shape[2] // grad_key.shape[2]
    if grad_query.is_cuda and triton_available():
        grad_mixed = _empty_input(grad_query, grad_key)
        _launch(1, grad_mixed, freqs, grad_query, grad_key, grad_value, q_per_group)
        return grad_mixed
    s, b, groups, head = grad_key.shape
    query = _rotate(grad_query, freqs, inverse=True).view(s, b, groups, q_per_group, head)
    key = _rotate(grad_key, freqs, inverse=True).unsqueeze(3)
    return torch.cat([query, key, grad_value.unsqueeze(3)], dim=3).view(s, b, groups, -1)


@qkv_rope_backward.register_fake
def _(grad_query, grad_key, grad_value, freqs):
    return _empty_input(grad_query, grad_key)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(inputs[1])


def _backward(ctx, grad_query, grad_key, grad_value):
    (freqs,) = ctx.saved_tensors
    return qkv_rope_backward(grad_query, grad_key, grad_value, freqs), None, None


qkv_rope.register_autograd(_backward, setup_context=_setup_context)


def _empty_outputs(mixed_qkv: torch.Tensor, q_per_group: int):
    s, b, groups, width = mixed_qkv.shape
    head = width // (q_per_group + 2)
    query = mixed_qkv.new_empty(s, b, groups * q_per_group, head)
    return query, mixed_qkv.new_empty(s, b, groups, head), mixed_qkv.new_empty(s, b, groups, head)


def _empty_input(grad_query: torch.Tensor, grad_key: torch.Tensor) -> torch.Tensor:
    s, b, groups, head = grad_key.shape
    return grad_key.new_empty(s, b, groups, (grad_query.shape[2] // groups + 2) * head)


def _split(mixed_qkv: torch.Tensor, q_per_group: int):
    s, b, groups, width = mixed_qkv.shape
    heads = mixed_qkv.view(s, b, groups, q_per_group + 2, width // (q_per_group + 2))
    return heads[:, :, :, :q_per_group].reshape(s, b, groups * q_per_group, -1), heads[:, :, :, -2], heads[:, :, :, -1]


def _angles(freqs: torch.Tensor) -> torch.Tensor:
    """The angle table in fp32 (fp64 stays), contiguous."""
    return freqs.to(torch.promote_types(freqs.dtype, torch.float32)).contiguous()


def _rotate(t: torch.Tensor, freqs: torch.Tensor, inverse: bool) -> torch.Tensor:
    """``t`` [s, b, heads, head] rotated by ``freqs`` [s, 1 or b, 1, rotary dim] (back, with ``inverse``), in
    fp32 or the wider of the two dtypes."""
    rot = freqs.shape[-1]
    half = rot // 2
    x = t[..., :rot].to(torch.promote_types(t.dtype, freqs.dtype))
    cos, sin = freqs.cos(), freqs.sin()
    x1, x2 = x[..., :half], x[..., half:]
    if inverse:  # the transpose of [[cos1, -sin1], [sin2, cos2]]
        out = torch.cat([x1 * cos[..., :half] + x2 * sin[..., half:], x2 * cos[..., half:] - x1 * sin[..., :half]], -1)
    else:
        out = torch.cat([x1 * cos[..., :half] - x2 * sin[..., :half], x2 * cos[..., half:] + x1 * sin[..., half:]], -1)
    return torch.cat([out.to(t.dtype), t[..., rot:]], dim=-1)


def _launch(backward: int, mixed: torch.Tensor, freqs: torch.Tensor, query: torch.Tensor, key: torch.Tensor,
            value: torch.Tensor, q_per_group: int) -> None:
    """Run the forward (``mixed`` -> query, key, value) or backward (the reverse) kernel."""
    s, b, groups, head = key.shape
    tokens = s * b
    if not tokens:
        return
    rot = freqs.shape[-1]
    rows_per_angle = b if freqs.shape[1] == 1 else 1  # one angle row per position, or per token
    grid = (-(-tokens // BLOCK_TOKENS), groups)
    _kernel()[grid](mixed, freqs, query, key, value, tokens, rows_per_angle, groups, q_per_group,
                    HEAD=head, HALF=rot // 2, HEAD_P=_pow2(head), HALF_P=_pow2(rot // 2), PASS=head - rot,
                    PASS_P=_pow2(max(head - rot, 1)), BACKWARD=backward, BLOCK=BLOCK_TOKENS, num_warps=WARPS)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@functools.cache
def _kernel():
    """The Triton kernel, compiled on first use (Triton is imported only here)."""
    import triton
    import triton.language as tl

    @triton.jit
    def split_rotate(mixed_ptr, freqs_ptr, q_ptr, k_ptr, v_ptr, tokens, rows_per_angle, groups, q_per_group,
                     HEAD: tl.constexpr, HALF: tl.constexpr, HEAD_P: tl.constexpr, HALF_P: tl.constexpr,
                     PASS: tl.constexpr, PASS_P: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
        """BLOCK tokens of one query group: its query heads and key head rotated, its value head copied."""
        token = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)[:, None]
        group = tl.program_id(1)
        rows_ok = token < tokens
        cols = tl.arange(0, HALF_P)[None, :]
        ok = rows_ok & (cols < HALF)
        angle_row = (token // rows_per_angle) * (2 * HALF)
        a1 = tl.load(freqs_ptr + angle_row + cols, mask=ok, other=0.0)
        a2 = tl.load(freqs_ptr + angle_row + HALF + cols, mask=ok, other=0.0)
        c1, s1, c2, s2 = tl.cos(a1), tl.sin(a1), tl.cos(a2), tl.sin(a2)
        mixed_rows = mixed_ptr + token * (groups * (q_per_group + 2) * HEAD) + group * ((q_per_group + 2) * HEAD)
        kv_rows = token * (groups * HEAD) + group * HEAD
        rest = tl.arange(0, PASS_P)[None, :]
        keep = rows_ok & (rest < PASS)
        for i in range(q_per_group + 1):  # the group's query heads, then its key head
            if i < q_per_group:
                split = q_ptr + token * (groups * q_per_group * HEAD) + (group * q_per_group + i) * HEAD
            else:
                split = k_ptr + kv_rows
            if BACKWARD:
                src, dst = split, mixed_rows + i * HEAD
            else:
                src, dst = mixed_rows + i * HEAD, split
            x1 = tl.load(src + cols, mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(src + HALF + cols, mask=ok, other=0.0).to(tl.float32)
            if BACKWARD:  # the transpose of [[cos1, -sin1], [sin2, cos2]]
                y1 = x1 * c1 + x2 * s2
                y2 = x2 * c2 - x1 * s1
            else:
                y1 = x1 * c1 - x2 * s1
                y2 = x2 * c2 + x1 * s2
            tl.store(dst + cols, y1.to(dst.dtype.element_ty), mask=ok)
            tl.store(dst + HALF + cols, y2.to(dst.dtype.element_ty), mask=ok)
            if PASS > 0:  # the channels past the rotary dimension, as they are
                tl.store(dst + 2 * HALF + rest, tl.load(src + 2 * HALF + rest, mask=keep), mask=keep)
        head_cols = tl.arange(0, HEAD_P)[None, :]
        whole = rows_ok & (head_cols < HEAD)
        v_slot = mixed_rows + (q_per_group + 1) * HEAD
        if BACKWARD:
            tl.store(v_slot + head_cols, tl.load(v_ptr + kv_rows + head_cols, mask=whole), mask=whole)
        else:
            tl.store(v_ptr + kv_rows + head_cols, tl.load(v_slot + head_cols, mask=whole), mask=whole)

    return split_rotate


def install() -> None:
    """Give megatron-core's attention this module's fused QKV RoPE where Transformer Engine's does not import."""
    from megatron.core.transformer import attention

    if not attention.HAVE_FUSED_QKV_ROPE:
        attention.apply_fused_qkv_rotary_pos_emb = apply_fused_qkv_rotary_pos_emb
        attention.HAVE_FUSED_QKV_ROPE = True
