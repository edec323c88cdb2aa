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


# Elements of gathered keys and values per batch of reference chunks (bounds its copies: 64 MiB in fp32).
REFERENCE_GATHER_BUDGET = 1 << 24


class _Chunks:
    """The reference's pieces: query rows in chunks of REFERENCE_BLOCK_N, each against the keys [k0, k0 + W) its
    rows' intervals span (no work goes to keys no row of the chunk may see), run as a batch of chunks: keys gathered
    per chunk (clamped past the end; the intervals mask what lies outside), groups of chunks sized by
    REFERENCE_GATHER_BUDGET. Rows past the last query are padding with empty intervals."""

    def __init__(self, row_lo: Tensor, row_hi: Tensor, total_q: int, total_k: int, heads_kv: int, width: int):
        m = attn.REFERENCE_BLOCK_N
        n = -(-total_q // m)
        pad = n * m - total_q
        self.m, self.n, self.total_q, self.total_k = m, n, total_q, total_k
        self.lo = torch.nn.functional.pad(row_lo.to(torch.int64), (0, pad), value=1).view(n, m)
        self.hi = torch.nn.functional.pad(row_hi.to(torch.int64), (0, pad), value=0).view(n, m)
        k0 = torch.where(self.hi >= self.lo, self.lo, total_k).amin(1)
        k1 = torch.where(self.hi >= self.lo, self.hi + 1, 0).amax(1)
        self.k0, self.spans = k0, (k1 - k0).clamp(min=0)
        self.rows0 = torch.arange(n, device=row_lo.device) * m
        spans = self.spans.tolist()
        self.groups, start, widest = [], 0, 0  # [c0, c1) chunks with the widest span among them
        for c, span in enumerate(spans):
            wider = max(widest, span)
            if c > start and (c + 1 - start) * wider * heads_kv * width > REFERENCE_GATHER_BUDGET:
                self.groups.append((start, c, widest))
                start, wider = c, span
            widest = wider
        self.groups.append((start, n, widest))

    def queries(self, t: Tensor, c0: int, c1: int) -> Tensor:
        """Rows of the chunks [c0, c1) of a (total_q, H, D) tensor, as (chunks, H, m, D) (zero rows past the end)."""
        rows = t[c0 * self.m:c1 * self.m]
        rows = torch.nn.functional.pad(rows, (0, 0) * (t.dim() - 1) + (0, (c1 - c0) * self.m - rows.shape[0]))
        return rows.reshape(c1 - c0, self.m, *t.shape[1:]).transpose(1, 2)

    def key_index(self, c0: int, c1: int, width: int) -> Tensor:
        return (self.k0[c0:c1, None] + torch.arange(width, device=self.k0.device)).clamp(max=self.total_k - 1)

    def keys(self, t: Tensor, index: Tensor) -> Tensor:
        """(total_k, H_kv, D) gathered to (chunks, H_kv, width, D)."""
        return t[index].transpose(1, 2)

    def reference_args(self, c0: int, c1: int) -> dict:
        return dict(intervals=(self.lo[c0:c1], self.hi[c0:c1]), offsets=(self.rows0[c0:c1], self.k0[c0:c1]))

    def rows(self, t: Tensor, total: int) -> Tensor:
        """(chunks, H, m, ...) back to (rows, H, ...), padding rows dropped."""
        return t.transpose(1, 2).reshape(-1, *t.shape[1:2], *t.shape[3:])[:total]


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
    chunks = _Chunks(row_lo, row_hi, query.shape[0], key.shape[0], key.shape[1], key.shape[2] + value.shape[2])
    for c0, c1, width in chunks.groups:
        if width == 0:  # no row of these chunks sees a key
            out[c0 * chunks.m:c1 * chunks.m].zero_()
            lse[:, c0 * chunks.m:c1 * chunks.m] = float("inf")
            continue
        index = chunks.key_index(c0, c1, width)
        out_r, lse_r = attn.attention_forward_reference(
            chunks.queries(query, c0, c1), chunks.keys(key, index), chunks.keys(value, index), None, seed, dropout_p,
            False, scale, softcap=softcap, **chunks.reference_args(c0, c1))
        rows = slice(c0 * chunks.m, min(c1 * chunks.m, query.shape[0]))
        out[rows] = chunks.rows(out_r, rows.stop - rows.start)
        lse[:, rows] = chunks.rows(lse_r[..., None], rows.stop - rows.start)[..., 0].T
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
    for t in (dq, dk, dv):
        t.zero_()
    chunks = _Chunks(row_lo, row_hi, query.shape[0], key.shape[0], key.shape[1], key.shape[2] + value.shape[2])
    for c0, c1, width in chunks.groups:
        if width == 0:
            continue
        index = chunks.key_index(c0, c1, width)
        gq, gk, gv, _ = attn.attention_backward_reference(
            chunks.queries(grad_out, c0, c1), chunks.queries(query, c0, c1), chunks.keys(key, index),
            chunks.keys(value, index), chunks.queries(out, c0, c1), chunks.queries(lse.T, c0, c1),
            None, seed, dropout_p, False, scale, need_dq, need_dk, need_dv, False, softcap=softcap,
            **chunks.reference_args(c0, c1))
        rows = slice(c0 * chunks.m, min(c1 * chunks.m, query.shape[0]))
        if need_dq:
            dq[rows] = chunks.rows(gq, rows.stop - rows.start)
        flat = index.reshape(-1)  # the chunks' rows all add into the keys they saw (clamped copies add zeros)
        if need_dk:
            dk.index_add_(0, flat, gk.transpose(1, 2).reshape(flat.numel(), *dk.shape[1:]))
        if need_dv:
            dv.index_add_(0, flat, gv.transpose(1, 2).reshape(flat.numel(), *dv.shape[1:]))
    return dq, dk, dv


@varlen_attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, row_lo, row_hi, col_lo, col_hi, seed, dropout_p, scale, softcap,
      need_dq, need_dk, need_dv):
    return _new_grads(query, key, value, need_dq, need_dk, need_dv)
