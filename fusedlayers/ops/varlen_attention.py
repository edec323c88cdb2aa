"""Variable-length (packed) attention ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, CPU
reference.

Sequences of different lengths packed one after another without padding, FlashAttention's ``flash_attn_varlen_func``
layout: query (total_q, H, D), key (total_k, H_kv, D), value (total_k, H_kv, Dv). ``fusedlayers.functional.
varlen_attention`` turns the cumulative lengths (and causal / window) into key intervals and calls:

- ``varlen_attention(query, key, value, row_lo, row_hi, col_lo, col_hi, seed, dropout_p, scale, softcap,
  keys_per_row) -> (out (total_q, H, Dv), lse (H, total_q))``: query row i attends keys [row_lo[i], row_hi[i]]
  (int32; an empty interval gives a zero row), key j is attended by queries [col_lo[j], col_hi[j]] (the same
  relation, seen from the keys: the backward's dK/dV kernel visits only those query blocks); ``keys_per_row``: an
  estimate of the keys a row attends (from the lengths and window, without reading the intervals), which sizes the
  call for the choice of kernels.
- ``varlen_attention_backward(grad_out, query, key, value, out, lse, row_lo, row_hi, col_lo, col_hi, seed,
  dropout_p, scale, softcap, keys_per_row, need_dq, need_dk, need_dv) -> (dq, dk, dv)``.

``fusedlayers.kernels.varlen_attention`` runs them on the attention kernels' INTERVALS mode (the packed tensors seen
as one batch row of total_q queries and total_k keys, through strides, never copied), blocks no row's interval
reaches skipped; float64, or CPU tensors without the interpreter, run the blockwise PyTorch reference of
``ops/scaled_dot_product_attention.py`` with the same intervals, in batches of query chunks, each against the keys its
rows' intervals span.
Dropout, GQA, soft-capping, the backward's determinism: as the dense op.
"""

from __future__ import annotations

from typing import NamedTuple

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


