"""Attention ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, autocast, CPU reference.

Ops (``fusedlayers.functional.scaled_dot_product_attention`` validates the input and calls them):

- ``scaled_dot_product_attention(q, k, v, attn_mask, seed, dropout_p, is_causal, scale) -> (out, lse)``:
  q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv) with H a multiple of H_kv (grouped-query
  attention reads key/value head h // (H // H_kv); nothing is expanded). ``attn_mask`` None, bool
  (True = keep) or additive float, broadcastable to (B, H, L, S); ``is_causal`` keeps key j for query i
  when j <= i (top-left, as F.scaled_dot_product_attention; may be combined with ``attn_mask``).
  ``seed`` None (no dropout) or an int64 CPU tensor of two values in [0, 2**31): the dropout mask is a
  counter-based hash of (key, query, b*H + h) under it, so the backward regenerates it. Returns the
  output (B, H, L, Dv) and the logsumexp of the scaled, masked scores (B, H, L), fp32 (fp64 for fp64
  input), +inf on rows where every key is masked (their output is 0).
- ``scaled_dot_product_attention_backward(grad_out, q, k, v, out, lse, attn_mask, seed, dropout_p,
  is_causal, scale, need_dq, need_dk, need_dv, need_dmask) -> (dq, dk, dv, ds)``: the gradients asked
  for (an empty tensor for the others); ``ds`` is d(loss)/d(scores) as (B, H, L, S), the gradient of an
  additive float mask before it is summed to the mask's shape. An op of its own, so torch.compile traces
  forward and backward without a graph break.

Forward saves only q, k, v, the output and the logsumexp; the backward recomputes the probabilities
block by block (FlashAttention-2). Both the Triton kernels and the PyTorch reference below run the same
blockwise algorithm with O(L) memory beyond inputs and outputs (the reference processes all queries
against one block of keys at a time). float64 always runs the reference.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers.backend import use_triton
from fusedlayers.ops._eager import call, custom_op, register_autograd

try:
    from fusedlayers.kernels import scaled_dot_product_attention as kernels
except ImportError:  # no Triton (macOS, Windows): the reference runs everywhere
    kernels = None

# Keys per step of the reference (its working set is (B, H, L, REFERENCE_BLOCK_N)).
REFERENCE_BLOCK_N = 128
PHILOX_ROUNDS = 7
_M32 = 0xFFFFFFFF


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run_kernel(q: Tensor) -> bool:
    return q.dtype != torch.float64 and use_triton(q) and kernels is not None


# ----------------------------------------------------------------------------- dropout (Philox, in PyTorch)


def _mul32(a: Tensor, b: int) -> tuple[Tensor, Tensor]:
    """(high, low) 32-bit words of a * b for int64 tensors a in [0, 2**32) and a constant b < 2**32,
    without overflowing int64 (b split in 16-bit halves)."""
    b_hi, b_lo = b >> 16, b & 0xFFFF
    lo_part = a * b_lo  # < 2**48
    t = a * b_hi + (lo_part >> 16)  # < 2**49
    return t >> 16, ((t & 0xFFFF) << 16) | (lo_part & 0xFFFF)


def philox_keep(seed0: int, seed1: int, rows: Tensor, cols: Tensor, bh: Tensor, threshold: int) -> Tensor:
    """Dropout keep mask, bit-identical to the Triton kernels' ``_dropout_keep``: Philox-4x32-7 of the
    counter (col, row, bh, 0) under the key (seed0, seed1); kept where the first output word's top 31
    bits are >= threshold. ``rows``, ``cols``, ``bh``: int64 tensors that broadcast together."""
    shape = torch.broadcast_shapes(rows.shape, cols.shape, bh.shape)
    c0 = cols.expand(shape) & _M32
    c1 = rows.expand(shape) & _M32
    c2 = bh.expand(shape) & _M32
    c3 = torch.zeros(shape, dtype=torch.int64, device=cols.device)
    k0, k1 = seed0 & _M32, seed1 & _M32
    for _ in range(PHILOX_ROUNDS):
        hi_b, lo_b = _mul32(c2, 0xCD9E8D57)
        hi_a, lo_a = _mul32(c0, 0xD2511F53)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0 = (k0 + 0x9E3779B9) & _M32
        k1 = (k1 + 0xBB67AE85) & _M32
    return (c0 >> 1) >= threshold


def dropout_params(seed: Tensor | None, dropout_p: float) -> tuple[int, int, int, float]:
    """(seed0, seed1, threshold on 31 random bits, 1 / (1 - p)); p == 1 drops everything (scale 0)."""
    if seed is None or dropout_p <= 0.0:
        return 0, 0, 0, 1.0
    seed0, seed1 = (int(x) for x in seed.tolist())
    if dropout_p >= 1.0:
        return seed0, seed1, 2**31 - 1, 0.0
    return seed0, seed1, min(int(dropout_p * 2**31), 2**31 - 1), 1.0 / (1.0 - dropout_p)


# ----------------------------------------------------------------------------- reference (PyTorch)


class _Blocks:
    """Shared set-up of the reference: queries grouped per key/value head, (B, H_kv, G*L, D), so that one
    block of keys serves all the query heads of its group without copying K/V."""

    def __init__(self, q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, seed: Tensor | None,
                 dropout_p: float, is_causal: bool, scale: float):
        self.acc = _accumulator(q.dtype)
        B, H, L, D = q.shape
        H_kv, S = k.shape[1], k.shape[2]
        G = H // H_kv
        self.B, self.H, self.L, self.S, self.G, self.H_kv = B, H, L, S, G, H_kv
        self.k, self.v, self.scale, self.is_causal = k, v, scale, is_causal
        self.q = q.reshape(B, H_kv, G * L, D).to(self.acc)
        self.rows = torch.arange(G * L, device=q.device) % L  # query index of each grouped row
        # (B, H_kv, G, L, S) view of the expanded mask: a block of it is sliced per step (no full copy)
        self.mask = mask.expand(B, H, L, S).view(B, H_kv, G, L, S) if mask is not None else None
        self.seed0, self.seed1, self.threshold, self.inv_keep = dropout_params(seed, dropout_p)
        self.dropout = seed is not None and dropout_p > 0.0
        if self.dropout:
            b = torch.arange(B, device=q.device).view(B, 1, 1, 1)
            hk = torch.arange(H_kv, device=q.device).view(1, H_kv, 1, 1)
            g = (torch.arange(G * L, device=q.device) // L).view(1, 1, G * L, 1)
            self.bh = b * H + hk * G + g  # b * H + h of each grouped row
            self.rows_i64 = self.rows.view(1, 1, G * L, 1)

    def blocks(self, block_n: int):
        for n0 in range(0, self.S, block_n):
            yield n0, min(n0 + block_n, self.S)

    def scores(self, n0: int, n1: int) -> tuple[Tensor, Tensor, Tensor]:
        """(scaled masked scores (B, H_kv, G*L, n), key block, value block), in the accumulator dtype."""
        kb = self.k[:, :, n0:n1].to(self.acc)
        vb = self.v[:, :, n0:n1].to(self.acc)
        s = torch.matmul(self.q, kb.transpose(-1, -2)) * self.scale
        if self.mask is not None:
            mb = self.mask[..., n0:n1].reshape(self.B, self.H_kv, self.G * self.L, n1 - n0)
            if mb.dtype == torch.bool:
                s = s.masked_fill(~mb, float("-inf"))
            else:
                s = s + mb.to(self.acc)
        if self.is_causal:
            cols = torch.arange(n0, n1, device=s.device)
            s = s.masked_fill(cols[None, :] > self.rows[:, None], float("-inf"))
        return s, kb, vb

    def keep(self, n0: int, n1: int) -> Tensor:
        cols = torch.arange(n0, n1, device=self.q.device).view(1, 1, 1, n1 - n0)
        return philox_keep(self.seed0, self.seed1, self.rows_i64, cols, self.bh, self.threshold)


def attention_forward_reference(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, seed: Tensor | None, dropout_p: float,
    is_causal: bool, scale: float, block_n: int = REFERENCE_BLOCK_N,
) -> tuple[Tensor, Tensor]:
    """FlashAttention-2 forward in PyTorch: online softmax over blocks of ``block_n`` keys."""
    st = _Blocks(q, k, v, mask, seed, dropout_p, is_causal, scale)
    B, H, L, DV = q.shape[0], q.shape[1], q.shape[2], v.shape[3]
    rows = (B, st.H_kv, st.G * L)
    m = torch.full(rows, float("-inf"), dtype=st.acc, device=q.device)
    l_sum = torch.zeros(rows, dtype=st.acc, device=q.device)
    acc = torch.zeros((*rows, DV), dtype=st.acc, device=q.device)
    for n0, n1 in st.blocks(block_n):
        s, _, vb = st.scores(n0, n1)
        m_new = torch.maximum(m, s.amax(-1))
        m_sub = m_new.masked_fill(m_new == float("-inf"), 0.0)  # rows masked so far: exp(-inf) = 0, no NaN
        p = torch.exp(s - m_sub[..., None])
        alpha = torch.exp(m - m_sub)
        l_sum = l_sum * alpha + p.sum(-1)
        if st.dropout:
            p = p * st.keep(n0, n1)
        acc = acc * alpha[..., None] + torch.matmul(p, vb)
        m = m_new
    has_keys = l_sum > 0
    inv = torch.where(has_keys, 1.0 / l_sum, 0.0) * st.inv_keep
    out = (acc * inv[..., None]).reshape(B, H, L, DV).to(q.dtype)
    lse = torch.where(has_keys, m + torch.log(l_sum), float("inf")).reshape(B, H, L)
    return out, lse


def attention_backward_reference(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, mask: Tensor | None,
    seed: Tensor | None, dropout_p: float, is_causal: bool, scale: float,
    need_dq: bool, need_dk: bool, need_dv: bool, need_dmask: bool, block_n: int = REFERENCE_BLOCK_N,
) -> tuple[Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """FlashAttention-2 backward in PyTorch: probabilities recomputed per key block from the logsumexp."""
    st = _Blocks(q, k, v, mask, seed, dropout_p, is_causal, scale)
    B, H, L, D = q.shape
    H_kv, S, G = st.H_kv, st.S, st.G
    acc = st.acc
    do = grad_out.reshape(B, H_kv, G * L, -1).to(acc)
    delta = (do * out.reshape(B, H_kv, G * L, -1).to(acc)).sum(-1, keepdim=True)
    lse_g = lse.reshape(B, H_kv, G * L, 1).to(acc)
    dq = torch.zeros((B, H_kv, G * L, D), dtype=acc, device=q.device) if need_dq else None
    dk = torch.empty(k.shape, dtype=k.dtype, device=k.device) if need_dk else None
    dv = torch.empty(v.shape, dtype=v.dtype, device=v.device) if need_dv else None
    ds_all = torch.zeros((B, H, L, S), dtype=acc, device=q.device) if need_dmask else None
    need_ds = need_dq or need_dk or need_dmask
    for n0, n1 in st.blocks(block_n):
        s, kb, vb = st.scores(n0, n1)
        p = torch.exp(s - lse_g)  # 0 where masked (s = -inf) and on fully-masked rows (lse = +inf)
        keep = st.keep(n0, n1) if st.dropout else None
        if need_dv:
            p_drop = p * keep * st.inv_keep if keep is not None else p
            dv[:, :, n0:n1] = torch.matmul(p_drop.transpose(-1, -2), do).to(v.dtype)  # sums the group's rows
        if need_ds:
            dp = torch.matmul(do, vb.transpose(-1, -2))
            if keep is not None:
                dp = dp * keep * st.inv_keep
            ds = p * (dp - delta)
            if need_dq:
                dq += torch.matmul(ds, kb)
            if need_dk:
                dk[:, :, n0:n1] = (torch.matmul(ds.transpose(-1, -2), st.q) * scale).to(k.dtype)
            if need_dmask:
                ds_all[..., n0:n1] = ds.view(B, H, L, n1 - n0)
    if need_dq:
        dq = (dq * scale).reshape(B, H, L, D).to(q.dtype)
    return dq, dk, dv, ds_all


# ----------------------------------------------------------------------------- forward op


def _empty_outputs(q: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
    B, H, L = q.shape[:3]
    return (q.new_empty((B, H, L, v.shape[3])),
            q.new_empty((B, H, L), dtype=_accumulator(q.dtype)))


@custom_op("fusedlayers::scaled_dot_product_attention")
def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None, seed: Tensor | None,
    dropout_p: float, is_causal: bool, scale: float,
) -> tuple[Tensor, Tensor]:
    B, H, L = query.shape[:3]
    S = key.shape[2]
    if S == 0:  # no keys: every row is fully masked
        out, lse = _empty_outputs(query, value)
        return out.zero_(), lse.fill_(float("inf"))
    mask = attn_mask.expand(B, H, L, S) if attn_mask is not None else None
    if _run_kernel(query):
        drop = dropout_params(seed, dropout_p) if seed is not None and dropout_p > 0.0 else None
        return kernels.attention_forward(query, key, value, mask, drop, is_causal, scale)
    return attention_forward_reference(query, key, value, mask, seed, dropout_p, is_causal, scale)


@scaled_dot_product_attention.register_fake
def _(query, key, value, attn_mask, seed, dropout_p, is_causal, scale):
    return _empty_outputs(query, value)


def _forward_setup_context(ctx, inputs, output):
    query, key, value, attn_mask, seed, dropout_p, is_causal, scale = inputs
    out, lse = output
    ctx.mark_non_differentiable(lse)
    ctx.dropout_p, ctx.is_causal, ctx.scale = dropout_p, is_causal, scale
    ctx.mask_meta = (attn_mask.shape, attn_mask.dtype) if attn_mask is not None else None
    ctx.save_for_backward(query, key, value, out, lse, attn_mask, seed)


def _forward_autograd(ctx, grad_out, _grad_lse):
    query, key, value, out, lse, attn_mask, seed = ctx.saved_tensors
    need_dq, need_dk, need_dv, need_dmask = ctx.needs_input_grad[:4]
    if not (need_dq or need_dk or need_dv or need_dmask):
        return None, None, None, None, None, None, None, None
    dq, dk, dv, ds = call(
        scaled_dot_product_attention_backward,
        grad_out, query, key, value, out, lse, attn_mask, seed, ctx.dropout_p, ctx.is_causal, ctx.scale,
        need_dq, need_dk, need_dv, need_dmask,
    )
    dmask = None
    if need_dmask:  # an additive float mask that requires grad: dS summed over its broadcast dims
        mask_shape, mask_dtype = ctx.mask_meta
        dmask = ds.sum_to_size(mask_shape).to(mask_dtype)
    return (dq if need_dq else None, dk if need_dk else None, dv if need_dv else None, dmask,
            None, None, None, None)


register_autograd(scaled_dot_product_attention, _forward_autograd, _forward_setup_context)


# ----------------------------------------------------------------------------- backward op


def _backward_outputs(query, key, value, need_dq, need_dk, need_dv, need_dmask):
    B, H, L = query.shape[:3]
    S = key.shape[2]
    def none():  # a fresh empty tensor each (outputs may not alias one another)
        return query.new_empty((0,))

    return (query.new_empty(query.shape) if need_dq else none(),
            key.new_empty(key.shape) if need_dk else none(),
            value.new_empty(value.shape) if need_dv else none(),
            query.new_empty((B, H, L, S), dtype=_accumulator(query.dtype)) if need_dmask else none())


@custom_op("fusedlayers::scaled_dot_product_attention_backward")
def scaled_dot_product_attention_backward(
    grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, lse: Tensor,
    attn_mask: Tensor | None, seed: Tensor | None, dropout_p: float, is_causal: bool, scale: float,
    need_dq: bool, need_dk: bool, need_dv: bool, need_dmask: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, H, L = query.shape[:3]
    S = key.shape[2]
    mask = attn_mask.expand(B, H, L, S) if attn_mask is not None else None
    if _run_kernel(query):
        drop = dropout_params(seed, dropout_p) if seed is not None and dropout_p > 0.0 else None
        grads = kernels.attention_backward(
            grad_out, query, key, value, out, lse, mask, drop, is_causal, scale,
            need_dq, need_dk, need_dv, need_dmask,
        )
    else:
        grads = attention_backward_reference(
            grad_out, query, key, value, out, lse, mask, seed, dropout_p, is_causal, scale,
            need_dq, need_dk, need_dv, need_dmask,
        )
    return tuple(g if g is not None else query.new_empty((0,)) for g in grads)


@scaled_dot_product_attention_backward.register_fake
def _(grad_out, query, key, value, out, lse, attn_mask, seed, dropout_p, is_causal, scale,
      need_dq, need_dk, need_dv, need_dmask):
    return _backward_outputs(query, key, value, need_dq, need_dk, need_dv, need_dmask)


# ----------------------------------------------------------------------------- autocast

# As F.scaled_dot_product_attention (in autocast's lower-precision list on CPU and CUDA): inside an
# autocast region, floating inputs (float mask included, fp64 excepted) are cast to the region's dtype.
_autocast_lib = torch.library.Library("fusedlayers", "FRAGMENT")


def _register_autocast(device_type: str) -> None:
    key_name = "Autocast" + torch._C._dispatch_key_for_device(device_type)
    key = getattr(torch._C.DispatchKey, key_name)

    def kernel(_keyset, query, key_, value, attn_mask, seed, dropout_p, is_causal, scale):
        dtype = torch.get_autocast_dtype(device_type)

        def cast(t):
            eligible = (t is not None and t.is_floating_point() and t.device.type == device_type
                        and t.dtype != torch.float64)
            return t.to(dtype) if eligible else t

        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return scaled_dot_product_attention(
                cast(query), cast(key_), cast(value), cast(attn_mask), seed, dropout_p, is_causal, scale
            )

    _autocast_lib.impl("scaled_dot_product_attention", kernel, key_name, with_keyset=True)


for _device_type in ("cpu", "cuda"):
    _register_autocast(_device_type)
