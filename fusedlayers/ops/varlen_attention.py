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

``fusedlayers.kernels.varlen_attention`` runs them on the attention kernels' INTERVALS mode (the packed tensors seen
as one batch row of total_q queries and total_k keys, through strides, never copied), blocks no row's interval
reaches skipped; float64, or CPU tensors without the interpreter, run the blockwise PyTorch reference of
``ops/scaled_dot_product_attention.py`` with the same intervals, in batches of query chunks, each against the keys its
rows' intervals span.
Dropout, GQA, soft-capping, deterministic backward: as the dense op.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers.ops import scaled_dot_product_attention as attn
from fusedlayers.ops._eager import call, custom_op, register_autograd

try:
    from fusedlayers.kernels import varlen_attention as kernels
except ImportError:  # no Triton (macOS, Windows): the reference runs everywhere
    kernels = None


def _run_kernel(query: Tensor, value: Tensor) -> bool:
    return kernels is not None and attn._run_kernel(query, value)


def _drop(seed: Tensor | None, dropout_p: float):
    return attn.dropout_params(seed, dropout_p) if seed is not None and dropout_p > 0.0 else None


# Query rows per chunk of the reference (each chunk runs against the keys its rows' intervals span: small chunks
# waste little on keys of their first sequence's earlier rows) and elements of gathered keys and values per batch of
# chunks (bounds its copies: 64 MiB in fp32).
REFERENCE_QUERY_CHUNK = 32
REFERENCE_GATHER_BUDGET = 1 << 24