class _Group(NamedTuple):
    """A batch of chunks: the query row of each (chunk, row) clamped into range (chunks, m), which of them are real
    rows, the real ones flat, the keys gathered per chunk (chunks, width), and the reference's arguments."""

    rows: Tensor
    real: Tensor
    real_rows: Tensor
    keys: Tensor
    reference_args: dict


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
        lo = torch.nn.functional.pad(row_lo.to(torch.int64), (0, pad), value=1).view(n, m)
        hi = torch.nn.functional.pad(row_hi.to(torch.int64), (0, pad), value=0).view(n, m)
        k0 = torch.where(hi >= lo, lo, total_k).amin(1)
        spans = (torch.where(hi >= lo, hi + 1, 0).amax(1) - k0).clamp(min=0)
        row_index = torch.arange(n * m, device=row_lo.device).view(n, m)
        order = torch.argsort(spans, stable=True)
        per_key = max(heads_kv * width, heads * m)  # elements per key of a chunk: gathered K and V, all heads' scores
        batches, batch, first, widest = [], [], 0, 0  # (chunk indices, the widest span among them)
        for c, span in zip(order.tolist(), spans[order].tolist(), strict=True):
            # a new batch when this one would pass the budget or pad its narrowest chunk by more than a quarter
            full = (len(batch) + 1) * span * per_key > REFERENCE_GATHER_BUDGET
            if batch and (full or span > first * 5 // 4 + 16):
                batches.append((batch, widest))
                batch = []
            if not batch:
                first = span
            batch.append(c)
            widest = span
        if batch:
            batches.append((batch, widest))
        self.groups = []
        for chunks, span in batches:
            chunks = torch.tensor(chunks, device=row_lo.device)
            index = row_index[chunks]
            real = index < total_q
            keys = (k0[chunks, None] + torch.arange(span, device=k0.device)).clamp(max=max(total_k - 1, 0))
            args = dict(intervals=(lo[chunks], hi[chunks]), offsets=(index[:, 0], k0[chunks]))
            self.groups.append((_Group(index.clamp(max=total_q - 1), real, index[real], keys, args), span))

    @staticmethod
    def queries(t: Tensor, group: _Group) -> Tensor:
        """A (total_q, H, ...) tensor's rows of the group's chunks, as (chunks, H, m, ...)."""
        return t[group.rows].transpose(1, 2)

    @staticmethod
    def keys(t: Tensor, group: _Group) -> Tensor:
        """(total_k, H_kv, D) gathered to (chunks, H_kv, width, D)."""
        return t[group.keys].transpose(1, 2)

    @staticmethod
    def put(dest: Tensor, t: Tensor, group: _Group) -> None:
        """(chunks, H, m, ...) results written to the real rows of a (total_q, H, ...) ``dest``."""
        dest[group.real_rows] = t.transpose(1, 2)[group.real].to(dest.dtype)


# The last plan: a model's layers call the op with the same interval tensors (fusedlayers.functional reuses them),
# forward and backward; a hit needs the very tensors, unmodified, and the same shapes.
_last_chunks: list = [((), None)]  # one (key, plan) pair, swapped whole: threads never see half of one


def _chunks(row_lo: Tensor, row_hi: Tensor, query: Tensor, key: Tensor, value: Tensor) -> _Chunks:
    shape = (query.shape[0], key.shape[0], query.shape[1], key.shape[1], key.shape[2] + value.shape[2],
             REFERENCE_QUERY_CHUNK, REFERENCE_GATHER_BUDGET)
    if row_lo.is_inference() or row_hi.is_inference():  # no _version to tell a change by: not cached
        return _Chunks(row_lo, row_hi, *shape[:5])
    key_ = (row_lo, row_lo._version, row_hi, row_hi._version, shape)
    cached, plan = _last_chunks[0]
    if len(cached) == len(key_) and cached[0] is row_lo and cached[2] is row_hi and cached[3:] == key_[3:] \
            and cached[1] == key_[1]:
        return plan
    plan = _Chunks(row_lo, row_hi, *shape[:5])
    _last_chunks[0] = (key_, plan)
    return plan


def _new_outputs(query: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
    out = query.new_empty((query.shape[0], query.shape[1], value.shape[2]))
    lse = query.new_empty((query.shape[1], query.shape[0]), dtype=attn.lse_dtype(query.dtype))
    return out, lse


@custom_op("fusedlayers::varlen_attention")
def varlen_attention(
    query: Tensor, key: Tensor, value: Tensor, row_lo: Tensor, row_hi: Tensor, col_lo: Tensor, col_hi: Tensor,
    seed: Tensor | None, dropout_p: float, scale: float, softcap: float, keys_per_row: float,
) -> tuple[Tensor, Tensor]:
    out, lse = _new_outputs(query, value)
    if out.numel() == 0:
        return out, lse.fill_(float("inf"))
    if key.shape[0] == 0:  # no keys: every row is empty
        return out.zero_(), lse.fill_(float("inf"))
    if _run_kernel(query, value):
        kernels.varlen_attention_forward(query, key, value, (row_lo, row_hi, col_lo, col_hi), _drop(seed, dropout_p),
                                         scale, softcap, out, lse, keys_per_row)
        return out, lse
    chunks = _chunks(row_lo, row_hi, query, key, value)
    lse_rows = lse.T  # (total_q, H) view: written through
    for group, width in chunks.groups:
        if width == 0:  # no row of these chunks sees a key
            out[group.real_rows] = 0.0
            lse_rows[group.real_rows] = float("inf")
            continue
        out_r, lse_r = attn.attention_forward_reference(
            chunks.queries(query, group), chunks.keys(key, group), chunks.keys(value, group), None, seed, dropout_p,
            False, scale, block_n=width, softcap=softcap, **group.reference_args)
        chunks.put(out, out_r, group)
        chunks.put(lse_rows, lse_r, group)
    return out, lse


@varlen_attention.register_fake
def _(query, key, value, row_lo, row_hi, col_lo, col_hi, seed, dropout_p, scale, softcap, keys_per_row):
    return _new_outputs(query, value)


def _setup_context(ctx, inputs, output):
    query, key, value, row_lo, row_hi, col_lo, col_hi, seed, dropout_p, scale, softcap, keys_per_row = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.dropout_p, ctx.scale, ctx.softcap, ctx.keys_per_row = dropout_p, scale, softcap, keys_per_row
    ctx.save_for_backward(query, key, value, out, lse, row_lo, row_hi, col_lo, col_hi, seed)


def _autograd(ctx, grad_out, _grad_lse):
    query, key, value, out, lse, row_lo, row_hi, col_lo, col_hi, seed = ctx.saved_tensors
    need_dq, need_dk, need_dv = ctx.needs_input_grad[:3]
    nones = (None,) * 9
    if not (need_dq or need_dk or need_dv):
        return None, None, None, *nones
    dq, dk, dv = call(varlen_attention_backward, grad_out, query, key, value, out, lse, row_lo, row_hi, col_lo,
                      col_hi, seed, ctx.dropout_p, ctx.scale, ctx.softcap, ctx.keys_per_row, need_dq, need_dk,
                      need_dv)
    return dq if need_dq else None, dk if need_dk else None, dv if need_dv else None, *nones


register_autograd(varlen_attention, _autograd, _setup_context)


def _new_grads(query, key, value, need_dq, need_dk, need_dv):
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) if need else t.new_empty((0,))
                 for t, need in ((query, need_dq), (key, need_dk), (value, need_dv)))


