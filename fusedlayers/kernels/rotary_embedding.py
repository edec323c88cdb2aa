"""Triton kernels of the rotary position embedding (rotate-half convention, as transformers' apply_rotary_pos_emb).

For x of shape (B, H, T, D) with halves x1 = x[..., :D/2], x2 = x[..., D/2:] and cos/sin of shape (B, T, D)
(broadcast over the heads):

    out1 = x1 * cos1 - x2 * sin1        out2 = x2 * cos2 + x1 * sin2

The backward is the transposed (inverse) rotation, the same kernel with sin' = -cat(sin2, sin1):

    dx1 = g1 * cos1 + g2 * sin2         dx2 = g2 * cos2 - g1 * sin1

One launch handles q and k: program (row, block) with row = b * T + t over the (B * T) positions rotates head block
``block`` of q (BLOCK_HQ heads) and of k (BLOCK_HK heads), where it has one; the head blocks are sized for q and k
apart (GQA: k has fewer heads), so usually one program per position does all of both, loading that position's
cos/sin once (fp32). Every tensor is addressed through its strides
(non-contiguous q/k from a transposed (B, T, H, D) projection, cos/sin broadcast with stride 0). fp32 math.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from fusedlayers.kernels import launch, next_power_of_2

MAX_BLOCK_ELEMENTS = 4096  # heads x pairs per program


@triton.jit
def _rotate_heads(x_ptr, o_ptr, sxb, sxh, sxt, sxd, sob, soh, sot, sod, b, t, h0, n_heads, c1, c2, s1, s2,
                  HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    h = (h0 + tl.arange(0, BLOCK_H)).to(tl.int64)[:, None]
    d = tl.arange(0, BLOCK_D).to(tl.int64)[None, :]
    mask = (h < n_heads) & (d < HALF)
    xp = x_ptr + b * sxb + t * sxt + h * sxh + d * sxd
    x1 = tl.load(xp, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(xp + HALF * sxd, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1 - x2 * s1
    o2 = x2 * c2 + x1 * s2
    op = o_ptr + b * sob + t * sot + h * soh + d * sod
    tl.store(op, o1.to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(op + HALF * sod, o2.to(o_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(q_ptr, k_ptr, oq_ptr, ok_ptr, cos_ptr, sin_ptr, T, HQ, HK,
                   sqb, sqh, sqt, sqd, skb, skh, skt, skd,
                   soqb, soqh, soqt, soqd, sokb, sokh, sokt, sokd,
                   scb, sct, scd, ssb, sst, ssd,
                   HALF: tl.constexpr, BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, BLOCK_D: tl.constexpr,
                   BACKWARD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    blk = tl.program_id(1)
    b = row // T
    t = row % T
    d = tl.arange(0, BLOCK_D).to(tl.int64)
    dm = d < HALF
    cp = cos_ptr + b * scb + t * sct + d * scd
    sp = sin_ptr + b * ssb + t * sst + d * ssd
    c1 = tl.load(cp, mask=dm, other=0.0).to(tl.float32)[None, :]
    c2 = tl.load(cp + HALF * scd, mask=dm, other=0.0).to(tl.float32)[None, :]
    s1 = tl.load(sp, mask=dm, other=0.0).to(tl.float32)[None, :]
    s2 = tl.load(sp + HALF * ssd, mask=dm, other=0.0).to(tl.float32)[None, :]
    if BACKWARD:  # rotation by -theta: sin' = -cat(sin2, sin1)
        s1, s2 = -s2, -s1
    if blk * BLOCK_HQ < HQ:
        _rotate_heads(q_ptr, oq_ptr, sqb, sqh, sqt, sqd, soqb, soqh, soqt, soqd, b, t, blk * BLOCK_HQ, HQ,
                      c1, c2, s1, s2, HALF, BLOCK_HQ, BLOCK_D)
    if blk * BLOCK_HK < HK:
        _rotate_heads(k_ptr, ok_ptr, skb, skh, skt, skd, sokb, sokh, sokt, sokd, b, t, blk * BLOCK_HK, HK,
                      c1, c2, s1, s2, HALF, BLOCK_HK, BLOCK_D)


def _block_h(half: int, heads: int) -> int:
    return max(1, min(next_power_of_2(heads), MAX_BLOCK_ELEMENTS // next_power_of_2(half)))


@functools.lru_cache(maxsize=256)
def _plan(d: int, hq: int, hk: int) -> tuple[int, int, int, int]:
    """(BLOCK_HQ, BLOCK_HK, BLOCK_D, head blocks per position) for head dim d: worked out once per shape, since every
    layer of a model calls with the same ones (these rows are host-bound at short sequences)."""
    block_hq, block_hk = _block_h(d // 2, hq), _block_h(d // 2, hk)
    return block_hq, block_hk, next_power_of_2(d // 2), max(-(-hq // block_hq), -(-hk // block_hk))


def _broadcast_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """(batch, position, dim) strides of cos/sin of shape (T, D) or (B or 1, T, D), stride 0 where broadcast (what
    ``t.expand(B, T, D).stride()`` gives, without building the view)."""
    if t.dim() == 2:
        return 0, t.stride(0), t.stride(1)
    return (0 if t.shape[0] == 1 else t.stride(0)), t.stride(1), t.stride(2)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, q_dtype: torch.dtype,
           k_dtype: torch.dtype, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(q', k'): q and k (B, H, T, D), any strides, rotated by cos/sin ((T, D) or (B or 1, T, D)), in new tensors of
    ``q_dtype``/``k_dtype`` laid out as q/k (``torch.empty_like``); by -theta when ``backward``."""
    B, HQ, T, D = q.shape
    HK = k.shape[1]
    oq = torch.empty_like(q, dtype=q_dtype)
    ok = torch.empty_like(k, dtype=k_dtype)
    block_hq, block_hk, block_d, n_blocks = _plan(D, HQ, HK)
    launch(_rotary_kernel, (B * T, n_blocks), q, k, oq, ok, cos, sin, T, HQ, HK, *q.stride(), *k.stride(),
           *oq.stride(), *ok.stride(), *_broadcast_strides(cos), *_broadcast_strides(sin), HALF=D // 2,
           BLOCK_HQ=block_hq, BLOCK_HK=block_hk, BLOCK_D=block_d, BACKWARD=backward)
    return oq, ok
