"""Triton kernels for scaled dot-product attention (FlashAttention-2), forward and backward.

Layout: query (B, H, L, D), key (B, H_kv, S, D), value (B, H_kv, S, Dv), any strides; H a multiple of
H_kv (grouped-query attention: query head h reads key/value head h // (H // H_kv), nothing copied).
Scores are s = scale * q.k (+ additive mask) in fp32. For fp16/bf16 the kernels keep them in base 2
(the scale carries log2(e), so each probability is one exp2); for fp32 inputs in natural units (the
exponent's argument is formed before the change of base: as precise as torch's fp32 softmax).

- forward: one program per (query block, b, h). Online softmax over key blocks: a running max m and sum l
  per row, the output accumulated in fp32 registers. The key loop runs in two stages: blocks that need no
  masking (no bounds check, no causal test: the common case runs lean), then the blocks on the causal
  diagonal and/or the ragged tail of S. A window or per-row key intervals (varlen) visit only the key blocks they
  reach, in three stages: masked blocks at the left edge, the blocks every row of the query block sees whole
  (unmasked), masked blocks at the right edge; the dK/dV kernel does the same over query blocks. Writes the
  output (through its strides: any layout) and the logsumexp (natural log) per row, as a float64 m + log(l) for
  fp32 inputs (``_split_lse``).
- backward: ``delta = rowsum(dO * O)`` (a small kernel; on Hopper the Gluon dQ pass forms it and runs first), or
  with ``exact_delta`` sum_j P dP (the dQ kernel's loop in DELTA_ONLY mode), then two kernels that recompute the
  probabilities tile by tile from the saved logsumexp:
  * dK/dV: one program per (key block, b, h_kv); it loops over the query heads of its group and all query
    blocks, accumulating dK and dV in registers: GQA needs no expanded K/V and no atomics.
  * dQ: one program per (query block, b, h); it loops over the key blocks.
  Each gradient is written once by one program, in a fixed order: no atomics, bitwise reproducible. Unless
  determinism is asked for (``backend.deterministic_attention``), the dK/dV kernel instead adds dQ itself in fp32
  where that measured faster (``_atomic_dq_pays``): five tile products per block pair instead of seven.
- masks: ``attn_mask`` bool (True = keep) or additive float, read tile by tile through its strides (a
  broadcast dim has stride 0, so a (L, S) mask is never expanded in memory); causal is top-left
  (key j kept for query i when j <= i, as SDPA). A row that masks every key gets output 0 and
  logsumexp +inf, which makes its probabilities 0 in the backward: zero gradients, never NaN.
- dropout: the keep mask is a counter-based hash (Philox-4x32, 7 rounds) of (key j, query i, b*H + h)
  under a 62-bit key (two 31-bit seeds), so the backward regenerates exactly the forward's mask and
  nothing is stored. ``fusedlayers.ops.scaled_dot_product_attention.philox_keep`` is the same function
  in PyTorch (bit-identical).
- fp16/bf16 inputs: tensor-core dots with fp32 accumulation, probabilities rounded to the input dtype for
  the P.V and dS.K products (as FlashAttention). fp32 inputs: IEEE fp32 dots (no TF32).
- head dims: any D, Dv <= 256, padded to a power of two (BLOCK_D >= 16) inside the kernels by masked loads
  and stores; q, k, v, the output and the gradients are addressed through their strides (stride 0 for
  broadcast batch dims).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from fusedlayers import backend
from fusedlayers.kernels import INTERPRETED, cdiv, launch, next_power_of_2
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

LOG2E = 1.4426950408889634
PHILOX_ROUNDS = tl.constexpr(7)  # a constexpr global: the @jit functions read it


class Config(NamedTuple):
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int


# ----------------------------------------------------------------------------- helpers


@triton.jit
def _mm(a, b, IEEE: tl.constexpr):
    if IEEE:
        c = tl.dot(a, b, input_precision="ieee")
    else:
        c = tl.dot(a, b)
    return c


@triton.jit
def _mma(a, b, acc, IEEE: tl.constexpr):
    if IEEE:
        c = tl.dot(a, b, acc, input_precision="ieee")
    else:
        c = tl.dot(a, b, acc)
    return c


@triton.jit
def _exp(x, NATURAL: tl.constexpr):
    """exp of x in the kernels' exponent units: natural (fp32 inputs, precise) or base 2 (16-bit inputs,
    where the scale already holds log2(e) and exp2 saves a multiply per score)."""
    if NATURAL:
        y = tl.math.exp2(x * 1.4426950408889634)
    else:
        y = tl.math.exp2(x)
    return y


@triton.jit
def _load2d(ptrs, rows, n_rows, cols, n_cols, CHECK_ROWS: tl.constexpr, CHECK_COLS: tl.constexpr):
    """Load a (rows x cols) tile, bounds-checking only the dims that need it (0 outside)."""
    if CHECK_ROWS:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=(rows[:, None] < n_rows) & (cols[None, :] < n_cols), other=0.0)
        else:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
    else:
        if CHECK_COLS:
            x = tl.load(ptrs, mask=cols[None, :] < n_cols, other=0.0)
        else:
            x = tl.load(ptrs)
    return x


@triton.jit
def _split_lse(lse):
    """(hi, lo) fp32 with hi + lo = lse (float64): fp32 inputs keep the logsumexp m + log(l) unrounded, so
    that exp((s - hi) - lo) is as precise as a softmax that subtracts the row max (an fp32 lse would be off
    by u |lse|, the relative error of every probability of the row). lo = 0 on rows with no key (+inf)."""
    hi = lse.to(tl.float32)
    finite = tl.where(hi == float("inf"), 0.0, lse)  # (inf - inf would be NaN)
    lo = (finite - finite.to(tl.float32).to(tl.float64)).to(tl.float32)
    return hi, lo


@triton.jit
def _dropout_keep(seed0, seed1, rows, cols, bh, threshold):
    """True where element (query rows, key cols) of head bh is kept: Philox-4x32-7 of the counter
    (col, row, bh, 0) under key (seed0, seed1); keep when the first word's top 31 bits >= threshold."""
    c0 = (cols + rows * 0).to(tl.uint32)
    c1 = (rows + cols * 0).to(tl.uint32)
    c2 = c0 * 0 + bh.to(tl.uint32)
    c3 = c0 * 0
    k0 = seed0.to(tl.uint32)
    k1 = seed1.to(tl.uint32)
    for _ in tl.static_range(PHILOX_ROUNDS):
        a0 = c0
        a2 = c2
        c0 = tl.math.umulhi(a2, 0xCD9E8D57) ^ c1 ^ k0
        c2 = tl.math.umulhi(a0, 0xD2511F53) ^ c3 ^ k1
        c1 = a2 * 0xCD9E8D57
        c3 = a0 * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return (c0 >> 1).to(tl.int32) >= threshold


@triton.jit
def _tanh(x, APPROX: tl.constexpr):
    """tanh in fp32. APPROX (16-bit inputs on the GPU): the hardware's tanh.approx.f32, one special-function
    instruction (relative error about 2**-11, below the 16-bit inputs' own rounding of the score), where the exact
    form costs an exp and a division per score. Otherwise from exp (the interpreter has neither libdevice's tanh nor
    inline assembly): an odd Taylor polynomial below |x| = 1/8 (truncation < 2e-9 relative), (1 - e) / (1 + e) with
    e = exp(-2|x|) above (a few ulps)."""
    if APPROX and not INTERPRETED:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True,
                                         pack=1)
    ax = tl.abs(x)
    e = tl.exp(-2.0 * ax)
    x2 = x * x
    small = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    t = tl.where(ax < 0.125, small, (1.0 - e) / (1.0 + e))
    return tl.where(x < 0.0, -t, t)


@triton.jit
def _window_keep(rows, cols, win_left, win_right):
    """Key col kept for query row in a window (i - left <= j <= i + right; -1: unbounded); rows and cols broadcast."""
    return (((win_left < 0) | (cols >= rows - win_left)) & ((win_right < 0) | (cols <= rows + win_right)))