@custom_op("fusedlayers::varlen_attention_backward")
def varlen_attention_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor, row_lo: Tensor,
    row_hi: Tensor, col_lo: Tensor, col_hi: Tensor, seed: Tensor | None, dropout_p: float, scale: float,
    softcap: float, keys_per_row: float, need_dq: bool, need_dk: bool, need_dv: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = _new_grads(query, key, value, need_dq, need_dk, need_dv)
    if query.shape[0] == 0 or key.shape[0] == 0 or query.shape[1] == 0:  # nothing attends: zero gradients
        return dq.zero_(), dk.zero_(), dv.zero_()
    if _run_kernel(query, value):
        kernels.varlen_attention_backward(grad_out, query, key, value, out, lse, (row_lo, row_hi, col_lo, col_hi),
                                          _drop(seed, dropout_p), scale, softcap, dq if need_dq else None,
                                          dk if need_dk else None, dv if need_dv else None, keys_per_row)
        return dq, dk, dv
    for t in (dq, dk, dv):
        t.zero_()
    chunks = _chunks(row_lo, row_hi, query, key, value)
    for group, width in chunks.groups:
        if width == 0:
            continue
        gq, gk, gv, _ = attn.attention_backward_reference(
            chunks.queries(grad_out, group), chunks.queries(query, group), chunks.keys(key, group),
            chunks.keys(value, group), chunks.queries(out, group), chunks.queries(lse.T, group),
            None, seed, dropout_p, False, scale, need_dq, need_dk, need_dv, False, block_n=width, softcap=softcap,
            **group.reference_args)
        if need_dq:
            chunks.put(dq, gq, group)
        flat = group.keys.reshape(-1)  # the chunks' rows all add into the keys they saw (clamped copies add zeros)
        if need_dk:
            dk.index_add_(0, flat, gk.transpose(1, 2).reshape(flat.numel(), *dk.shape[1:]))
        if need_dv:
            dv.index_add_(0, flat, gv.transpose(1, 2).reshape(flat.numel(), *dv.shape[1:]))
    return dq, dk, dv


@varlen_attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, row_lo, row_hi, col_lo, col_hi, seed, dropout_p, scale, softcap,
      keys_per_row, need_dq, need_dk, need_dv):
    return _new_grads(query, key, value, need_dq, need_dk, need_dv)
