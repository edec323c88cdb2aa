"""Variable-length (packed) attention ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, CPU
reference.

Sequences of different lengths packed one after another without padding, FlashAttention's ``flash_attn_varlen_func``
layout: query (total_q, H, D), key (total_k, H_kv, D), value (total_k, H_kv, Dv). ``fusedlayers.functional.
varlen_attention`` turns the cumulative lengths (and causal / window) into key intervals and calls:

- ``varlen_attention(query, key, value, row_lo, row_hi, col_lo, col_hi, seed, dropout_p, scale, softcap)
  -> (out (total_q, H, Dv), lse (H, total_q))``: query row i attends keys [row_lo[i], row_hi[i]] (int32; an empty
  interval gives a zero row), key j is attended by queries [col_lo[j], col_hi[j]] (the same relation, seen from the
  keys: the backward's dK/dV kernel visits only those query blocks).
- ``varlen_attention_backward(grad_out, query, key, value, out, lse, row_lo, row_hi, col_lo, col_hi, seed,
  dropout_p, scale, softcap, need_dq, need_dk, need_dv) -> (dq, dk, dv)``.

The attention kernels of ``fusedlayers.kernels.scaled_dot_product_attention`` run them (their INTERVALS mode: the
packed tensors seen as one batch row of total_q queries and total_k keys, through strides, never copied), blocks no
row's interval reaches skipped; float64, or CPU tensors without the interpreter, run the blockwise PyTorch reference
of the same module with the same intervals, chunk by chunk of queries against the keys their intervals span.
Dropout, GQA, soft-capping, deterministic backward: as the dense op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers.ops import scaled_dot_product_attention as attn
from fusedlayers.ops._eager import call, custom_op, register_autograd


def _dense(t: Tensor) -> Tensor:
    """(total, H, D) as the (1, H, total, D) view the dense kernels and the reference take (no copy)."""
    return t.transpose(0, 1).unsqueeze(0)


def _drop(seed: Tensor | None, dropout_p: float):
    return attn.dropout_params(seed, dropout_p) if seed is not None and dropout_p > 0.0 else None


def _chunks(row_lo: Tensor, row_hi: Tensor, total_q: int):
    """The reference's pieces: query rows [m0, m1) in chunks of REFERENCE_BLOCK_N and the keys [k0, k1) their
    intervals span (k1 <= k0: none), so that no work goes to keys no row of the chunk may see."""
    lo, hi = row_lo.tolist(), row_hi.tolist()
    for m0 in range(0, total_q, attn.REFERENCE_BLOCK_N):
        m1 = min(total_q, m0 + attn.REFERENCE_BLOCK_N)
        yield m0, m1, min(lo[m0:m1]), max(hi[m0:m1]) + 1


def _new_outputs(query: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    out = query.new_empty((query.shape[0], query.shape[1], value.shape[2]))
    lse = query.new_empty((query.shape[1], query.shape[0]), dtype=attn.lse_dtype(query.dtype))
    return out, lse


@custom_op("fusedlayers::varlen_attention")
def varlen_attention(
    query: Tensor, key: Tensor, value: Tensor, row_lo: Tensor, row_hi: Tensor, col_lo: Tensor, col_hi: Tensor,
    seed: Tensor | None, dropout_p: float, scale: float, softcap: float,
) -> tuple[Tensor, Tensor]:
    out, lse = _new_outputs(query, value)
    if out.numel() == 0:
        return out, lse.fill_(float("inf"))
    if key.shape[0] == 0:  # no keys: every row is empty
        return out.zero_(), lse.fill_(float("inf"))
    intervals = (row_lo, row_hi, col_lo, col_hi)
    q4, k4, v4 = _dense(query), _dense(key), _dense(value)
    if attn._run_kernel(q4, v4):
        attn.kernels.attention_forward(q4, k4, v4, None, _drop(seed, dropout_p), False, scale, _dense(out),
                                       lse.unsqueeze(0), softcap=softcap, intervals=intervals)
        return out, lse
    out4 = _dense(out)
    for m0, m1, k0, k1 in _chunks(row_lo, row_hi, query.shape[0]):
        if k1 <= k0:  # no row of the chunk sees a key
            out4[:, :, m0:m1].zero_()
            lse[:, m0:m1] = float("inf")
            continue
        out_r, lse_r = attn.attention_forward_reference(
            q4[:, :, m0:m1], k4[:, :, k0:k1], v4[:, :, k0:k1], None, seed, dropout_p, False, scale, softcap=softcap,
            intervals=(row_lo[m0:m1], row_hi[m0:m1]), offsets=(m0, k0))
        out4[:, :, m0:m1] = out_r
        lse[:, m0:m1] = lse_r[0]
    return out, lse


@varlen_attention.register_fake
def _(query, key, value, row_lo, row_hi, col_lo, col_hi, seed, dropout_p, scale, softcap):
    return _new_outputs(query, value)


def _setup_context(ctx, inputs, output):
    query, key, value, row_lo, row_hi, col_lo, col_hi, seed, dropout_p, scale, softcap = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.dropout_p, ctx.scale, ctx.softcap = dropout_p, scale, softcap
    ctx.save_for_backward(query, key, value, out, lse, row_lo, row_hi, col_lo, col_hi, seed)


def _autograd(ctx, grad_out, _grad_lse):
    query, key, value, out, lse, row_lo, row_hi, col_lo, col_hi, seed = ctx.saved_tensors
    need_dq, need_dk, need_dv = ctx.needs_input_grad[:3]
    nones = (None,) * 8
    if not (need_dq or need_dk or need_dv):
        return None, None, None, *nones
    dq, dk, dv = call(varlen_attention_backward, grad_out, query, key, value, out, lse, row_lo, row_hi, col_lo,
                      col_hi, seed, ctx.dropout_p, ctx.scale, ctx.softcap, need_dq, need_dk, need_dv)
    return dq if need_dq else None, dk if need_dk else None, dv if need_dv else None, *nones


register_autograd(varlen_attention, _autograd, _setup_context)


def _new_grads(query, key, value, need_dq, need_dk, need_dv):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if need else t.new_empty((0,))
                 for t, need in ((query, need_dq), (key, need_dk), (value, need_dv)))


@custom_op("fusedlayers::varlen_attention_backward")
def varlen_attention_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, row_lo: Tensor,
    row_hi: Tensor, col_lo: Tensor, col_hi: Tensor, seed: Tensor | None, dropout_p: float, scale: float,
    softcap: float, need_dq: bool, need_dk: bool, need_dv: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _new_grads(query, key, value, need_dq, need_dk, need_dv)
    if query.shape[0] == 0 or key.shape[0] == 0 or query.shape[1] == 0:  # nothing attends: zero gradients
        return dq.zero_(), dk.zero_(), dv.zero_()
    intervals = (row_lo, row_hi, col_lo, col_hi)
    q4, k4, v4 = _dense(query), _dense(key), _dense(value)
    if attn._run_kernel(q4, v4):
        attn.kernels.attention_backward(
            _dense(grad_out), q4, k4, v4, _dense(out), lse.unsqueeze(0), None, _drop(seed, dropout_p), False, scale,
            _dense(dq) if need_dq else None, _dense(dk) if need_dk else None, _dense(dv) if need_dv else None, None,
            query.dtype == torch.float32, softcap=softcap, intervals=intervals,
        )
        return dq, dk, dv
    dq4, dk4, dv4 = (_dense(t) if need else None for t, need in ((dq, need_dq), (dk, need_dk), (dv, need_dv)))
    for t in (dq4, dk4, dv4):
        if t is not None:
            t.zero_()
    g4, o4, lse4 = _dense(grad_out), _dense(out), lse.unsqueeze(0)
    for m0, m1, k0, k1 in _chunks(row_lo, row_hi, query.shape[0]):
        if k1 <= k0:
            continue
        gq, gk, gv, _ = attn.attention_backward_reference(
            g4[:, :, m0:m1], q4[:, :, m0:m1], k4[:, :, k0:k1], v4[:, :, k0:k1], o4[:, :, m0:m1], lse4[:, :, m0:m1],
            None, seed, dropout_p, False, scale, need_dq, need_dk, need_dv, False, softcap=softcap,
            intervals=(row_lo[m0:m1], row_hi[m0:m1]), offsets=(m0, k0))
        if need_dq:
            dq4[:, :, m0:m1] = gq
        if need_dk:  # the chunks' query rows all add into the keys they saw
            dk4[:, :, k0:k1] += gk
        if need_dv:
            dv4[:, :, k0:k1] += gv
    return dq, dk, dv


@varlen_attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, row_lo, row_hi, col_lo, col_hi, seed, dropout_p, scale, softcap,
      need_dq, need_dk, need_dv):
    return _new_grads(query, key, value, need_dq, need_dk, need_dv)