@triton.jit
def _masked_scores(
    qk, qk_scale, mask_base, stride_mm, stride_mn, rows, cols, L, S, win_left, win_right, cap_scale, cap_mult,
    row_lo, row_hi,
    CHECK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    NATURAL: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, INTERVALS: tl.constexpr,
):
    """((rows x cols) scores qk * qk_scale with the masks applied (-inf where masked), in exponent units; the soft-cap's
    tanh (SOFTCAP: the scores are cap_mult * tanh(qk * cap_scale), before the mask is added)).
    The mask's addresses are formed here from the (b, h) base (not carried across the loop as a tile of
    64-bit pointers, which costs registers)."""
    if SOFTCAP:
        t = _tanh(qk * cap_scale, not NATURAL)
        s = t * cap_mult
    else:
        t = qk
        s = qk * qk_scale
    if HAS_MASK:
        mask_ptrs = mask_base + rows[:, None] * stride_mm + cols[None, :] * stride_mn
        if CHECK_KEYS:
            mv = tl.load(mask_ptrs, mask=(rows[:, None] < L) & (cols[None, :] < S), other=0)
        else:
            mv = tl.load(mask_ptrs, mask=rows[:, None] < L, other=0)
        if MASK_BOOL:
            s = tl.where(mv != 0, s, float("-inf"))
        elif NATURAL:
            s = s + mv.to(tl.float32)
        else:
            s = s + mv.to(tl.float32) * 1.4426950408889634
    if CHECK_KEYS:
        s = tl.where(cols[None, :] < S, s, float("-inf"))
    if CAUSAL:
        s = tl.where(cols[None, :] <= rows[:, None], s, float("-inf"))
    if WINDOW:
        s = tl.where(_window_keep(rows[:, None], cols[None, :], win_left, win_right), s, float("-inf"))
    if INTERVALS:  # each query row's own key interval [row_lo, row_hi] (packed variable-length sequences)
        s = tl.where((cols[None, :] >= row_lo[:, None]) & (cols[None, :] <= row_hi[:, None]), s, float("-inf"))
    return s, t


# ----------------------------------------------------------------------------- forward


@triton.jit
def _query_block(H, GROUP, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr):
    """This program's (batch * head, batch, head, K/V head, first query row). Programs along axis 0 take query
    blocks, causal ones longest rows first (better balance across the last wave); axis 1 is batch * head."""
    pid_m = tl.program_id(0)
    if IS_CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    bh = tl.program_id(1)
    h = bh % H
    return bh, bh // H, h, h // GROUP, pid_m * BLOCK_M