class _Chunks:
    """The reference's pieces: query rows in chunks of REFERENCE_QUERY_CHUNK, each against the keys [k0, k0 + W) its
    rows' intervals span (no work goes to keys no row of the chunk may see), run in batches of chunks of similar
    spans (sorted; keys gathered per chunk, clamped past the end, the intervals mask what lies outside; batches
    sized by REFERENCE_GATHER_BUDGET), each batch's keys in one block. Rows past the last query are padding with
    empty intervals."""

    def __init__(self, row_lo: Tensor, row_hi: Tensor, total_q: int, total_k: int, heads: int, heads_kv: int,
                 width: int):
        m = REFERENCE_QUERY_CHUNK
        n = -(-total_q // m)
        pad = n * m - total_q
        self.m, self.total_q, self.total_k = m, total_q, total_k
        self.lo = torch.nn.functional.pad(row_lo.to(torch.int64), (0, pad), value=1).view(n, m)
        self.hi = torch.nn.functional.pad(row_hi.to(torch.int64), (0, pad), value=0).view(n, m)
        k0 = torch.where(self.hi >= self.lo, self.lo, total_k).amin(1)
        k1 = torch.where(self.hi >= self.lo, self.hi + 1, 0).amax(1)
        self.k0, spans = k0, (k1 - k0).clamp(min=0)
        self.row_index = torch.arange(n * m, device=row_lo.device).view(n, m)
        order = torch.argsort(spans, stable=True)
        per_key = max(heads_kv * width, heads * m)  # elements per key of a chunk: gathered K and V, all heads' scores
        self.groups, group, first, widest = [], [], 0, 0  # (chunk indices, the widest span among them)
        for c, span in zip(order.tolist(), spans[order].tolist(), strict=True):
            # a new batch when this one would pass the budget or pad its narrowest chunk by more than a quarter
            full = (len(group) + 1) * span * per_key > REFERENCE_GATHER_BUDGET
            if group and (full or span > first * 5 // 4 + 16):
                self.groups.append((torch.tensor(group, device=row_lo.device), widest))
                group = []
            if not group:
                first = span
            group.append(c)
            widest = span
        if group:
            self.groups.append((torch.tensor(group, device=row_lo.device), widest))

    def rows(self, chunks: Tensor) -> tuple[Tensor, Tensor]:
        """(query row of each (chunk, row) clamped into range, which of them are real rows), both (chunks, m)."""
        index = self.row_index[chunks]
        return index.clamp(max=self.total_q - 1), index < self.total_q

    def queries(self, t: Tensor, chunks: Tensor) -> Tensor:
        """A (total_q, H, ...) tensor's rows of ``chunks``, as (chunks, H, m, ...)."""
        return t[self.rows(chunks)[0]].transpose(1, 2)

    def key_index(self, chunks: Tensor, width: int) -> Tensor:
        return (self.k0[chunks, None] + torch.arange(width, device=self.k0.device)).clamp(max=self.total_k - 1)

    def keys(self, t: Tensor, index: Tensor) -> Tensor:
        """(total_k, H_kv, D) gathered to (chunks, H_kv, width, D)."""
        return t[index].transpose(1, 2)

    def reference_args(self, chunks: Tensor) -> dict:
        return dict(intervals=(self.lo[chunks], self.hi[chunks]), offsets=(self.row_index[chunks, 0], self.k0[chunks]))

    def put(self, dest: Tensor, t: Tensor, chunks: Tensor) -> None:
        """(chunks, H, m, ...) results written to the real rows of a (total_q, H, ...) ``dest``."""
        index, real = self.rows(chunks)
        dest[index[real]] = t.transpose(1, 2)[real].to(dest.dtype)


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
    if _run_kernel(query, value):
        kernels.varlen_attention_forward(query, key, value, (row_lo, row_hi, col_lo, col_hi), _drop(seed, dropout_p),
                                         scale, softcap, out, lse)
        return out, lse
    chunks = _Chunks(row_lo, row_hi, query.shape[0], key.shape[0], query.shape[1], key.shape[1],
                     key.shape[2] + value.shape[2])
    lse_rows = lse.T  # (total_q, H) view: written through
    for group, width in chunks.groups:
        if width == 0:  # no row of these chunks sees a key
            index, real = chunks.rows(group)
            out[index[real]] = 0.0
            lse_rows[index[real]] = float("inf")
            continue
        keys = chunks.key_index(group, width)
        out_r, lse_r = attn.attention_forward_reference(
            chunks.queries(query, group), chunks.keys(key, keys), chunks.keys(value, keys), None, seed, dropout_p,
            False, scale, block_n=width, softcap=softcap, **chunks.reference_args(group))
        chunks.put(out, out_r, group)
        chunks.put(lse_rows, lse_r, group)
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
    if _run_kernel(query, value):
        kernels.varlen_attention_backward(grad_out, query, key, value, out, lse, (row_lo, row_hi, col_lo, col_hi),
                                          _drop(seed, dropout_p), scale, softcap, dq if need_dq else None,
                                          dk if need_dk else None, dv if need_dv else None)
        return dq, dk, dv
    for t in (dq, dk, dv):
        t.zero_()
    chunks = _Chunks(row_lo, row_hi, query.shape[0], key.shape[0], query.shape[1], key.shape[1],
                     key.shape[2] + value.shape[2])
    for group, width in chunks.groups:
        if width == 0:
            continue
        keys = chunks.key_index(group, width)
        gq, gk, gv, _ = attn.attention_backward_reference(
            chunks.queries(grad_out, group), chunks.queries(query, group), chunks.keys(key, keys),
            chunks.keys(value, keys), chunks.queries(out, group), chunks.queries(lse.T, group),
            None, seed, dropout_p, False, scale, need_dq, need_dk, need_dv, False, block_n=width, softcap=softcap,
            **chunks.reference_args(group))
        if need_dq:
            chunks.put(dq, gq, group)
        flat = keys.reshape(-1)  # the chunks' rows all add into the keys they saw (clamped copies add zeros)
        if need_dk:
            dk.index_add_(0, flat, gk.transpose(1, 2).reshape(flat.numel(), *dk.shape[1:]))
        if need_dv:
            dv.index_add_(0, flat, gv.transpose(1, 2).reshape(flat.numel(), *dv.shape[1:]))
    return dq, dk, dv


@varlen_attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, row_lo, row_hi, col_lo, col_hi, seed, dropout_p, scale, softcap,
      need_dq, need_dk, need_dv):
    return _new_grads(query, key, value, need_dq, need_dk, need_dv)