@triton.jit
def _key_range(S, m0, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(full_hi, hi) for the query block starting at row m0: key blocks [0, full_hi) need no bounds check and
    (causal) lie wholly left of the diagonal; [full_hi, hi) are the diagonal blocks and/or the ragged tail of S."""
    s_even = (S // BLOCK_N) * BLOCK_N
    if IS_CAUSAL:
        full_hi = tl.minimum((m0 // BLOCK_N) * BLOCK_N, s_even)
        hi = tl.minimum(S, m0 + BLOCK_M)
    else:
        full_hi = s_even
        hi = S
    return full_hi, hi


@triton.jit
def _window_key_range(L, S, m0, win_left, win_right, IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """[lo, hi): the key blocks the window of the query block's rows reaches (rows past L excluded; the other blocks
    are skipped, not masked)."""
    lo = m0 * 0
    if win_left >= 0:
        lo = (tl.maximum(m0 - win_left, 0) // BLOCK_N) * BLOCK_N
    hi = S + m0 * 0
    if win_right >= 0:
        hi = tl.minimum(hi, tl.minimum(m0 + BLOCK_M, L) + win_right)
    if IS_CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M)
    return lo, hi


@triton.jit
def _interval_key_range(RowLo, RowHi, offs_m, L, S, BLOCK_N: tl.constexpr):
    """(row_lo, row_hi, lo, hi): the query rows' key intervals and the key blocks [lo, hi) that cover them all."""
    row_lo = tl.load(RowLo + offs_m, mask=offs_m < L, other=S)
    row_hi = tl.load(RowHi + offs_m, mask=offs_m < L, other=-1)
    lo = (tl.minimum(tl.min(row_lo, 0), S) // BLOCK_N) * BLOCK_N
    hi = tl.minimum(tl.max(row_hi, 0) + 1, S)
    return row_lo, row_hi, lo, hi


@triton.jit
def _full_blocks(first, last, lo, hi, limit, BLOCK: tl.constexpr):
    """[full_lo, full_hi): the blocks of [lo, hi) wholly inside [first, last] (what every row of the other side
    attends), and below ``limit`` (no bounds check); empty (full_lo = full_hi) if none."""
    full_lo = tl.minimum(tl.maximum(tl.cdiv(tl.maximum(first, 0), BLOCK) * BLOCK, lo), hi)
    full_hi = tl.minimum((tl.maximum(last + 1, 0) // BLOCK) * BLOCK, limit)
    return full_lo, tl.minimum(tl.maximum(full_hi, full_lo), hi)


@triton.jit
def _query_block_keys(RowLo, RowHi, offs_m, L, S, m0, win_left, win_right, IS_CAUSAL: tl.constexpr,
                      WINDOW: tl.constexpr, INTERVALS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """(row_lo, row_hi, lo, full_lo, full_hi, hi) of the query block at m0: key blocks [full_lo, full_hi) need no
    mask, [lo, full_lo) and [full_hi, hi) do; with intervals (row_lo, row_hi: each row's keys) or a window, only
    the blocks they reach are visited, and those every row sees whole run unmasked."""
    s_even = (S // BLOCK_N) * BLOCK_N
    if INTERVALS:
        row_lo, row_hi, lo, hi = _interval_key_range(RowLo, RowHi, offs_m, L, S, BLOCK_N)
        full_lo, full_hi = _full_blocks(tl.max(row_lo, 0), tl.min(row_hi, 0), lo, hi, s_even, BLOCK_N)
    elif WINDOW:
        lo, hi = _window_key_range(L, S, m0, win_left, win_right, IS_CAUSAL, BLOCK_M, BLOCK_N)
        first = tl.where(win_left >= 0, m0 + BLOCK_M - 1 - win_left, 0)  # the last row's first key
        last = tl.where(win_right >= 0, m0 + win_right, S - 1)  # the first row's last key
        if IS_CAUSAL:
            last = tl.minimum(last, m0)
        full_lo, full_hi = _full_blocks(first, last, lo, hi, s_even, BLOCK_N)
        row_lo, row_hi = offs_m, offs_m
    else:
        full_hi, hi = _key_range(S, m0, IS_CAUSAL, BLOCK_M, BLOCK_N)
        lo = full_hi * 0
        full_lo = lo
        row_lo, row_hi = offs_m, offs_m
    return row_lo, row_hi, lo, full_lo, full_hi, hi


@triton.jit
def _fwd_inner(
    acc, l_i, m_i, q, k_base, v_base, mask_base, lo, hi,
    offs_m, offs_n, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
    L, S, D, DV, qk_scale, seed0, seed1, bh, drop_threshold, win_left, win_right, cap_scale, cap_mult,
    row_lo, row_hi,
    CHECK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    DROPOUT: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, IEEE: tl.constexpr,
    FAST_MAX: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, INTERVALS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    k_ptrs = k_base + (lo + offs_n)[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + (lo + offs_n)[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load2d(k_ptrs, cols, S, offs_d, D, CHECK_KEYS, not EVEN_D)
        qk = _mm(q, tl.trans(k), IEEE)
        if CHECK_KEYS or CAUSAL or HAS_MASK or WINDOW or SOFTCAP or INTERVALS:
            s, _ = _masked_scores(qk, qk_scale, mask_base, stride_mm, stride_mn, offs_m, cols, L, S, win_left,
                                  win_right, cap_scale, cap_mult, row_lo, row_hi, CHECK_KEYS, CAUSAL, HAS_MASK,
                                  MASK_BOOL, IEEE, WINDOW, SOFTCAP, INTERVALS)
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            # a row with every key masked so far keeps m = -inf: subtract 0 instead (exp2(-inf) = 0, no NaN)
            m_sub = tl.where(m_ij == float("-inf"), 0.0, m_ij)
            p = _exp(s - m_sub[:, None], IEEE)
        elif FAST_MAX:  # base 2 and scale >= 0: the row max of qk, then one FMA per score
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            m_sub = m_ij
            p = tl.math.exp2(qk * qk_scale - m_sub[:, None])
        else:
            s = qk * qk_scale
            m_ij = tl.maximum(m_i, tl.max(s, 1))
            m_sub = m_ij
            p = _exp(s - m_sub[:, None], IEEE)
        alpha = _exp(m_i - m_sub, IEEE)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        if DROPOUT:
            keep = _dropout_keep(seed0, seed1, offs_m[:, None], cols[None, :], bh, drop_threshold)
            p = tl.where(keep, p, 0.0)
        v = _load2d(v_ptrs, cols, S, offs_dv, DV, CHECK_KEYS, not EVEN_DV)
        acc = _mma(p.to(v.dtype), v, acc, IEEE)
        m_i = m_ij
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["seed0", "seed1", "drop_threshold"])
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, Mask, RowLo, RowHi,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_ob, stride_oh, stride_om, stride_od,
    H, GROUP, L, S, D, DV, qk_scale, seed0, seed1, drop_threshold, inv_keep, win_left, win_right, cap_scale, cap_mult,
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, DROPOUT: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, IEEE: tl.constexpr, FAST_MAX: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, INTERVALS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    bh, b, h, hk, m0 = _query_block(H, GROUP, IS_CAUSAL, BLOCK_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    mask_base = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh

    q = _load2d(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, offs_m, L, offs_d, D,
                True, not EVEN_D)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)

    row_lo, row_hi, lo, full_lo, full_hi, hi = _query_block_keys(RowLo, RowHi, offs_m, L, S, m0, win_left,
                                                                 win_right, IS_CAUSAL, WINDOW, INTERVALS, BLOCK_M,
                                                                 BLOCK_N)
    if WINDOW or INTERVALS:  # the masked blocks left of those every row sees whole
        acc, l_i, m_i = _fwd_inner(
            acc, l_i, m_i, q, k_base, v_base, mask_base, lo, full_lo,
            offs_m, offs_n, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            L, S, D, DV, qk_scale, seed0, seed1, bh, drop_threshold, win_left, win_right, cap_scale, cap_mult,
            row_lo, row_hi,
            True, IS_CAUSAL, HAS_MASK, MASK_BOOL, DROPOUT, EVEN_D, EVEN_DV, IEEE, FAST_MAX, WINDOW, SOFTCAP,
            INTERVALS, BLOCK_N,
        )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, mask_base, full_lo, full_hi,
        offs_m, offs_n, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
        L, S, D, DV, qk_scale, seed0, seed1, bh, drop_threshold, win_left, win_right, cap_scale, cap_mult,
        row_lo, row_hi,
        False, False, HAS_MASK, MASK_BOOL, DROPOUT, EVEN_D, EVEN_DV, IEEE, FAST_MAX, False, SOFTCAP, False, BLOCK_N,
    )
    acc, l_i, m_i = _fwd_inner(
        acc, l_i, m_i, q, k_base, v_base, mask_base, full_hi, hi,
        offs_m, offs_n, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
        L, S, D, DV, qk_scale, seed0, seed1, bh, drop_threshold, win_left, win_right, cap_scale, cap_mult,
        row_lo, row_hi,
        True, IS_CAUSAL, HAS_MASK, MASK_BOOL, DROPOUT, EVEN_D, EVEN_DV, IEEE, FAST_MAX, WINDOW, SOFTCAP, INTERVALS,
        BLOCK_N,
    )

    # rows with every key masked have l = 0 and acc = 0: output 0, logsumexp +inf
    has_keys = l_i > 0.0
    l_safe = tl.where(has_keys, l_i, 1.0)
    inv_l = tl.where(has_keys, 1.0 / l_safe, 0.0)
    if DROPOUT:
        inv_l = inv_l * inv_keep
    out = acc * inv_l[:, None]
    if IEEE:  # natural units
        # m + log(l) unrounded, in a float64 (see _split_lse)
        lse = tl.where(has_keys, m_i.to(tl.float64) + tl.log(l_safe).to(tl.float64), float("inf"))
    else:
        lse = tl.where(has_keys, (m_i + tl.math.log2(l_safe)) * 0.6931471805599453, float("inf"))
    o_ptrs = (Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om
              + offs_dv[None, :] * stride_od)
    tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=(offs_m[:, None] < L) & (offs_dv[None, :] < DV))
    tl.store(Lse + bh.to(tl.int64) * L + offs_m, lse.to(Lse.dtype.element_ty), mask=offs_m < L)


# ----------------------------------------------------------------------------- backward


@triton.jit
def _bwd_preprocess_kernel(
    Out, DO, Delta, Lse, Lse2, DQ32, stride_ob, stride_oh, stride_om, stride_od, stride_gb, stride_gh, stride_gm,
    stride_gd, H, L, DV, L_PAD, BLOCK_M: tl.constexpr, BLOCK_DV: tl.constexpr, LSE2: tl.constexpr,
):
    """delta[b * H + h, i] = sum_d dO[b, h, i, d] * O[b, h, i, d] (fp32), rows L_PAD apart (rows L..L_PAD: 0); LSE2:
    also Lse2 = the logsumexp Lse (rows L apart) in base 2, rows L..L_PAD +inf, and zeros in the fp32 rows DQ32
    (B * H, L_PAD, BLOCK_DV) (the one-pass backward's padded statistics, P = 0 in the padding, and the dQ it adds into;
    zeroed here rather than by a fill of their own: one launch less on the host's path)."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, BLOCK_DV)
    inside = (offs_m[:, None] < L) & (offs_d[None, :] < DV)
    o = tl.load(Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om
                + offs_d[None, :] * stride_od, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(DO + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh + offs_m[:, None] * stride_gm
                + offs_d[None, :] * stride_gd, mask=inside, other=0.0).to(tl.float32)
    row = bh.to(tl.int64) * L_PAD + offs_m
    tl.store(Delta + row, tl.sum(o * g, 1), mask=offs_m < L_PAD)
    if LSE2:
        lse = tl.load(Lse + bh.to(tl.int64) * L + offs_m, mask=offs_m < L, other=float("inf"))
        tl.store(Lse2 + row, lse * 1.4426950408889634, mask=offs_m < L_PAD)
        dq_rows = row[:, None] * BLOCK_DV + offs_d[None, :]
        tl.store(DQ32 + dq_rows, tl.zeros((BLOCK_M, BLOCK_DV), tl.float32), mask=offs_m[:, None] < L_PAD)


@triton.jit
def _bwd_dkdv_inner(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, ds_base, dq_base, lo, hi,
    offs_n, offs_d, offs_dv, stride_qm, stride_qd, stride_gm, stride_gd, stride_mm, stride_mn,
    L, S, D, DV, qk_scale, scale, seed0, seed1, bh, drop_threshold, inv_keep, win_left, win_right, cap_scale,
    cap_mult, RowLo, RowHi,
    CAUSAL: tl.constexpr, CHECK_ROWS: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    DROPOUT: tl.constexpr, COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr, STORE_DS: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, TMA_DQ: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr,
    INTERVALS: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Accumulate dK, dV of one key block over query blocks [lo, hi), in transposed (key x query) tiles.
    ATOMIC_DQ: also add this key block's share of dQ (dS^T K) into the fp32 rows at ``dq_base`` (row stride D), or
    with TMA_DQ through ``dq_base``, a tensor descriptor of the (B * H, L, BLOCK_D) fp32 dQ (a bulk reduction the
    TMA unit carries out while the loop goes on)."""
    offs_m0 = tl.arange(0, BLOCK_M)
    for start_m in range(lo, hi, BLOCK_M):
        start_m = tl.multiple_of(start_m, BLOCK_M)
        offs_m = start_m + offs_m0
        q = _load2d(q_base + offs_m[:, None] * stride_qm + offs_d[None, :] * stride_qd, offs_m, L, offs_d, D,
                    CHECK_ROWS, not EVEN_D)
        # query rows past L get logsumexp +inf: their probabilities are 0
        if CHECK_ROWS:
            lse = tl.load(lse_base + offs_m, mask=offs_m < L, other=float("inf"))
        else:
            lse = tl.load(lse_base + offs_m)
        if SOFTCAP:
            t_t = _tanh(_mm(k, tl.trans(q), IEEE) * cap_scale, not IEEE)
            s_t = t_t * cap_mult
        else:
            s_t = _mm(k, tl.trans(q), IEEE) * qk_scale
        if HAS_MASK:
            mv = tl.load(mask_base + offs_m[None, :] * stride_mm + offs_n[:, None] * stride_mn,
                         mask=(offs_m[None, :] < L) & (offs_n[:, None] < S), other=0)
            if MASK_BOOL:
                s_t = tl.where(mv != 0, s_t, float("-inf"))
            elif IEEE:
                s_t = s_t + mv.to(tl.float32)
            else:
                s_t = s_t + mv.to(tl.float32) * 1.4426950408889634
        if CAUSAL:
            s_t = tl.where(offs_m[None, :] >= offs_n[:, None], s_t, float("-inf"))
        if WINDOW:
            s_t = tl.where(_window_keep(offs_m[None, :], offs_n[:, None], win_left, win_right), s_t, float("-inf"))
        if INTERVALS:
            r_lo = tl.load(RowLo + offs_m, mask=offs_m < L, other=S)
            r_hi = tl.load(RowHi + offs_m, mask=offs_m < L, other=-1)
            s_t = tl.where((offs_n[:, None] >= r_lo[None, :]) & (offs_n[:, None] <= r_hi[None, :]), s_t, float("-inf"))
        if IEEE:
            lse_hi, lse_lo = _split_lse(lse)
            p_t = _exp((s_t - lse_hi[None, :]) - lse_lo[None, :], True)
        else:
            p_t = tl.math.exp2(s_t - lse[None, :] * 1.4426950408889634)
        do = _load2d(do_base + offs_m[:, None] * stride_gm + offs_dv[None, :] * stride_gd, offs_m, L, offs_dv, DV,
                     CHECK_ROWS, not EVEN_DV)
        if DROPOUT:
            keep_t = _dropout_keep(seed0, seed1, offs_m[None, :], offs_n[:, None], bh, drop_threshold)
        if COMPUTE_DV:
            if DROPOUT:
                dv = _mma(tl.where(keep_t, p_t, 0.0).to(do.dtype), do, dv, IEEE)
            else:
                dv = _mma(p_t.to(do.dtype), do, dv, IEEE)
        if COMPUTE_DK or STORE_DS or ATOMIC_DQ:
            if CHECK_ROWS:
                delta = tl.load(delta_base + offs_m, mask=offs_m < L, other=0.0)
            else:
                delta = tl.load(delta_base + offs_m)
            dp_t = _mm(v, tl.trans(do), IEEE)
            if DROPOUT:
                dp_t = tl.where(keep_t, dp_t * inv_keep, 0.0)
            ds_t = p_t * (dp_t - delta[None, :])  # d(loss)/d(capped, masked score): the float mask's gradient
            if STORE_DS:
                tl.store(ds_base + offs_m[None, :].to(tl.int64) * S + offs_n[:, None], ds_t,
                         mask=(offs_m[None, :] < L) & (offs_n[:, None] < S))
            if SOFTCAP:  # through the soft-cap to the raw score
                ds_t = ds_t * (1.0 - t_t * t_t)
            if COMPUTE_DK:
                dk = _mma(ds_t.to(q.dtype), q, dk, IEEE)
            if ATOMIC_DQ:
                dq = _mm(tl.trans(ds_t.to(k.dtype)), k, IEEE) * scale
                if TMA_DQ:
                    dq_base.atomic_add([bh, start_m, 0], tl.reshape(dq, [1, BLOCK_M, dq.shape[1]]))
                else:
                    tl.atomic_add(dq_base + offs_m[:, None] * D + offs_d[None, :], dq,
                                  mask=(offs_m[:, None] < L) & (offs_d[None, :] < D), sem="relaxed")
    return dk, dv


@triton.jit(do_not_specialize=["seed0", "seed1", "drop_threshold"])
def _attn_bwd_dkdv_kernel(
    Q, K, V, DO, Lse, Delta, DK, DV_, Mask, DS, DQ32, RowLo, RowHi, ColLo, ColHi,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dkb, stride_dkh, stride_dkn, stride_dkd,
    stride_dvb, stride_dvh, stride_dvn, stride_dvd,
    H, GROUP, L, S, D, DV, qk_scale, scale, seed0, seed1, drop_threshold, inv_keep, win_left, win_right, cap_scale,
    cap_mult,
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, DROPOUT: tl.constexpr,
    COMPUTE_DK: tl.constexpr, COMPUTE_DV: tl.constexpr, STORE_DS: tl.constexpr, ATOMIC_DQ: tl.constexpr,
    TMA_DQ: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, IEEE: tl.constexpr, WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    INTERVALS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    H_KV = H // GROUP
    b = bhk // H_KV
    hk = bhk % H_KV
    n0 = pid_n * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    k = _load2d(K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh + offs_n[:, None] * stride_kn
                + offs_d[None, :] * stride_kd, offs_n, S, offs_d, D, True, not EVEN_D)
    v = _load2d(V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh + offs_n[:, None] * stride_vn
                + offs_dv[None, :] * stride_vd, offs_n, S, offs_dv, DV, True, not EVEN_DV)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], tl.float32)

    # query blocks: [m_start, m_mid) straddle the causal diagonal, [m_mid, l_even) need no masking,
    # [max(m_mid, l_even), L) is the ragged tail of L. Non-causal: m_start = m_mid = 0.
    l_even = (L // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:
        m_start = (n0 // BLOCK_M) * BLOCK_M
        m_mid = tl.cdiv(n0 + BLOCK_N - 1, BLOCK_M) * BLOCK_M
    else:
        m_start = 0
        m_mid = 0
    # a window: only the query blocks that reach this key block, all masked
    m_lo = n0 * 0
    if win_right >= 0:
        m_lo = (tl.maximum(n0 - win_right, 0) // BLOCK_M) * BLOCK_M
    if IS_CAUSAL:
        m_lo = tl.maximum(m_lo, (n0 // BLOCK_M) * BLOCK_M)
    m_hi = L + n0 * 0
    if win_left >= 0:  # keys past S excluded
        m_hi = tl.minimum(m_hi, tl.minimum(n0 + BLOCK_N, S) + win_left)
    # and of those, the query blocks whose every row sees every key of this block: [full_lo, full_hi), unmasked
    first = tl.where(win_right >= 0, n0 + BLOCK_N - 1 - win_right, 0)  # the first row that sees the last key
    last = tl.where(win_left >= 0, n0 + win_left, L - 1)  # the last row that sees the first key
    if IS_CAUSAL:
        first = tl.maximum(first, n0 + BLOCK_N - 1)
    if INTERVALS:  # the query blocks covering the keys' query intervals [col_lo, col_hi]
        col_lo = tl.load(ColLo + offs_n, mask=offs_n < S, other=L)
        col_hi = tl.load(ColHi + offs_n, mask=offs_n < S, other=-1)
        m_lo = (tl.minimum(tl.min(col_lo, 0), L) // BLOCK_M) * BLOCK_M
        m_hi = tl.minimum(tl.max(col_hi, 0) + 1, L)
        first, last = tl.max(col_lo, 0), tl.min(col_hi, 0)
    full_lo, full_hi = _full_blocks(first, last, m_lo, m_hi, l_even, BLOCK_M)
    for g in range(GROUP):
        h = hk * GROUP + g
        bh = b * H + h
        q_base = Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh
        lse_base = Lse + bh.to(tl.int64) * L
        delta_base = Delta + bh.to(tl.int64) * L
        mask_base = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
        ds_base = DS + bh.to(tl.int64) * L * S
        if TMA_DQ:
            dq_base = DQ32
        else:
            dq_base = DQ32 + bh.to(tl.int64) * L * D
        if WINDOW or INTERVALS:  # masked edges, unmasked middle
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, ds_base, dq_base, m_lo, full_lo,
                offs_n, offs_d, offs_dv, stride_qm, stride_qd, stride_gm, stride_gd, stride_mm, stride_mn,
                L, S, D, DV, qk_scale, scale, seed0, seed1, bh, drop_threshold, inv_keep, win_left, win_right,
                cap_scale, cap_mult, RowLo, RowHi, IS_CAUSAL, True, HAS_MASK, MASK_BOOL, DROPOUT, COMPUTE_DK,
                COMPUTE_DV, STORE_DS, ATOMIC_DQ, TMA_DQ, EVEN_D, EVEN_DV, IEEE, WINDOW, SOFTCAP, INTERVALS, BLOCK_M,
            )
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, ds_base, dq_base, full_lo, full_hi,
                offs_n, offs_d, offs_dv, stride_qm, stride_qd, stride_gm, stride_gd, stride_mm, stride_mn,
                L, S, D, DV, qk_scale, scale, seed0, seed1, bh, drop_threshold, inv_keep, win_left, win_right,
                cap_scale, cap_mult, RowLo, RowHi, False, False, HAS_MASK, MASK_BOOL, DROPOUT, COMPUTE_DK, COMPUTE_DV,
                STORE_DS, ATOMIC_DQ, TMA_DQ, EVEN_D, EVEN_DV, IEEE, False, SOFTCAP, False, BLOCK_M,
            )
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, ds_base, dq_base, full_hi, m_hi,
                offs_n, offs_d, offs_dv, stride_qm, stride_qd, stride_gm, stride_gd, stride_mm, stride_mn,
                L, S, D, DV, qk_scale, scale, seed0, seed1, bh, drop_threshold, inv_keep, win_left, win_right,
                cap_scale, cap_mult, RowLo, RowHi, IS_CAUSAL, True, HAS_MASK, MASK_BOOL, DROPOUT, COMPUTE_DK,
                COMPUTE_DV, STORE_DS, ATOMIC_DQ, TMA_DQ, EVEN_D, EVEN_DV, IEEE, WINDOW, SOFTCAP, INTERVALS, BLOCK_M,
            )
        else:
            if IS_CAUSAL:
                dk, dv = _bwd_dkdv_inner(
                    dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, ds_base, dq_base,
                    m_start, tl.minimum(m_mid, L),
                    offs_n, offs_d, offs_dv, stride_qm, stride_qd, stride_gm, stride_gd, stride_mm, stride_mn,
                    L, S, D, DV, qk_scale, scale, seed0, seed1, bh, drop_threshold, inv_keep, win_left, win_right,
                    cap_scale, cap_mult, RowLo, RowHi, True, True, HAS_MASK, MASK_BOOL, DROPOUT, COMPUTE_DK, COMPUTE_DV,
                    STORE_DS, ATOMIC_DQ, TMA_DQ, EVEN_D, EVEN_DV, IEEE, False, SOFTCAP, False, BLOCK_M,
                )
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, ds_base, dq_base, m_mid, l_even,
                offs_n, offs_d, offs_dv, stride_qm, stride_qd, stride_gm, stride_gd, stride_mm, stride_mn,
                L, S, D, DV, qk_scale, scale, seed0, seed1, bh, drop_threshold, inv_keep, win_left, win_right,
                cap_scale, cap_mult, RowLo, RowHi, False, False, HAS_MASK, MASK_BOOL, DROPOUT, COMPUTE_DK, COMPUTE_DV,
                STORE_DS, ATOMIC_DQ, TMA_DQ, EVEN_D, EVEN_DV, IEEE, False, SOFTCAP, False, BLOCK_M,
            )
            dk, dv = _bwd_dkdv_inner(
                dk, dv, k, v, q_base, do_base, lse_base, delta_base, mask_base, ds_base, dq_base,
                tl.maximum(m_mid, l_even), L,
                offs_n, offs_d, offs_dv, stride_qm, stride_qd, stride_gm, stride_gd, stride_mm, stride_mn,
                L, S, D, DV, qk_scale, scale, seed0, seed1, bh, drop_threshold, inv_keep, win_left, win_right,
                cap_scale, cap_mult, RowLo, RowHi, False, True, HAS_MASK, MASK_BOOL, DROPOUT, COMPUTE_DK, COMPUTE_DV,
                STORE_DS, ATOMIC_DQ, TMA_DQ, EVEN_D, EVEN_DV, IEEE, False, SOFTCAP, False, BLOCK_M,
            )

    key_rows = offs_n[:, None] < S
    if COMPUTE_DK:
        tl.store(DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn
                 + offs_d[None, :] * stride_dkd, (dk * scale).to(DK.dtype.element_ty),
                 mask=key_rows & (offs_d[None, :] < D))
    if COMPUTE_DV:
        if DROPOUT:
            dv = dv * inv_keep
        tl.store(DV_ + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvn
                 + offs_dv[None, :] * stride_dvd, dv.to(DV_.dtype.element_ty),
                 mask=key_rows & (offs_dv[None, :] < DV))


@triton.jit
def _bwd_dq_inner(
    dq, q, do, lse2, lse_lo, delta, k_base, v_base, mask_base, lo, hi,
    offs_m, offs_n, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
    L, S, D, DV, qk_scale, seed0, seed1, bh, drop_threshold, inv_keep, win_left, win_right, cap_scale, cap_mult,
    row_lo, row_hi,
    CHECK_KEYS: tl.constexpr, CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    DROPOUT: tl.constexpr, EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, IEEE: tl.constexpr,
    DELTA_ONLY: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, INTERVALS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """dQ of one query block over key blocks [lo, hi); DELTA_ONLY: instead delta = sum_j P dP (``dq`` is then
    a (BLOCK_M,) row sum), with the very dP tiles the dQ pass forms."""
    k_ptrs = k_base + (lo + offs_n)[:, None] * stride_kn + offs_d[None, :] * stride_kd
    v_ptrs = v_base + (lo + offs_n)[:, None] * stride_vn + offs_dv[None, :] * stride_vd
    for start_n in range(lo, hi, BLOCK_N):
        start_n = tl.multiple_of(start_n, BLOCK_N)
        cols = start_n + offs_n
        k = _load2d(k_ptrs, cols, S, offs_d, D, CHECK_KEYS, not EVEN_D)
        v = _load2d(v_ptrs, cols, S, offs_dv, DV, CHECK_KEYS, not EVEN_DV)
        qk = _mm(q, tl.trans(k), IEEE)
        if CHECK_KEYS or CAUSAL or HAS_MASK or WINDOW or SOFTCAP or INTERVALS:
            s, t = _masked_scores(qk, qk_scale, mask_base, stride_mm, stride_mn, offs_m, cols, L, S, win_left,
                                  win_right, cap_scale, cap_mult, row_lo, row_hi, CHECK_KEYS, CAUSAL, HAS_MASK,
                                  MASK_BOOL, IEEE, WINDOW, SOFTCAP, INTERVALS)
        else:
            s = qk * qk_scale
            t = qk
        if IEEE:
            p = _exp((s - lse2[:, None]) - lse_lo[:, None], True)
        else:
            p = _exp(s - lse2[:, None], False)
        dp = _mm(do, tl.trans(v), IEEE)
        if DROPOUT:
            keep = _dropout_keep(seed0, seed1, offs_m[:, None], cols[None, :], bh, drop_threshold)
            dp = tl.where(keep, dp * inv_keep, 0.0)
        if DELTA_ONLY:
            dq += tl.sum(p * dp, 1)
        else:
            ds = p * (dp - delta[:, None])
            if SOFTCAP:  # through the soft-cap to the raw score
                ds = ds * (1.0 - t * t)
            dq = _mma(ds.to(k.dtype), k, dq, IEEE)
        k_ptrs += BLOCK_N * stride_kn
        v_ptrs += BLOCK_N * stride_vn
    return dq


@triton.jit(do_not_specialize=["seed0", "seed1", "drop_threshold"])
def _attn_bwd_dq_kernel(
    Q, K, V, DO, Lse, Delta, DQ, Mask, RowLo, RowHi,
    stride_qb, stride_qh, stride_qm, stride_qd,
    stride_kb, stride_kh, stride_kn, stride_kd,
    stride_vb, stride_vh, stride_vn, stride_vd,
    stride_gb, stride_gh, stride_gm, stride_gd,
    stride_mb, stride_mh, stride_mm, stride_mn,
    stride_dqb, stride_dqh, stride_dqm, stride_dqd,
    H, GROUP, L, S, D, DV, qk_scale, scale, seed0, seed1, drop_threshold, inv_keep, win_left, win_right, cap_scale,
    cap_mult,
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, DROPOUT: tl.constexpr,
    EVEN_D: tl.constexpr, EVEN_DV: tl.constexpr, IEEE: tl.constexpr, DELTA_ONLY: tl.constexpr,
    WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, INTERVALS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    """dQ of one query block; DELTA_ONLY: the pass before it, writing delta = sum_j P dP to Delta."""
    bh, b, h, hk, m0 = _query_block(H, GROUP, IS_CAUSAL, BLOCK_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)

    q = _load2d(Q + b.to(tl.int64) * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None] * stride_qm
                + offs_d[None, :] * stride_qd, offs_m, L, offs_d, D, True, not EVEN_D)
    do = _load2d(DO + b.to(tl.int64) * stride_gb + h.to(tl.int64) * stride_gh + offs_m[:, None] * stride_gm
                 + offs_dv[None, :] * stride_gd, offs_m, L, offs_dv, DV, True, not EVEN_DV)
    lse2 = tl.load(Lse + bh.to(tl.int64) * L + offs_m, mask=offs_m < L, other=float("inf"))
    if IEEE:  # natural units, float64 lse split in two fp32 words
        lse2, lse_lo = _split_lse(lse2)
    else:  # base-2 units
        lse2 = lse2 * 1.4426950408889634
        lse_lo = lse2
    k_base = K + b.to(tl.int64) * stride_kb + hk.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hk.to(tl.int64) * stride_vh
    mask_base = Mask + b.to(tl.int64) * stride_mb + h.to(tl.int64) * stride_mh
    if DELTA_ONLY:
        delta = tl.zeros([BLOCK_M], tl.float32)
        dq = tl.zeros([BLOCK_M], tl.float32)
    else:
        delta = tl.load(Delta + bh.to(tl.int64) * L + offs_m, mask=offs_m < L, other=0.0)
        dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    row_lo, row_hi, lo, full_lo, full_hi, hi = _query_block_keys(RowLo, RowHi, offs_m, L, S, m0, win_left,
                                                                 win_right, IS_CAUSAL, WINDOW, INTERVALS, BLOCK_M,
                                                                 BLOCK_N)
    if WINDOW or INTERVALS:
        dq = _bwd_dq_inner(
            dq, q, do, lse2, lse_lo, delta, k_base, v_base, mask_base, lo, full_lo,
            offs_m, offs_n, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
            L, S, D, DV, qk_scale, seed0, seed1, bh, drop_threshold, inv_keep, win_left, win_right, cap_scale,
            cap_mult, row_lo, row_hi,
            True, IS_CAUSAL, HAS_MASK, MASK_BOOL, DROPOUT, EVEN_D, EVEN_DV, IEEE, DELTA_ONLY, WINDOW, SOFTCAP,
            INTERVALS, BLOCK_N,
        )
    dq = _bwd_dq_inner(
        dq, q, do, lse2, lse_lo, delta, k_base, v_base, mask_base, full_lo, full_hi,
        offs_m, offs_n, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
        L, S, D, DV, qk_scale, seed0, seed1, bh, drop_threshold, inv_keep, win_left, win_right, cap_scale, cap_mult,
        row_lo, row_hi,
        False, False, HAS_MASK, MASK_BOOL, DROPOUT, EVEN_D, EVEN_DV, IEEE, DELTA_ONLY, False, SOFTCAP, False, BLOCK_N,
    )
    dq = _bwd_dq_inner(
        dq, q, do, lse2, lse_lo, delta, k_base, v_base, mask_base, full_hi, hi,
        offs_m, offs_n, offs_d, offs_dv, stride_kn, stride_kd, stride_vn, stride_vd, stride_mm, stride_mn,
        L, S, D, DV, qk_scale, seed0, seed1, bh, drop_threshold, inv_keep, win_left, win_right, cap_scale, cap_mult,
        row_lo, row_hi,
        True, IS_CAUSAL, HAS_MASK, MASK_BOOL, DROPOUT, EVEN_D, EVEN_DV, IEEE, DELTA_ONLY, WINDOW, SOFTCAP, INTERVALS,
        BLOCK_N,
    )
    # if / else, not an early return: the compiler (unlike the interpreter) still builds the code after a
    # constexpr branch that returns, where dq is the (BLOCK_M,) delta
    if DELTA_ONLY:
        tl.store(Delta + bh.to(tl.int64) * L + offs_m, dq, mask=offs_m < L)
    else:
        tl.store(DQ + b.to(tl.int64) * stride_dqb + h.to(tl.int64) * stride_dqh + offs_m[:, None] * stride_dqm
                 + offs_d[None, :] * stride_dqd, (dq * scale).to(DQ.dtype.element_ty),
                 mask=(offs_m[:, None] < L) & (offs_d[None, :] < D))


# ----------------------------------------------------------------------------- configs and launchers

# Overrides for tuning (benchmarks set these; None = the table below).
FWD_CONFIG: Config | None = None
BWD_DKDV_CONFIG: Config | None = None
BWD_DQ_CONFIG: Config | None = None


def _head_block(d: int) -> int:
    return max(16, next_power_of_2(d))


# (BLOCK_M, BLOCK_N, num_warps, num_stages) for 16-bit inputs on CUDA, by padded head dim.
# BLOCK_M is the query block, BLOCK_N the key block, in every kernel. Checked to compile for sm_90 without
# register spills (forward, dQ) or with few (dK/dV at D = 256).
# The D <= 128 entries are the fastest of the candidates timed on an H200 (bf16, L = 4096; see
# benchmarks/bench_scaled_dot_product_attention.py --sweep); causal gets its own where it differs.
_FWD = {64: Config(128, 64, 4, 3), 128: Config(128, 64, 8, 3), 256: Config(64, 64, 8, 2)}
_DKDV = {64: Config(32, 64, 4, 2), 128: Config(32, 128, 8, 2), 256: Config(32, 32, 8, 1)}
_DKDV_CAUSAL = {64: Config(32, 64, 4, 3)}
_DQ = {64: Config(128, 64, 8, 2), 128: Config(64, 64, 4, 2), 256: Config(64, 32, 4, 2)}
# Both head dims in (128, 256]: the fastest of ten candidates each on an H100 (bf16, causal, B=4 H=8 L=4096 D=256;
# --sweep-at 4,8,4096,256): forward 0.716 ms against 1.296 for _FWD's, dK/dV 2.548 against 5.310, dQ 1.196 against
# 1.474. Not where one head dim is small: (D, Dv) = (200, 3) gave wrong forward outputs with (128, 64, 8, 2) on an H100
# (Triton 3.6; its P @ V product is 128 x 64 x 16 there), so mixed widths keep the tables above.
_WIDE = {"fwd": Config(128, 64, 8, 2), "dkdv": Config(32, 32, 4, 2), "dq": Config(128, 32, 8, 2)}
_DQ_CAUSAL = {64: Config(64, 64, 4, 3), 128: Config(64, 32, 4, 3)}
# With an attn_mask tile in flight the kernels need more registers: configs that compile without (or with
# a few bytes of) register spills for sm_90.
_FWD_MASK = {64: Config(128, 64, 8, 3), 128: Config(128, 32, 8, 3)}
_DKDV_MASK = {128: Config(16, 128, 8, 2)}
_DQ_MASK = {128: Config(64, 32, 4, 3)}
# Windows and packed sequences (intervals): the causal tables (packed sequences are causal within each), and for dK/dV
# at D128 the fastest of five candidates timed on an H100 (bf16, 16K tokens; documents of 70-2663 tokens, windows
# 1024 and 4096): backward 206 / 243 / 294 TFLOP/s against 180 / 218 / 274 for the dense (32, 128, 8, 2).
_DKDV_SPARSE = {128: Config(32, 64, 4, 3)}
# dK/dV adding dQ atomically (D128, 16-bit): the fastest of six candidates on an H200 (L 1K-16K, causal and not).
_DKDV_ATOMIC = Config(64, 128, 8, 2)
# fp32 inputs (IEEE dots, twice the bytes per element): smaller tiles.
_FWD_FP32 = {64: Config(64, 32, 8, 1), 128: Config(32, 32, 4, 1), 256: Config(16, 16, 4, 1)}
_DKDV_FP32 = {128: Config(16, 32, 4, 1), 256: Config(16, 16, 4, 1)}
_DQ_FP32 = {64: Config(32, 32, 4, 1), 128: Config(32, 16, 4, 1), 256: Config(16, 16, 4, 1)}
# The interpreter (CPU): small tiles, so that small tests cross several blocks in L and S.
_INTERPRETER = {"fwd": Config(32, 16, 4, 1), "dkdv": Config(16, 32, 4, 1), "dq": Config(32, 16, 4, 1)}


def _pick(table: dict, bd: int) -> Config:
    return next(cfg for limit, cfg in sorted(table.items()) if bd <= limit)


def kernel_config(kind: str, device: torch.device, dtype: torch.dtype, d: int, dv: int, is_causal: bool,
                  has_mask: bool = False, sparse: bool = False, atomic_dq: bool = False) -> Config:
    """Block config of kernel ``kind`` ("fwd", "dkdv", "dq"); ``sparse``: a window or intervals; ``atomic_dq``: the
    dK/dV kernel adds dQ too. The module-level overrides win (tuning)."""
    override = {"fwd": FWD_CONFIG, "dkdv": BWD_DKDV_CONFIG, "dq": BWD_DQ_CONFIG}[kind]
    if override is not None:
        return override
    return _table_config(kind, device.type, dtype, d, dv, is_causal, has_mask, sparse, atomic_dq)


@functools.lru_cache(maxsize=256)  # merging the tables costs ~5 us of host time a call; three calls a fwd+bwd
def _table_config(kind: str, device_type: str, dtype: torch.dtype, d: int, dv: int, is_causal: bool, has_mask: bool,
                  sparse: bool, atomic_dq: bool) -> Config:
    if device_type != "cuda":
        return _INTERPRETER[kind]
    if atomic_dq and kind == "dkdv":  # only ever 16-bit, head dims in (64, 128]: _atomic_dq_pays
        return _DKDV_ATOMIC
    bd = max(_head_block(d), _head_block(dv))
    if dtype == torch.float32:
        table = {"fwd": _FWD_FP32, "dkdv": _DKDV_FP32, "dq": _DQ_FP32}[kind]
    else:
        table = {"fwd": _FWD, "dkdv": _DKDV, "dq": _DQ}[kind]
        if is_causal or sparse:
            table = {**table, **{"fwd": {}, "dkdv": _DKDV_CAUSAL, "dq": _DQ_CAUSAL}[kind]}
        if sparse and kind == "dkdv":
            table = {**table, **_DKDV_SPARSE}
        if has_mask:
            table = {**table, **{"fwd": _FWD_MASK, "dkdv": _DKDV_MASK, "dq": _DQ_MASK}[kind]}
        if min(_head_block(d), _head_block(dv)) == 256:
            return _WIDE[kind]
    return _pick(table, bd)


# Plain causal calls below this many forward flops keep dQ's own kernel: adding dQ atomically timed 0.95x there
# (the causal L = 1K rows at B*L = 16384, H*D = 2048; benchmarks/results/h*-scaled_dot_product_attention.md).
ATOMIC_DQ_MIN_CAUSAL_FLOPS = 2**37


def _atomic_dq_pays(dtype: torch.dtype, bd: int, bdv: int, has_mask: bool, plain_causal_flops: int | None) -> bool:
    """Whether the dK/dV kernel adds dQ atomically (unless ``backend.deterministic_attention()``): only where that
    was measured faster than dQ's own kernel (16-bit, head dims in (64, 128], no attn_mask; not plain causal calls
    below ATOMIC_DQ_MIN_CAUSAL_FLOPS)."""
    small_causal = plain_causal_flops is not None and plain_causal_flops < ATOMIC_DQ_MIN_CAUSAL_FLOPS
    return (dtype != torch.float32 and bd == 128 and bdv <= 128 and not has_mask and not small_causal
            and not backend.deterministic_attention())


def _mask_args(mask: torch.Tensor | None, fallback: torch.Tensor):
    """(pointer tensor, 4 strides, is_bool) for a mask already expanded to (B, H, L, S)."""
    if mask is None:
        return fallback, (0, 0, 0, 0), False
    if mask.dtype == torch.bool:
        return mask.view(torch.uint8), mask.stride(), True
    return mask, mask.stride(), False


def _exponent_scale(dtype: torch.dtype, scale: float) -> float:
    """Scores are kept in natural units for fp32 inputs (precise), in base 2 for fp16/bf16 (one multiply
    fewer per score): the kernels' IEEE flag selects the same units."""
    return scale if dtype == torch.float32 else scale * LOG2E


def _window_softcap_args(dtype: torch.dtype, scale: float, window: tuple[int, int], softcap: float) -> tuple:
    """(win_left, win_right, cap_scale, cap_mult): the soft-capped score in exponent units is
    cap_mult * tanh(qk * cap_scale) = (softcap in those units) * tanh(qk * scale / softcap)."""
    if softcap <= 0.0:
        return int(window[0]), int(window[1]), 1.0, 1.0
    return int(window[0]), int(window[1]), scale / softcap, softcap * (1.0 if dtype == torch.float32 else LOG2E)


def _hopper_scales(dtype: torch.dtype, scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap_scale) for the Hopper kernels: scores qk * qk_scale in exponent units, or soft-capped
    qk_scale * tanh(qk * cap_scale) (cap_scale > 0: qk_scale is then the cap in those units)."""
    if softcap <= 0.0:
        return _exponent_scale(dtype, scale), 0.0
    _, _, cap_scale, cap_mult = _window_softcap_args(dtype, scale, (-1, -1), softcap)
    return cap_mult, cap_scale


def _hopper_masks(L: int, S: int, is_causal: bool, window: tuple[int, int], intervals: tuple | None,
                  device: torch.device) -> tuple[bool, tuple | None]:
    """(causal, intervals) for the Hopper kernels, which take a window as per-row key intervals."""
    if tuple(window) == (-1, -1):
        return is_causal, intervals
    return False, _window_intervals(L, S, int(window[0]), int(window[1]), is_causal, torch.device(device))


@functools.lru_cache(maxsize=16)
def _window_intervals(L: int, S: int, left: int, right: int, is_causal: bool, device: torch.device) -> tuple:
    """Row i keeps keys [i - left, i + right] (and <= i if causal) within [0, S), key j is kept by rows
    [j - right (j if causal), j + left] within [0, L); -1 is unbounded. The same for every batch and head, and for
    every call of a training run: built once (a dozen small kernels, as long as the attention at L = 1K)."""
    i = torch.arange(L, dtype=torch.int32, device=device)
    j = torch.arange(S, dtype=torch.int32, device=device)
    row_lo = (i - left).clamp_min(0) if left >= 0 else torch.zeros_like(i)
    row_hi = i + right if right >= 0 else torch.full_like(i, S - 1)
    col_lo = (j - right).clamp_min(0) if right >= 0 else torch.zeros_like(j)
    col_hi = j + left if left >= 0 else torch.full_like(j, L - 1)
    if is_causal:
        row_hi, col_lo = torch.minimum(row_hi, i), torch.maximum(col_lo, j)
    return row_lo, row_hi.clamp_max(S - 1), col_lo, col_hi.clamp_max(L - 1)


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
    dropout: tuple[int, int, int, float] | None, is_causal: bool, scale: float,
    out: torch.Tensor | None = None, lse: torch.Tensor | None = None, window: tuple[int, int] = (-1, -1),
    softcap: float = 0.0, intervals: tuple[torch.Tensor, ...] | None = None, keys_per_row: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Output (B, H, L, Dv) in q's dtype and logsumexp (B, H, L) (+inf for fully-masked rows), float64 for
    fp32 inputs (m + log(l) unrounded), fp32 for 16-bit ones.

    q (B, H, L, D), k (B, H_kv, S, D), v (B, H_kv, S, Dv), any strides (stride 0 for broadcast dims too),
    any D, Dv <= 256 (padded to a power of two inside the kernels); mask None or expanded to (B, H, L, S),
    dropout None or (seed0, seed1, threshold, 1 / (1 - p)): seeds in [0, 2**31), an element is kept when
    the top 31 bits of its Philox word are >= threshold. ``out`` (any strides) and ``lse`` (contiguous):
    where to write, new tensors if None. ``window`` (left, right) and ``softcap``: as
    ``fusedlayers.functional.scaled_dot_product_attention``'s; key blocks outside the window are skipped.
    ``intervals``: (row_lo, row_hi, col_lo, col_hi) int32: query row i attends keys [row_lo[i], row_hi[i]] only
    (packed variable-length sequences, ``fusedlayers.ops.varlen_attention``), key j is attended by queries
    [col_lo[j], col_hi[j]]; blocks outside are skipped. ``keys_per_row``: about how many keys a row attends, with
    intervals (the call's size for the choice of the Hopper kernels; from the window if None).
    """
    B, H, L, D = q.shape
    H_kv, S, DV = k.shape[1], k.shape[2], v.shape[3]
    if out is None:
        out = torch.empty((B, H, L, DV), dtype=q.dtype, device=q.device)
    if lse is None:  # float64 for fp32 inputs: see _split_lse
        lse_dtype = torch.float64 if q.dtype == torch.float32 else torch.float32
        lse = torch.empty((B, H, L), dtype=lse_dtype, device=q.device)
    if out.numel() == 0:
        return out, lse
    hopper_ok = mask is None and dropout is None
    if keys_per_row is None:
        keys_per_row = backend.keys_per_row(S, is_causal, window)
    if hopper.enabled and hopper.applies(q, k, v, hopper_ok, scale, is_causal, keys_per_row):
        causal, intervals = _hopper_masks(L, S, is_causal, window, intervals, q.device)
        qk_scale, cap_scale = _hopper_scales(q.dtype, scale, softcap)
        hopper.attention_forward(q, k, v, causal, qk_scale, out, lse, intervals, keys_per_row, cap_scale)
        return out, lse
    cfg = kernel_config("fwd", q.device, q.dtype, D, DV, is_causal, mask is not None)
    mask_t, ms, mask_bool = _mask_args(mask, q)
    seed0, seed1, threshold, inv_keep = dropout if dropout is not None else (0, 0, 0, 1.0)
    bd, bdv = _head_block(D), _head_block(DV)
    grid = (cdiv(L, cfg.block_m), B * H)
    row_lo, row_hi = intervals[:2] if intervals is not None else (lse, lse)
    launch(_attn_fwd_kernel, grid,
        q, k, v, out, lse, mask_t, row_lo, row_hi,
        *q.stride(), *k.stride(), *v.stride(), *ms, *out.stride(),
        H, H // H_kv, L, S, D, DV, _exponent_scale(q.dtype, scale), seed0, seed1, threshold, inv_keep,
        *_window_softcap_args(q.dtype, scale, window, softcap),
        IS_CAUSAL=is_causal, HAS_MASK=mask is not None, MASK_BOOL=mask_bool, DROPOUT=dropout is not None,
        EVEN_D=bd == D, EVEN_DV=bdv == DV, IEEE=q.dtype == torch.float32,
        FAST_MAX=q.dtype != torch.float32 and scale >= 0.0, WINDOW=tuple(window) != (-1, -1), SOFTCAP=softcap > 0.0,
        INTERVALS=intervals is not None,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_D=bd, BLOCK_DV=bdv,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse


def attention_backward(
    grad_out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
    lse: torch.Tensor, mask: torch.Tensor | None, dropout: tuple[int, int, int, float] | None,
    is_causal: bool, scale: float, dq: torch.Tensor | None, dk: torch.Tensor | None, dv: torch.Tensor | None,
    ds: torch.Tensor | None, exact_delta: bool = False, window: tuple[int, int] = (-1, -1), softcap: float = 0.0,
    intervals: tuple[torch.Tensor, ...] | None = None, keys_per_row: float | None = None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Writes the gradients asked for into ``dq``, ``dk``, ``dv`` (any strides, shapes and dtypes of q, k,
    v) and ``ds`` (d(loss)/d(scores), (B, H, L, S) fp32 contiguous, for a float mask's gradient); None for
    each one not asked for. Shapes as in ``attention_forward``. Returns them.

    ``exact_delta``: form delta_i = sum_j P_ij dP_ij in a pass over the keys (the dQ kernel's loop without
    its dS.K product: two of the backward's seven tile products more) instead of rowsum(dO * O) from the
    saved output. Equal in exact arithmetic; but the saved output is rounded (fp16/bf16), and where the
    softmax is nearly one-hot dP - delta cancels, so that delta must come from the very dP it is taken from
    (as torch's math path does) for dS to keep its accuracy."""
    B, H, L, D = q.shape
    H_kv, S, DV = k.shape[1], k.shape[2], v.shape[3]
    dev = q.device
    need_dq, need_dk, need_dv, need_dmask = (t is not None for t in (dq, dk, dv, ds))
    if need_dmask:
        ds.zero_()
    if L == 0 or S == 0 or B * H == 0:  # nothing attends: zero gradients
        return tuple(t.zero_() if t is not None else None for t in (dq, dk, dv, ds))
    lse = lse.contiguous()
    # which kernels run: the Hopper ones where they apply (one pass with unordered dQ sums where determinism is not
    # asked for and it measured faster, else the two deterministic passes, dK/dV warp-specialized where that measured
    # faster), else the Triton dK/dV kernel, which also adds dQ atomically where determinism is not asked for and that
    # measured faster
    hopper_ok = mask is None and dropout is None  # windows and packing come as key intervals
    plain = hopper_ok and softcap <= 0.0 and tuple(window) == (-1, -1) and intervals is None
    if keys_per_row is None:
        keys_per_row = backend.keys_per_row(S, is_causal, window)
    hopper_dkdv, hopper_dq = hopper.backward_passes(q, k, v, grad_out, hopper_ok, scale,
                                                    is_causal and tuple(window) == (-1, -1), keys_per_row)
    if hopper_dkdv or hopper_dq:
        hopper_causal, hopper_intervals = _hopper_masks(L, S, is_causal, window, intervals, dev)
        qk_scale, cap_scale = _hopper_scales(q.dtype, scale, softcap)
    if (hopper_dkdv and hopper_dq and need_dq and need_dk and need_dv and not need_dmask and not exact_delta
            and BWD_DKDV_CONFIG is None and BWD_DQ_CONFIG is None
            and hopper.one_pass_applies(q, k, softcap > 0.0)):
        stats = hopper.one_pass_stats(q)
        lse2, delta = stats.unbind()
        l_pad = stats.shape[-1]
        dq32 = torch.empty((B * H, l_pad, D), dtype=torch.float32, device=dev)  # the preprocess zeroes it
        launch(_bwd_preprocess_kernel, (cdiv(l_pad, 64), B * H), out, grad_out, delta, lse, lse2, dq32,
               *out.stride(), *grad_out.stride(), H, L, DV, l_pad, BLOCK_M=64, BLOCK_DV=D, LSE2=True)
        hopper.attention_backward(q, k, v, grad_out, stats, dq32, hopper_causal, qk_scale, scale, dq, dk, dv,
                                  hopper_intervals, cap_scale)
        return dq, dk, dv, ds
    bd, bdv = _head_block(D), _head_block(DV)
    mask_t, ms, mask_bool = _mask_args(mask, q)
    seed0, seed1, threshold, inv_keep = dropout if dropout is not None else (0, 0, 0, 1.0)
    common = dict(
        IS_CAUSAL=is_causal, HAS_MASK=mask is not None, MASK_BOOL=mask_bool, DROPOUT=dropout is not None,
        EVEN_D=bd == D, EVEN_DV=bdv == DV, IEEE=q.dtype == torch.float32, BLOCK_D=bd, BLOCK_DV=bdv,
        WINDOW=tuple(window) != (-1, -1), SOFTCAP=softcap > 0.0, INTERVALS=intervals is not None,
    )
    scalars = (H, H // H_kv, L, S, D, DV, _exponent_scale(q.dtype, scale), scale, seed0, seed1, threshold, inv_keep,
               *_window_softcap_args(q.dtype, scale, window, softcap))
    strides = (*q.stride(), *k.stride(), *v.stride(), *grad_out.stride(), *ms)
    sparse = tuple(window) != (-1, -1) or intervals is not None
    dq_cfg = kernel_config("dq", dev, q.dtype, D, DV, is_causal, mask is not None, sparse)
    gluon_dkdv = need_dk and need_dv and BWD_DKDV_CONFIG is None and hopper_dkdv
    atomic_dq = (not gluon_dkdv and need_dq and (need_dk or need_dv)
                 and _atomic_dq_pays(q.dtype, bd, bdv, mask is not None,
                                     2 * B * H * L * S * D if plain and is_causal else None))
    gluon_dq = need_dq and not atomic_dq and BWD_DQ_CONFIG is None and hopper_dq
    # dK/dV by the warp-specialized pass where it measured faster, reading the statistics the dQ pass writes in its
    # layout
    ws_dkdv = (gluon_dkdv and gluon_dq and not exact_delta
               and hopper.ws_dkdv_applies(q, k, hopper_causal, hopper_intervals is not None, softcap > 0.0))
    stats = hopper.one_pass_stats(q) if ws_dkdv else None
    # delta, (B, H, L): summed from P dP (exact_delta), or rowsum(dO * O) by a pass of its own unless the Gluon dQ
    # pass, which then runs first, forms it (into ``stats`` for the warp-specialized dK/dV: delta a placeholder then)
    delta = stats[1] if ws_dkdv else torch.empty((B, H, L), dtype=torch.float32, device=dev)
    row_lo, row_hi, col_lo, col_hi = intervals if intervals is not None else (delta,) * 4
    if exact_delta:  # the dQ kernel's loop, summing P dP (dq_t is not written)
        dq_t = dq if need_dq else q
        launch(_attn_bwd_dq_kernel, (cdiv(L, dq_cfg.block_m), B * H),
            q, k, v, grad_out, lse, delta, dq_t, mask_t, row_lo, row_hi, *strides, *dq_t.stride(), *scalars, **common,
            DELTA_ONLY=True, BLOCK_M=dq_cfg.block_m, BLOCK_N=dq_cfg.block_n, num_warps=dq_cfg.num_warps,
            num_stages=dq_cfg.num_stages,
        )
    elif not gluon_dq:
        pre_m = 64 if bdv <= 128 else 32
        launch(_bwd_preprocess_kernel, (cdiv(L, pre_m), B * H),
            out, grad_out, delta, delta, delta, delta, *out.stride(), *grad_out.stride(), H, L, DV, L, BLOCK_M=pre_m,
            BLOCK_DV=bdv, LSE2=False,
        )
    if gluon_dq:
        hopper.attention_backward_dq(q, k, v, grad_out, lse, delta, hopper_causal, qk_scale, scale, dq,
                                     hopper_intervals, cap_scale, out=None if exact_delta else out, stats=stats)
    tma_dq = atomic_dq and dev.type == "cuda" and torch.cuda.get_device_capability(dev)[0] >= 9
    dq32 = delta
    if tma_dq:
        dq32 = torch.zeros((B * H, L, bd), dtype=torch.float32, device=dev)
    elif atomic_dq:
        dq32 = torch.zeros((B, H, L, D), dtype=torch.float32, device=dev)
    if ws_dkdv:
        hopper.attention_backward(q, k, v, grad_out, stats, None, hopper_causal, qk_scale, scale, None, dk, dv,
                                  hopper_intervals, cap_scale)
    elif gluon_dkdv:
        hopper.attention_backward_dkdv(q, k, v, grad_out, lse, delta, hopper_causal, qk_scale, scale, dk, dv,
                                       hopper_intervals, cap_scale)
    elif need_dk or need_dv or need_dmask:
        cfg = kernel_config("dkdv", dev, q.dtype, D, DV, is_causal, mask is not None, sparse, atomic_dq)
        dk_t, dv_t = dk if need_dk else k, dv if need_dv else v
        launch(_attn_bwd_dkdv_kernel, (cdiv(S, cfg.block_n), B * H_kv),
            q, k, v, grad_out, lse, delta, dk_t, dv_t, mask_t, ds if need_dmask else delta,
            TensorDescriptor.from_tensor(dq32, [1, cfg.block_m, bd]) if tma_dq else dq32,
            row_lo, row_hi, col_lo, col_hi, *strides, *dk_t.stride(), *dv_t.stride(), *scalars,
            COMPUTE_DK=need_dk, COMPUTE_DV=need_dv, STORE_DS=need_dmask, ATOMIC_DQ=atomic_dq, TMA_DQ=tma_dq, **common,
            BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )
    if atomic_dq:
        dq.copy_(dq32.view(B, H, L, -1)[..., :D])
    elif need_dq and not gluon_dq:
        cfg = dq_cfg
        launch(_attn_bwd_dq_kernel, (cdiv(L, cfg.block_m), B * H),
            q, k, v, grad_out, lse, delta, dq, mask_t, row_lo, row_hi, *strides, *dq.stride(), *scalars, **common,
            DELTA_ONLY=False, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages,
        )
    return dq, dk, dv, ds
