"""Triton kernels for softmax, plain and scaled-masked, forward and backward.

Softmax over the last dim: every kernel sees the input as a 2-D (rows, cols) view with a row stride and
a column stride, and accumulates in fp32. Two shapes of kernel:

- one-pass: a (BLOCK_M, BLOCK_N) tile holds BLOCK_M whole rows in registers; each element is read
  once and written once (2 tensors moved forward, 3 backward). Rows of one program each run as 1-D
  blocks (the row kernels: the backward's, and the forward's for plain rows), tuned per row length and dtype.
- split: for rows past one program's registers (backward: over 32K elements; forward: see
  SPLIT_FORWARD_FROM). SPLIT cooperating programs each
  own one part of the row, publish what the row needs from it to a small fp32 buffer, wait at a
  per-row barrier for the others', and write their part. Backward: each holds its block in registers
  and publishes its part of sum(grad * out), so each element is still read once. Forward (plain rows
  only: the longest, and past 16K on GPUs that measured faster so): each sweeps its part for a running max and sum,
  publishes the pair, and after the barrier re-reads its part (from L2) to write it; short parts keep
  the rows in flight within L2. On the GPU the SPLIT programs of a row must run at the same time:
  programs take their part from a ticket counter (an atomic), so a program only ever waits for parts
  already taken by running programs, and SPLIT is capped far below the resident programs of one GPU.
  The interpreter runs programs one after another, so there the same kernel runs in two launches
  (partial results, then output) instead of waiting.
- looped: for forward rows past 16K columns that are not split, and rows too long for either. The
  forward keeps a running max and sum (online softmax) in a first sweep, then a second sweep writes
  exp(x - max) / sum; the backward sums grad * out in a first sweep and writes the gradient in a
  second. One program owns one row, so the second sweep re-reads what the first just brought into L2.

The scaled-masked variant computes softmax(x * scale + mask) where the mask is bool (True = keep) or
additive float, broadcast to the scores through its strides (stride 0 where it broadcasts), and/or
causal (key j kept for query i when j <= i, top-left as in SDPA). Rows whose every entry is -inf give
zeros when ZERO_EMPTY_ROWS is set (the masked op), NaN otherwise (plain softmax, as torch does).

Plain softmax over any other dim (the strided kernels): input, output and gradients are seen as
(outer, cols, inner) views, the dim in the middle, each with its own three strides; the output is
contiguous (torch's layout), so for a contiguous input softmax over dim d reduces with column stride
inner. A program takes BLOCK_M consecutive inner indices of one outer index (consecutive addresses in a
contiguous tensor, which the compiler sees when the inner stride is 1: coalesced, vectorized accesses)
and reduces over the columns in one tile, or in two sweeps (running max and sum, then the output; the
backward: sum(grad * out), then the gradient) when the tile would exceed STRIDED_TILE elements. No
transposed copy is made; a copy happens only where an input's strides do not allow the 3-D view.
"""

from __future__ import annotations

import functools
import math
import threading
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fusedlayers.kernels import cdiv, launch, next_power_of_2

# Rows up to these many columns run the one-pass kernels: the backward's up to MAX_ONE_PASS_COLS, the forward's up
# to MAX_ONE_PASS_FORWARD_COLS. Longer rows: the forward runs the looped kernel (the split one from SPLIT_FORWARD_FROM,
# below); the backward runs the split kernel, in at most MAX_SPLIT blocks of SPLIT_BLOCK_N columns, and the looped
# one beyond. Measured, bf16, kernels alone, fraction of copy (benchmarks/results/h100-softmax.md, h200-softmax.md):
# the forward at 20000 / 24576 / 32768 columns one-pass 0.72 / 0.84 / 0.95, looped 0.75 / 0.86 / 0.99 on an H100.
MAX_ONE_PASS_COLS = 32768
MAX_ONE_PASS_FORWARD_COLS = 16384
SPLIT_BLOCK_N = 8192
SPLIT_WARPS = 8
MAX_SPLIT = 32
# The forward splits plain rows from SPLIT_FORWARD_FROM columns (65537 unless the GPU is in SPLIT_FORWARD_FROM_ON)
# into parts of SPLIT_FORWARD_PART columns (16-bit input; fp32 half: same bytes), at most MAX_SPLIT. Measured the
# same way: on an H200 split 0.84 at 32768 and 65536 columns against one-pass 0.77 / looped 0.81; on an H100 looped
# 0.99 / 0.94 against split 0.89 / 0.89 at 32768 / 65536 (split 0.82 / 0.88 at 20000 / 24576, left on the looped
# kernel there for one rule per GPU); at 131072 split 0.82 / looped 0.69 on the H200, 0.88 / 0.77 on the H100.
SPLIT_FORWARD_FROM = MAX_ONE_PASS_COLS * 2 + 1
SPLIT_FORWARD_FROM_ON = {"H200": MAX_ONE_PASS_FORWARD_COLS + 1}
SPLIT_FORWARD_PART = 16384
SPLIT_FORWARD_WARPS = 4


class LoopConfig(NamedTuple):
    """Launch settings of a looped kernel."""

    block_n: int  # columns per sweep step for 16-bit input; fp32 takes half (same bytes, same shared memory)
    warps: int
    programs_per_sm: int  # > 0: a persistent grid of this many programs per SM; 0: one program per row
    stages: int  # software-pipelining depth of the sweeps (loads issued ahead of their use)
    l2_hints: bool = False  # sweep 1 loads evict_last, sweep 2 loads and the stores evict_first (keep x in L2)


# Measured on an H200, bf16 rows of 65536 columns (benchmarks/results/h200-softmax.md, tuning notes): with the L2
# hints, one 16K-column block per step; the backward reads two tensors per step and wants a deeper pipeline.
LOOP_FORWARD = LoopConfig(block_n=16384, warps=16, programs_per_sm=0, stages=1, l2_hints=True)
LOOP_BACKWARD = LoopConfig(block_n=16384, warps=16, programs_per_sm=0, stages=4, l2_hints=True)


@triton.jit
def _scores_tile(
    x_ptr, mask_ptr, rows, cols, n_rows, n_cols, stride_xr, stride_xc,
    mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr, EVICT: tl.constexpr,
):
    """Load a (rows x cols) tile of x and return x * scale with masks applied (fp32, -inf = masked).
    ``EVICT``: the L2 eviction policy of the loads ("" default, "evict_last", "evict_first")."""
    r = rows[:, None]
    c = cols[None, :]
    inside = (r < n_rows) & (c < n_cols)
    q = r % q_len  # query index within its (L, S) matrix
    if IS_CAUSAL:
        inside_kept = inside & (c <= q)  # masked-out keys are never read
    else:
        inside_kept = inside
    x = tl.load(x_ptr + r.to(tl.int64) * stride_xr + c * stride_xc, mask=inside_kept, other=0.0, eviction_policy=EVICT)
    # Padding lanes are -inf whatever the scale (scale may be 0 or negative).
    z = tl.where(inside_kept, x.to(tl.float32) * scale, float("-inf"))
    if HAS_MASK:
        bh = (r // q_len).to(tl.int64)
        off = (bh // mask_b) * mask_sb + (bh % mask_b) * mask_sh + q * mask_sq + c * mask_sk
        m = tl.load(mask_ptr + off, mask=inside_kept, other=0, eviction_policy=EVICT)
        if MASK_IS_BOOL:
            z = tl.where(m != 0, z, float("-inf"))
        else:
            z = z + m.to(tl.float32)
    return z, inside


# exp(z - m) is computed as exp2(z * LOG2E - m * LOG2E): one fma and tl.exp2 (ex2.approx.ftz, one instruction) per
# element, where tl.exp(z - m) takes a subtraction, a multiply and ex2.approx without ftz, which ptxas wraps in three
# more instructions to scale subnormal results: 1088 instead of 1600 instructions in the split forward. Outputs below
# 2 ** -126 (fp32's normal range) flush to zero.
LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)


@triton.jit
def _softmax_fwd_kernel(
    x_ptr, y_ptr, mask_ptr, n_rows, n_cols, stride_xr, stride_xc,
    mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr,
    ZERO_EMPTY_ROWS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    NO_HINT: tl.constexpr = ""  # the default L2 policy
    z, inside = _scores_tile(
        x_ptr, mask_ptr, rows, cols, n_rows, n_cols, stride_xr, stride_xc,
        mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale, HAS_MASK, MASK_IS_BOOL, IS_CAUSAL, NO_HINT,
    )
    row_max = tl.max(z, axis=1)
    if ZERO_EMPTY_ROWS:
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
    e = tl.exp2(z * LOG2E - (row_max * LOG2E)[:, None])
    denom = tl.sum(e, axis=1)
    if ZERO_EMPTY_ROWS:
        denom = tl.where(denom == 0.0, 1.0, denom)
    y = e / denom[:, None]
    tl.store(y_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _widen(v, BITS: tl.constexpr):
    """v as fp32. BITS (bf16 v only): through v's bits, a conversion the compiler cannot merge with an earlier
    ``v.to(fp32)``, so that it keeps v in 16-bit registers until this use instead of holding the fp32 values: half
    the registers for a long row, more rows in flight per SM."""
    if BITS:
        return (v.to(tl.int16, bitcast=True).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@triton.jit
def _softmax_fwd_row_kernel(
    x_ptr, y_ptr, mask_ptr, n_rows, n_cols, stride_xr, stride_xc,
    mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale,
    BLOCK_N: tl.constexpr, RECOMPUTE: tl.constexpr,
):
    """The one-pass forward of plain rows (no mask, scale 1, unit column stride), one row per program, as a 1-D block
    (the arguments of ``_softmax_fwd_kernel``, most unused). RECOMPUTE (bf16): exp is computed again for the output
    instead of being held from the sum (see ``ROW_FORWARD``)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < n_cols
    x = tl.load(x_ptr + row * stride_xr + cols, mask=inside, other=float("-inf"))
    row_max_log2 = tl.max(x.to(tl.float32), axis=0) * LOG2E
    e = tl.exp2(x.to(tl.float32) * LOG2E - row_max_log2)
    denom = tl.sum(e, axis=0)
    if RECOMPUTE:
        e = tl.exp2(_widen(x, True) * LOG2E - row_max_log2)
    tl.store(y_ptr + row * n_cols + cols, (e / denom).to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _softmax_fwd_looped_kernel(
    x_ptr, y_ptr, mask_ptr, n_rows, n_cols, stride_xr, stride_xc,
    mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr,
    ZERO_EMPTY_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, L2_HINTS: tl.constexpr,
):
    # Persistent: a few programs per SM walk the rows, so the rows in flight fit in L2 and sweep 2
    # re-reads from L2 what sweep 1 brought in (HBM traffic stays near 2 tensors, not 3).
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):
        _softmax_fwd_looped_row(
            x_ptr, y_ptr, mask_ptr, row, n_rows, n_cols, stride_xr, stride_xc,
            mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale,
            HAS_MASK, MASK_IS_BOOL, IS_CAUSAL, ZERO_EMPTY_ROWS, BLOCK_N, STAGES, L2_HINTS,
        )


@triton.jit
def _softmax_fwd_looped_row(
    x_ptr, y_ptr, mask_ptr, row, n_rows, n_cols, stride_xr, stride_xc,
    mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr,
    ZERO_EMPTY_ROWS: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr, L2_HINTS: tl.constexpr,
):
    rows = row + tl.arange(0, 1)
    KEEP: tl.constexpr = "evict_last" if L2_HINTS else ""
    DROP: tl.constexpr = "evict_first" if L2_HINTS else ""
    # Sweep 1: running max m and sum s of exp(z - m), one block max per step (one exp per element).
    m = tl.full((1,), float("-inf"), tl.float32)
    s = tl.zeros((1,), tl.float32)
    for start in tl.range(0, n_cols, BLOCK_N, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK_N)
        z, inside = _scores_tile(
            x_ptr, mask_ptr, rows, cols, n_rows, n_cols, stride_xr, stride_xc,
            mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale, HAS_MASK, MASK_IS_BOOL, IS_CAUSAL, KEEP,
        )
        m_new = tl.maximum(m, tl.max(z, axis=1))
        # While everything seen is -inf, s stays 0 (avoids exp(-inf - -inf) = NaN).
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp2(z * LOG2E - (m_safe * LOG2E)[:, None]), axis=1)
        m = m_new
    row_max = m
    denom = s
    if ZERO_EMPTY_ROWS:
        row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
        denom = tl.where(denom == 0.0, 1.0, denom)
    inv = 1.0 / denom
    row_max_log2 = row_max * LOG2E
    # Sweep 2: write the probabilities, last block first: what sweep 1 read last is likeliest in L2.
    last = tl.cdiv(n_cols, BLOCK_N) - 1
    for step in tl.range(0, last + 1, num_stages=STAGES):
        cols = (last - step) * BLOCK_N + tl.arange(0, BLOCK_N)
        z, inside = _scores_tile(
            x_ptr, mask_ptr, rows, cols, n_rows, n_cols, stride_xr, stride_xc,
            mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale, HAS_MASK, MASK_IS_BOOL, IS_CAUSAL, DROP,
        )
        y = tl.exp2(z * LOG2E - row_max_log2[:, None]) * inv[:, None]
        tl.store(y_ptr + rows[:, None].to(tl.int64) * n_cols + cols[None, :], y.to(y_ptr.dtype.element_ty),
                 mask=inside, eviction_policy=DROP)


@triton.jit
def _softmax_bwd_kernel(
    g_ptr, y_ptr, dx_ptr, n_rows, n_cols, stride_gr, stride_gc, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALED: tl.constexpr,
):
    """dx = scale * y * (g - sum(g * y)) for BLOCK_M rows per program; y is contiguous, g may be strided. Streaming
    stores and no multiply by a scale of 1 (SCALED false): 0.994-1.000 of copy at 16384 columns on an H200 against
    0.989-0.994 without (one row per program, before ``_softmax_bwd_row_kernel`` took such rows)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    r = rows[:, None].to(tl.int64)
    c = cols[None, :]
    inside = (rows[:, None] < n_rows) & (c < n_cols)
    y = tl.load(y_ptr + r * n_cols + c, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r * stride_gr + c * stride_gc, mask=inside, other=0.0).to(tl.float32)
    dot = tl.sum(g * y, axis=1)
    dx = y * (g - dot[:, None])
    if SCALED:
        dx = dx * scale
    tl.store(dx_ptr + r * n_cols + c, dx.to(dx_ptr.dtype.element_ty), mask=inside, cache_modifier=".cs")


@triton.jit
def _softmax_bwd_row_kernel(
    g_ptr, y_ptr, dx_ptr, n_rows, n_cols, stride_gr, stride_gc, scale,
    BLOCK_N: tl.constexpr, SCALED: tl.constexpr, WIDEN_BITS: tl.constexpr,
):
    """``_softmax_bwd_kernel`` for one row per program, as a 1-D block; WIDEN_BITS (bf16 y and g): see ``_widen``."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    inside = cols < n_cols
    y = tl.load(y_ptr + row * n_cols + cols, mask=inside, other=0.0)
    g = tl.load(g_ptr + row * stride_gr + cols * stride_gc, mask=inside, other=0.0)
    dot = tl.sum(g.to(tl.float32) * y.to(tl.float32), axis=0)
    dx = _widen(y, WIDEN_BITS) * (_widen(g, WIDEN_BITS) - dot)
    if SCALED:
        dx = dx * scale
    tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside, cache_modifier=".cs")


@triton.jit
def _softmax_bwd_looped_kernel(
    g_ptr, y_ptr, dx_ptr, n_rows, n_cols, stride_gr, stride_gc, scale, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    L2_HINTS: tl.constexpr,
):
    for row in tl.range(tl.program_id(0), n_rows, tl.num_programs(0)):  # persistent, as the forward
        _softmax_bwd_looped_row(g_ptr, y_ptr, dx_ptr, row, n_cols, stride_gr, stride_gc, scale, BLOCK_N, STAGES,
                                L2_HINTS)


@triton.jit
def _softmax_bwd_looped_row(
    g_ptr, y_ptr, dx_ptr, row, n_cols, stride_gr, stride_gc, scale, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
    L2_HINTS: tl.constexpr,
):
    row = (row + tl.arange(0, 1)).to(tl.int64)  # a (1,) int64 tensor: 64-bit offsets below
    KEEP: tl.constexpr = "evict_last" if L2_HINTS else ""
    DROP: tl.constexpr = "evict_first" if L2_HINTS else ""
    acc = tl.zeros((BLOCK_N,), tl.float32)
    for start in tl.range(0, n_cols, BLOCK_N, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK_N)
        inside = cols < n_cols
        y = tl.load(y_ptr + row * n_cols + cols, mask=inside, other=0.0, eviction_policy=KEEP).to(tl.float32)
        g = tl.load(g_ptr + row * stride_gr + cols * stride_gc, mask=inside, other=0.0, eviction_policy=KEEP)
        acc += g.to(tl.float32) * y
    dot = tl.sum(acc, axis=0)
    last = tl.cdiv(n_cols, BLOCK_N) - 1  # second sweep backwards, as in the forward
    for step in tl.range(0, last + 1, num_stages=STAGES):
        cols = (last - step) * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = cols < n_cols
        y = tl.load(y_ptr + row * n_cols + cols, mask=inside, other=0.0, eviction_policy=DROP).to(tl.float32)
        g = tl.load(g_ptr + row * stride_gr + cols * stride_gc, mask=inside, other=0.0, eviction_policy=DROP)
        dx = scale * y * (g.to(tl.float32) - dot)
        tl.store(dx_ptr + row * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside, eviction_policy=DROP)


# ----------------------------------------------------------------------------- split rows (backward)
# PHASE 0: one cooperative launch (GPU). PHASE 1: partial sums only; PHASE 2: output only, from the
# sums of a finished PHASE 1 launch (the interpreter, which cannot run programs concurrently).


@triton.jit
def _split_block(sync_ptr, next_sync_ptr, n_rows, SPLIT: tl.constexpr, PHASE: tl.constexpr):
    """(row, index of the block in the row) this program owns: by ticket when cooperative, so that
    every block a program waits for is held by a program already running. Cooperative launches also zero
    the next launch's counters (see SplitCounters): block 0 of each row its row's, ticket 0 the ticket."""
    if PHASE == 0:
        block = tl.atomic_add(sync_ptr + n_rows, 1, sem="relaxed")
        tl.store(next_sync_ptr + block // SPLIT, 0, mask=block % SPLIT == 0)
        tl.store(next_sync_ptr + n_rows, 0, mask=block == 0)
    else:
        block = tl.program_id(0)
    return block // SPLIT, block % SPLIT


@triton.jit
def _row_barrier(counter_ptr, SPLIT: tl.constexpr):
    """Wait until the SPLIT programs of a row have all arrived; every store made before by any of them
    is then visible (the pattern of CUTLASS's semaphore: barrier, release; acquire, barrier). The wait
    polls with a one-thread atomic: polling with volatile loads (issued by every thread) measured 5-10%
    slower."""
    tl.debug_barrier()
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu") + 1
    while arrived < SPLIT:
        arrived = tl.atomic_add(counter_ptr, 0, sem="acquire", scope="gpu")
    tl.debug_barrier()


@triton.jit
def _softmax_bwd_split_kernel(
    g_ptr, y_ptr, dx_ptr, stats_ptr, sync_ptr, next_sync_ptr, n_rows, n_cols, stride_gr, stride_gc, scale,
    SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, PHASE: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row, part = _split_block(sync_ptr, next_sync_ptr, n_rows, SPLIT, PHASE)
    r = row.to(tl.int64)
    cols = part * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = cols < n_cols
    y = tl.load(y_ptr + r * n_cols + cols, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + r * stride_gr + cols * stride_gc, mask=inside, other=0.0).to(tl.float32)
    if PHASE != 2:
        tl.store(stats_ptr + r * SPLIT + part, tl.sum(g * y, axis=0))  # this block's part of sum(g * y)
    if PHASE == 0:
        _row_barrier(sync_ptr + row, SPLIT)
    if PHASE != 1:
        parts = tl.arange(0, SPLIT_P2)
        dot = tl.sum(tl.load(stats_ptr + r * SPLIT + parts, mask=parts < SPLIT, other=0.0, cache_modifier=".cg"))
        dx = scale * y * (g - dot)
        tl.store(dx_ptr + r * n_cols + cols, dx.to(dx_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _split_part_tile(
    x_ptr, mask_ptr, row, cols, n_rows, n_cols, stride_xr, stride_xc,
    mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr, PLAIN: tl.constexpr,
    EVICT: tl.constexpr,
):
    """A 1-D block of scores of ``row`` (fp32, -inf outside the row). PLAIN (no mask, no causal, scale 1, unit
    column stride): a bare load, which measured 0.78 of copy against 0.59 through ``_scores_tile`` at 64K columns on
    an H200."""
    if PLAIN:
        x = tl.load(x_ptr + row.to(tl.int64) * stride_xr + cols, mask=cols < n_cols, other=float("-inf"),
                    eviction_policy=EVICT)
        return x.to(tl.float32)
    else:
        z, inside = _scores_tile(
            x_ptr, mask_ptr, row + tl.arange(0, 1), cols, n_rows, n_cols, stride_xr, stride_xc,
            mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale, HAS_MASK, MASK_IS_BOOL, IS_CAUSAL, EVICT,
        )
        return tl.reshape(z, (cols.shape[0],))


@triton.jit
def _softmax_fwd_split_kernel(
    x_ptr, y_ptr, mask_ptr, stats_ptr, sync_ptr, next_sync_ptr, n_rows, n_cols, stride_xr, stride_xc,
    mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr, ZERO_EMPTY_ROWS: tl.constexpr,
    PLAIN: tl.constexpr, SPLIT: tl.constexpr, SPLIT_P2: tl.constexpr, PHASE: tl.constexpr, PART: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """Each program owns PART columns of a row: one sweep for their running max and sum (the looped kernel's first
    sweep), published as a (max, sum) pair; after the row barrier the SPLIT pairs combine into the row's, and a
    second sweep (from L2) writes the part. Short parts keep the rows in flight within L2 on GPUs whose bandwidth
    wants more programs in flight than one per row gives."""
    row, part = _split_block(sync_ptr, next_sync_ptr, n_rows, SPLIT, PHASE)
    stats = stats_ptr + row.to(tl.int64) * (2 * SPLIT)
    first = part * PART
    if PHASE != 2:
        m = tl.full([], float("-inf"), tl.float32)
        s = tl.zeros([], tl.float32)
        for start in range(0, PART, BLOCK_N):
            cols = first + start + tl.arange(0, BLOCK_N)
            z = _split_part_tile(
                x_ptr, mask_ptr, row, cols, n_rows, n_cols, stride_xr, stride_xc,
                mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale, HAS_MASK, MASK_IS_BOOL, IS_CAUSAL, PLAIN,
                "evict_last",
            )
            m_new = tl.maximum(m, tl.max(z, axis=0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # s stays 0 while everything seen is -inf
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp2(z * LOG2E - m_safe * LOG2E), axis=0)
            m = m_new
        tl.store(stats + part, m)
        tl.store(stats + SPLIT + part, s)
    if PHASE == 0:
        _row_barrier(sync_ptr + row, SPLIT)
    if PHASE != 1:
        parts = tl.arange(0, SPLIT_P2)
        maxes = tl.load(stats + parts, mask=parts < SPLIT, other=float("-inf"), cache_modifier=".cg")
        sums = tl.load(stats + SPLIT + parts, mask=parts < SPLIT, other=0.0, cache_modifier=".cg")
        row_max = tl.max(maxes, axis=0)
        denom = tl.sum(tl.where(maxes == float("-inf"), 0.0, sums * tl.exp(maxes - row_max)), axis=0)
        if ZERO_EMPTY_ROWS:
            row_max = tl.where(row_max == float("-inf"), 0.0, row_max)
            denom = tl.where(denom == 0.0, 1.0, denom)
        inv = 1.0 / denom
        row_max_log2 = row_max * LOG2E
        last = PART // BLOCK_N - 1
        for step in range(0, last + 1):  # last block first, as the looped kernel
            cols = first + (last - step) * BLOCK_N + tl.arange(0, BLOCK_N)
            z = _split_part_tile(
                x_ptr, mask_ptr, row, cols, n_rows, n_cols, stride_xr, stride_xc,
                mask_b, mask_sb, mask_sh, mask_sq, mask_sk, q_len, scale, HAS_MASK, MASK_IS_BOOL, IS_CAUSAL, PLAIN,
                "evict_first",
            )
            y = tl.exp2(z * LOG2E - row_max_log2) * inv
            tl.store(y_ptr + row.to(tl.int64) * n_cols + cols, y.to(y_ptr.dtype.element_ty), mask=cols < n_cols,
                     eviction_policy="evict_first")


# ----------------------------------------------------------------------------- other dims (strided)


@triton.jit
def _strided_block(n_inner, BLOCK_M: tl.constexpr):
    """(outer index, BLOCK_M inner indices, which of them exist) of this program: the inner indices come from
    ``arange`` plus a scalar, so the compiler sees them consecutive."""
    pid = tl.program_id(0)
    inner_blocks = tl.cdiv(n_inner, BLOCK_M)
    outer = (pid // inner_blocks).to(tl.int64)
    inner = (pid % inner_blocks) * BLOCK_M + tl.arange(0, BLOCK_M)
    return outer, inner[:, None].to(tl.int64), (inner < n_inner)[:, None]


@triton.jit
def _softmax_fwd_strided_kernel(
    x_ptr, y_ptr, n_inner, n_cols, stride_xo, stride_xc, stride_xi, stride_yo, stride_yc, stride_yi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr,
):
    """Softmax over the middle dim of (outer, cols, inner) views of x and y (see the module docstring). One tile
    (BLOCK_N >= n_cols), or LOOPED: a running max and sum over BLOCK_N columns at a time, then the output."""
    outer, inner, rows_ok = _strided_block(n_inner, BLOCK_M)
    x_rows = x_ptr + outer * stride_xo + inner * stride_xi
    y_rows = y_ptr + outer * stride_yo + inner * stride_yi
    cols = tl.arange(0, BLOCK_N)[None, :].to(tl.int64)
    if not LOOPED:
        inside = rows_ok & (cols < n_cols)
        z = tl.load(x_rows + cols * stride_xc, mask=inside, other=float("-inf")).to(tl.float32)
        row_max_log2 = tl.max(z, axis=1) * LOG2E
        e = tl.exp2(z * LOG2E - row_max_log2[:, None])
        y = e / tl.sum(e, axis=1)[:, None]
        tl.store(y_rows + cols * stride_yc, y.to(y_ptr.dtype.element_ty), mask=inside)
    else:
        m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        s = tl.zeros((BLOCK_M,), tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            z = tl.load(x_rows + c * stride_xc, mask=rows_ok & (c < n_cols), other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # s stays 0 while everything seen is -inf
            s = s * tl.exp(m - m_safe) + tl.sum(tl.exp2(z * LOG2E - (m_safe * LOG2E)[:, None]), axis=1)
            m = m_new
        inv = 1.0 / s
        row_max_log2 = m * LOG2E
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            inside = rows_ok & (c < n_cols)
            z = tl.load(x_rows + c * stride_xc, mask=inside, other=float("-inf")).to(tl.float32)
            y = tl.exp2(z * LOG2E - row_max_log2[:, None]) * inv[:, None]
            tl.store(y_rows + c * stride_yc, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _softmax_bwd_strided_kernel(
    g_ptr, y_ptr, dx_ptr, n_inner, n_cols, stride_go, stride_gc, stride_gi, stride_yo, stride_yc, stride_yi,
    stride_do, stride_dc, stride_di, scale,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, LOOPED: tl.constexpr, SCALED: tl.constexpr,
):
    """dx = scale * y * (g - sum(g * y)) over the middle dim of (outer, cols, inner) views of g, y and dx: one tile,
    or LOOPED: sum(g * y) over BLOCK_N columns at a time, then the gradient."""
    outer, inner, rows_ok = _strided_block(n_inner, BLOCK_M)
    g_rows = g_ptr + outer * stride_go + inner * stride_gi
    y_rows = y_ptr + outer * stride_yo + inner * stride_yi
    dx_rows = dx_ptr + outer * stride_do + inner * stride_di
    cols = tl.arange(0, BLOCK_N)[None, :].to(tl.int64)
    if not LOOPED:
        inside = rows_ok & (cols < n_cols)
        y = tl.load(y_rows + cols * stride_yc, mask=inside, other=0.0).to(tl.float32)
        g = tl.load(g_rows + cols * stride_gc, mask=inside, other=0.0).to(tl.float32)
        dx = y * (g - tl.sum(g * y, axis=1)[:, None])
        if SCALED:
            dx = dx * scale
        tl.store(dx_rows + cols * stride_dc, dx.to(dx_ptr.dtype.element_ty), mask=inside)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            inside = rows_ok & (c < n_cols)
            y = tl.load(y_rows + c * stride_yc, mask=inside, other=0.0).to(tl.float32)
            g = tl.load(g_rows + c * stride_gc, mask=inside, other=0.0).to(tl.float32)
            acc += g * y
        dot = tl.sum(acc, axis=1)[:, None]
        for start in range(0, n_cols, BLOCK_N):
            c = start + cols
            inside = rows_ok & (c < n_cols)
            y = tl.load(y_rows + c * stride_yc, mask=inside, other=0.0).to(tl.float32)
            g = tl.load(g_rows + c * stride_gc, mask=inside, other=0.0).to(tl.float32)
            dx = y * (g - dot)
            if SCALED:
                dx = dx * scale
            tl.store(dx_rows + c * stride_dc, dx.to(dx_ptr.dtype.element_ty), mask=inside)


class SplitCounters:
    """The counters of a split launch (an arrival count per row, then the ticket), zero when it starts, without a
    memset per launch: two buffers take turns, and each cooperative launch zeroes the first n_rows + 1 entries of
    the other one for the next launch (plain stores by programs it runs anyway; a memset kernel per call measured
    ~2 us, 1.2% of a 64K-column forward over 256 MiB on an H200, and counters reset by atomics slower still). The
    host only tracks how long a prefix of each buffer is known to be zero; launches on one stream run in order, so
    a zeroing launch has finished before the next launch starts. One instance per (device, stream)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.buffers = [torch.zeros(0, dtype=torch.int32, device=device)] * 2
        self.zeroed = [0, 0]  # entries known zero at the start of each buffer
        self.turn = 0

    def take(self, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(counters for this launch, counters the launch must zero for the next one)."""
        n, mine, other = n_rows + 1, self.turn, 1 - self.turn
        for i in (mine, other):
            if self.buffers[i].numel() < n:
                self.buffers[i] = torch.zeros(max(n, 2 * self.buffers[i].numel()), dtype=torch.int32,
                                              device=self.device)
                self.zeroed[i] = self.buffers[i].numel()
        if self.zeroed[mine] < n:
            self.buffers[mine][:n].zero_()
        self.zeroed[mine] = 0
        self.zeroed[other] = max(self.zeroed[other], n)
        self.turn = other
        return self.buffers[mine], self.buffers[other]


_COUNTERS: dict = {}  # (device index, stream) -> SplitCounters
_COUNTERS_LOCK = threading.Lock()  # held from taking counters to the launch: one order per stream


def split_counters(device: torch.device, n_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(counters, next launch's counters) for a split launch over ``n_rows`` rows on ``device``'s current stream.
    While a CUDA graph is captured, fresh zeroed counters: a replay re-runs the memset, not this bookkeeping."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        sync = torch.zeros(n_rows + 1, dtype=torch.int32, device=device)
        return sync, torch.empty_like(sync)
    key = (device.index, torch._C._cuda_getCurrentRawStream(device.index))
    counters = _COUNTERS.get(key)
    if counters is None:
        counters = _COUNTERS[key] = SplitCounters(device)
    return counters.take(n_rows)


def _launch_split(kernel, n_rows: int, split: int, device: torch.device, before: tuple, after: tuple,
                  meta: dict) -> None:
    """Launch a split kernel over ``n_rows`` x ``split`` programs, its counters between the ``before`` and
    ``after`` arguments: cooperatively on the GPU, in two phases elsewhere."""
    with _COUNTERS_LOCK:
        sync, next_sync = split_counters(device, n_rows)
        for phase in (0,) if device.type == "cuda" else (1, 2):
            launch(kernel, (n_rows * split,), *before, sync, next_sync, *after, **meta, PHASE=phase)


def _split_forward_part(element_size: int) -> int:
    return SPLIT_FORWARD_PART * 2 // max(element_size, 2)


def _split_forward_from(device: torch.device) -> int:
    """Row length from which the forward splits rows on ``device`` (see SPLIT_FORWARD_FROM_ON)."""
    return _on_gpu(device, SPLIT_FORWARD_FROM_ON, SPLIT_FORWARD_FROM)


def _on_gpu(device: torch.device | None, per_gpu: dict, default):
    """The value of ``per_gpu`` whose key is in ``device``'s GPU name, else ``default``."""
    name = _device_name(device) if device is not None else ""
    return next((value for key, value in per_gpu.items() if key in name), default)


@functools.cache
def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter runs programs one after another anyway
    return torch.cuda.get_device_properties(device).multi_processor_count


# Elements per one-pass forward program, by GPU (kernels alone, bf16, fraction of copy): at 1024 columns one row per
# program 1.001 on an H100 against 0.992-0.996 for two, but 0.918-0.925 on an H200 against 0.993-0.999 for two (512
# columns: 1.00 / 0.99 and 0.93 / 0.99).
ONE_PASS_FORWARD_ELEMENTS = 2048
ONE_PASS_FORWARD_ELEMENTS_ON = {"H100": 1024}


def _one_pass_config(n_cols: int, backward: bool = False, device: torch.device | None = None) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) for the 2-D one-pass kernels on ``device``: rows of ~1K-32K elements per program.
    (Where BLOCK_M is 1 the row kernels run instead, with ROW_FORWARD / ROW_BACKWARD's warps; the forward's for plain
    rows only, so these warps serve masked or strided rows of one program each.)

    Measured on an H200 and an H100 (benchmarks/results/h200-softmax.md, h100-softmax.md): from 16K elements the
    forward wants 32 warps, the backward 16 (equal at 16K columns; at 32K 0.99 vs 0.97 of copy on the H100, 1.01 vs
    0.94 on the H200); short rows ~2K elements per program (the forward on an H100 ~1K).
    """
    block_n = next_power_of_2(max(n_cols, 1))
    elements = 2048 if backward else _on_gpu(device, ONE_PASS_FORWARD_ELEMENTS_ON, ONE_PASS_FORWARD_ELEMENTS)
    block_m = max(1, min(16, elements // block_n))
    elements = block_m * block_n
    num_warps = 4 if elements <= 2048 else 8 if elements <= 8192 else 16 if backward else 32
    return block_m, block_n, num_warps


# Settings of the row kernels: (num_warps, RECOMPUTE for the forward / WIDEN_BITS for the backward) per GPU, row block
# (columns rounded up to a power of 2) and dtype ("*": any other, or output and gradient of different dtypes; the
# flags only ever for bf16). Unknown GPUs take the H200's. Blocks not listed (the forward's 1K rows on an H100; rows
# longer than kernel_for gives these kernels) take ROW_DEFAULT. Measured per GPU with the kernels alone, 256 MiB
# tensors, fraction of copy, three rounds (benchmarks/results/h200-softmax.md, h100-softmax.md), against the 2-D
# kernels with one row per program that ran these rows before:
# - H200 forward: 4 warps (bf16 16K 0.953-0.958 against 0.929-0.938; fp16 16K 0.957-0.963 / 0.933); bf16 2K and 8K
#   recompute exp (2K 0.998-0.999 / 0.989-0.994; 8K with 8 warps 0.985 / 0.956-0.962); fp32 8K with 16 warps (0.973 /
#   0.961-0.966), 16K with 8 (0.969-0.970 / 0.967-0.972).
# - H200 backward: 16 warps from 4K (bf16 4K / 8K 1.033-1.038 against 1.025-1.029); bf16 4K, 16K and 32K widened by
#   bits (16K 1.026 against 0.986-0.988 without and 0.999-1.002 for the 2-D kernel; 32K 1.009-1.012 / 1.003-1.006 /
#   1.000; at 8K bits lose: 1.022-1.026 / 1.034-1.037); fp16 16K with 4 warps (1.018-1.021 / 0.998 with 16 / 1.003).
# - H100 forward: 4 warps up to 4K (bf16 4K 0.992-0.995 / 0.990-0.993), 16 from 8K (bf16 8K recomputing exp
#   0.997-1.000 / 0.990-0.992; 16K 0.995 / 0.995; fp16 16K 0.984-0.986 / 0.990-0.993; fp32 8K 0.995 / 0.991).
# - H100 backward: 16 warps from 4K, without bits (bf16 16K 1.016-1.018 against 1.010 with bits and 1.019 for the 2-D
#   kernel; 8K 1.020 / 1.014), 8 warps at 32K (bf16 with bits 1.004-1.006 / 0.993-0.995; fp16 1.006-1.008 /
#   0.994-0.996).
ROW_FORWARD = {
    "H100": {4096: {"*": (4, False)}, 8192: {"bf16": (16, True), "*": (16, False)}, 16384: {"*": (16, False)}},
    "H200": {2048: {"bf16": (4, True), "*": (4, False)}, 4096: {"*": (4, False)},
             8192: {"bf16": (8, True), "fp32": (16, False), "*": (4, False)},
             16384: {"fp32": (8, False), "*": (4, False)}},
}
ROW_BACKWARD = {
    "H100": {4096: {"*": (16, False)}, 8192: {"*": (16, False)}, 16384: {"*": (16, False)},
             32768: {"bf16": (8, True), "*": (8, False)}},
    "H200": {4096: {"bf16": (16, True), "*": (16, False)}, 8192: {"*": (16, False)},
             16384: {"bf16": (16, True), "fp16": (4, False), "*": (16, False)},
             32768: {"bf16": (16, True), "*": (16, False)}},
}
ROW_DEFAULT = {"forward": (4, 32), "backward": (4, 16)}  # warps up to 2K columns, and beyond
_DTYPE_KEYS = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _row_config(table: dict, default: tuple[int, int], block_n: int, dtype: torch.dtype | None,
                device: torch.device | None) -> tuple[int, bool]:
    """(num_warps, flag) for a row kernel from ``table`` (ROW_FORWARD or ROW_BACKWARD)."""
    by_dtype = _on_gpu(device, table, table["H200"]).get(block_n)
    if by_dtype is None:
        return default[0] if block_n <= 2048 else default[1], False
    return by_dtype.get(_DTYPE_KEYS.get(dtype), by_dtype["*"])


def _row_forward_config(block_n: int, dtype: torch.dtype, device: torch.device | None = None) -> tuple[int, bool]:
    """(num_warps, RECOMPUTE) of ``_softmax_fwd_row_kernel`` (see ROW_FORWARD)."""
    return _row_config(ROW_FORWARD, ROW_DEFAULT["forward"], block_n, dtype, device)


def _row_backward_config(block_n: int, dtype: torch.dtype | None, device: torch.device | None = None
                         ) -> tuple[int, bool]:
    """(num_warps, WIDEN_BITS) of ``_softmax_bwd_row_kernel`` for output and gradient of ``dtype`` (None: of different
    dtypes; see ROW_BACKWARD)."""
    return _row_config(ROW_BACKWARD, ROW_DEFAULT["backward"], block_n, dtype, device)


def _mask_view(mask: torch.Tensor, x: torch.Tensor):
    """``mask`` (expanded to x's shape) as a 4-D (B, H, L, S) view and its strides.

    Kernel rows are numbered over x's leading dims; row r is query r % L of matrix bh = r // L, with
    bh = b * H + h. Leading dims beyond two are collapsed, which copies the mask only if its strides
    do not allow a view.
    """
    shape4 = (-1, x.shape[-3] if x.dim() >= 3 else 1, x.shape[-2] if x.dim() >= 2 else 1, x.shape[-1])
    m4 = mask.reshape(shape4)
    if m4.dtype == torch.bool:
        m4 = m4.view(torch.uint8)
    return m4, (m4.shape[1], *m4.stride())


def kernel_for(n_cols: int, backward: bool, device: torch.device | None = None, element_size: int = 2,
               plain: bool = True) -> str:
    """Which kernel shape runs rows of ``n_cols`` (of ``element_size`` bytes, on ``device``): "one_pass", "split" or
    "looped". ``plain``: unit-stride forward rows without mask or scale, which the split forward loads bare; others
    never split, since the split forward's general path (masks, scale, strides) is its slow one."""
    if backward:
        if n_cols <= MAX_ONE_PASS_COLS:
            return "one_pass"
        return "split" if cdiv(n_cols, SPLIT_BLOCK_N) <= MAX_SPLIT else "looped"
    split_from = _split_forward_from(device)
    if plain and n_cols >= split_from and cdiv(n_cols, _split_forward_part(element_size)) <= MAX_SPLIT:
        return "split"
    return "one_pass" if n_cols <= MAX_ONE_PASS_FORWARD_COLS else "looped"


SHAPES = ("one_pass", "split", "looped")


class Plan(NamedTuple):
    """How rows of one length run: the kernel, its launch keywords, and its grid."""

    shape: str  # one of SHAPES
    kernel: object
    meta: dict
    rows_per_program: int = 1  # one-pass kernels take BLOCK_M rows per program
    max_programs: int = 0  # > 0: a persistent grid of at most this many programs (looped)
    split: int = 1  # split kernels: programs per row, and ...
    stats_per_row: int = 0  # ... the fp32 values per row they publish to each other


def _check_shape(kernel: str | None) -> None:
    if kernel is not None and kernel not in SHAPES:
        raise ValueError(f"kernel must be one of {SHAPES} (or None), got {kernel!r}")


# The plans are memoized: their arithmetic (kernel_for, the GPU's name, the tile sizes) cost ~5 us of host time per
# eager call, which GPU kernels over small tensors wait for. forget_plans() after changing the constants above.
@functools.cache
def _forward_plan(n_cols: int, dtype: torch.dtype, device: torch.device, kernel: str | None, has_mask: bool,
                  mask_is_bool: bool, is_causal: bool, zero_empty_rows: bool, plain: bool) -> Plan:
    """``plain``: as in ``kernel_for``."""
    _check_shape(kernel)
    element_size = dtype.itemsize
    shape = kernel or kernel_for(n_cols, False, device, element_size, plain)
    flags = dict(HAS_MASK=has_mask, MASK_IS_BOOL=mask_is_bool, IS_CAUSAL=is_causal, ZERO_EMPTY_ROWS=zero_empty_rows)
    if shape == "split":
        part = min(_split_forward_part(element_size), next_power_of_2(n_cols))
        split = cdiv(n_cols, part)
        meta = dict(SPLIT=split, SPLIT_P2=next_power_of_2(split), PART=part, BLOCK_N=max(part // 2, 1), PLAIN=plain,
                    num_warps=SPLIT_FORWARD_WARPS)
        return Plan(shape, _softmax_fwd_split_kernel, {**flags, **meta}, split=split, stats_per_row=2 * split)
    if shape == "looped":
        return _looped_plan(_softmax_fwd_looped_kernel, LOOP_FORWARD, n_cols, element_size, device, flags)
    block_m, block_n, num_warps = _one_pass_config(n_cols, device=device)
    if block_m == 1 and plain:
        num_warps, recompute = _row_forward_config(block_n, dtype, device)
        return Plan(shape, _softmax_fwd_row_kernel, dict(BLOCK_N=block_n, RECOMPUTE=recompute, num_warps=num_warps))
    return Plan(shape, _softmax_fwd_kernel, dict(**flags, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps),
                rows_per_program=block_m)


@functools.cache
def _backward_plan(n_cols: int, dtype: torch.dtype, grad_dtype: torch.dtype, device: torch.device, kernel: str | None,
                   scaled: bool) -> Plan:
    """``dtype``: the output's (the forward's result), ``grad_dtype``: the incoming gradient's."""
    _check_shape(kernel)
    shape = kernel or kernel_for(n_cols, backward=True)
    if shape == "split":
        block_n = min(SPLIT_BLOCK_N, next_power_of_2(n_cols))
        split = cdiv(n_cols, block_n)
        meta = dict(SPLIT=split, SPLIT_P2=next_power_of_2(split), BLOCK_N=block_n, num_warps=SPLIT_WARPS)
        return Plan(shape, _softmax_bwd_split_kernel, meta, split=split, stats_per_row=split)
    if shape == "looped":
        return _looped_plan(_softmax_bwd_looped_kernel, LOOP_BACKWARD, n_cols, dtype.itemsize, device, {})
    block_m, block_n, num_warps = _one_pass_config(n_cols, backward=True)
    if block_m == 1:
        num_warps, bits = _row_backward_config(block_n, dtype if grad_dtype == dtype else None, device)
        return Plan(shape, _softmax_bwd_row_kernel, dict(BLOCK_N=block_n, SCALED=scaled, WIDEN_BITS=bits,
                                                         num_warps=num_warps))
    return Plan(shape, _softmax_bwd_kernel, dict(BLOCK_M=block_m, BLOCK_N=block_n, SCALED=scaled,
                                                 num_warps=num_warps), rows_per_program=block_m)


def _looped_plan(kernel, config: LoopConfig, n_cols: int, element_size: int, device: torch.device,
                 flags: dict) -> Plan:
    block_n = min(config.block_n * 2 // max(element_size, 2), next_power_of_2(n_cols))
    meta = dict(BLOCK_N=block_n, STAGES=config.stages, L2_HINTS=config.l2_hints, num_warps=config.warps)
    return Plan("looped", kernel, {**flags, **meta}, max_programs=_multiprocessors(device) * config.programs_per_sm)


def forget_plans() -> None:
    """Drop the memoized launch plans (after changing the tuning constants, as tests and the tuner do)."""
    _forward_plan.cache_clear()
    _backward_plan.cache_clear()


def _launch_plan(plan: Plan, device: torch.device, tensors: tuple, scalars: tuple, n_rows: int) -> None:
    """Launch ``plan`` over ``n_rows`` rows: ``kernel(*tensors, *scalars)``; a split kernel takes its statistics
    buffer and counters between the two."""
    if plan.shape == "split":
        stats = torch.empty(n_rows * plan.stats_per_row, dtype=torch.float32, device=device)
        _launch_split(plan.kernel, n_rows, plan.split, device, (*tensors, stats), scalars, plan.meta)
        return
    programs = cdiv(n_rows, plan.rows_per_program)
    if plan.max_programs:
        programs = min(programs, plan.max_programs)
    launch(plan.kernel, (programs,), *tensors, *scalars, **plan.meta)


def _rows(x: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """``x`` as rows of its last dim: (tensor to pass, n_rows, row stride, column stride). Contiguous tensors pass as
    they are (a reshape costs a microsecond of host time)."""
    n_cols = x.shape[-1]
    if x.is_contiguous():
        return x, x.numel() // n_cols, n_cols, 1
    x2 = x.reshape(-1, n_cols)
    return x2, x2.shape[0], x2.stride(0), x2.stride(1)


def softmax_forward(
    x: torch.Tensor, out_dtype: torch.dtype, scale: float = 1.0, mask: torch.Tensor | None = None,
    is_causal: bool = False, zero_empty_rows: bool = False, kernel: str | None = None, dim: int = -1,
) -> torch.Tensor:
    """Softmax of ``x * scale (+ mask)`` over the last dim, or of ``x`` over ``dim``, as a new contiguous tensor of
    ``out_dtype``.

    ``mask`` must already be expanded to ``x.shape`` (a view; broadcast dims have stride 0) and bool or
    floating. ``kernel`` forces a kernel shape, "one_pass", "split" or "looped" (None: ``kernel_for`` the row;
    a dim other than the last has no split kernel: "split" runs the looped one there). ``dim`` other than the
    last: plain softmax only (no scale, mask or causal).
    """
    _check_shape(kernel)
    dim = dim % max(x.dim(), 1)
    if dim != x.dim() - 1:
        if mask is not None or is_causal or scale != 1.0 or zero_empty_rows:
            raise ValueError("softmax_forward: scale, mask, is_causal and zero_empty_rows need dim=-1")
        return _strided_forward(x, out_dtype, dim, kernel)
    y = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    if y.numel() == 0:
        return y
    n_cols = x.shape[-1]
    x2, n_rows, stride_r, stride_c = _rows(x)
    q_len = x.shape[-2] if x.dim() >= 2 else 1
    mask_arg, heads = _mask_view(mask, x) if mask is not None else (x2, (1, 0, 0, 0, 0))
    plain = mask is None and not is_causal and scale == 1.0 and stride_c == 1
    plan = _forward_plan(n_cols, x.dtype, x.device, kernel, mask is not None,
                         mask is not None and mask.dtype == torch.bool, is_causal, zero_empty_rows, plain)
    _launch_plan(plan, x.device, (x2, y, mask_arg),
                 (n_rows, n_cols, stride_r, stride_c, *heads, q_len, float(scale)), n_rows)
    return y


def softmax_backward(
    grad: torch.Tensor, out: torch.Tensor, scale: float, grad_dtype: torch.dtype, kernel: str | None = None,
    dim: int = -1,
) -> torch.Tensor:
    """scale * out * (grad - sum(grad * out, dim)) as a new contiguous tensor of ``grad_dtype``. ``kernel``
    forces a kernel shape, "one_pass", "split" or "looped" (None: ``kernel_for`` the row length; as in
    ``softmax_forward`` for a dim other than the last)."""
    _check_shape(kernel)
    dim = dim % max(out.dim(), 1)
    if dim != out.dim() - 1:
        return _strided_backward(grad, out, scale, grad_dtype, dim, kernel)
    dx = torch.empty_like(out, dtype=grad_dtype, memory_format=torch.contiguous_format)
    if dx.numel() == 0:
        return dx
    n_cols = out.shape[-1]
    out = out if out.is_contiguous() else out.contiguous()  # the kernels read out with row stride n_cols
    g2, n_rows, stride_r, stride_c = _rows(grad)
    plan = _backward_plan(n_cols, out.dtype, grad.dtype, out.device, kernel, scale != 1.0)
    _launch_plan(plan, out.device, (g2, out, dx), (n_rows, n_cols, stride_r, stride_c, float(scale)), n_rows)
    return dx


# ----------------------------------------------------------------------------- other dims (strided): launchers

# Elements per program of the strided kernels (BLOCK_M x BLOCK_N): larger tiles loop over the columns. BLOCK_M, the
# inner indices per program, up to STRIDED_BLOCK_M: 64 bytes of consecutive 16-bit elements per column.
STRIDED_TILE = 4096
STRIDED_BLOCK_M = 32


def _as_3d(t: torch.Tensor, dim: int) -> torch.Tensor:
    """``t`` as an (outer, size of dim, inner) tensor: a view where t's strides allow one (any contiguous tensor,
    transposed and expanded ones too), else a contiguous copy."""
    shape = t.shape
    return t.reshape(math.prod(shape[:dim]), shape[dim], math.prod(shape[dim + 1:]))


def _strided_config(n_inner: int, n_cols: int, kernel: str | None) -> tuple[int, int, bool, int]:
    """(BLOCK_M, BLOCK_N, LOOPED, num_warps) of the strided kernels."""
    block_m = min(next_power_of_2(n_inner), STRIDED_BLOCK_M)
    block_n = next_power_of_2(n_cols)
    looped = kernel in ("looped", "split") or (kernel is None and block_m * block_n > STRIDED_TILE)
    if looped:
        block_n = min(block_n, max(STRIDED_TILE // block_m, 16))
    return block_m, block_n, looped, 4 if block_m * block_n <= 2048 else 8


def _strided_forward(x: torch.Tensor, out_dtype: torch.dtype, dim: int, kernel: str | None) -> torch.Tensor:
    y = torch.empty_like(x, dtype=out_dtype, memory_format=torch.contiguous_format)
    if y.numel() == 0:
        return y
    x3, y3 = _as_3d(x, dim), _as_3d(y, dim)
    n_outer, n_cols, n_inner = x3.shape
    if n_inner == 1:  # every dim after ``dim`` has size 1: rows of the last-dim kernels
        return softmax_forward(x3[:, :, 0], out_dtype, kernel=kernel).view(x.shape)
    block_m, block_n, looped, num_warps = _strided_config(n_inner, n_cols, kernel)
    launch(_softmax_fwd_strided_kernel, (n_outer * cdiv(n_inner, block_m),), x3, y3, n_inner, n_cols,
           *x3.stride(), *y3.stride(), BLOCK_M=block_m, BLOCK_N=block_n, LOOPED=looped, num_warps=num_warps)
    return y


def _strided_backward(grad: torch.Tensor, out: torch.Tensor, scale: float, grad_dtype: torch.dtype, dim: int,
                      kernel: str | None) -> torch.Tensor:
    dx = torch.empty_like(out, dtype=grad_dtype, memory_format=torch.contiguous_format)
    if dx.numel() == 0:
        return dx
    g3, y3, dx3 = _as_3d(grad, dim), _as_3d(out, dim), _as_3d(dx, dim)
    n_outer, n_cols, n_inner = y3.shape
    if n_inner == 1:
        return softmax_backward(g3[:, :, 0], y3[:, :, 0], scale, grad_dtype, kernel=kernel).view(out.shape)
    block_m, block_n, looped, num_warps = _strided_config(n_inner, n_cols, kernel)
    launch(_softmax_bwd_strided_kernel, (n_outer * cdiv(n_inner, block_m),), g3, y3, dx3, n_inner, n_cols,
           *g3.stride(), *y3.stride(), *dx3.stride(), float(scale), BLOCK_M=block_m, BLOCK_N=block_n,
           LOOPED=looped, SCALED=scale != 1.0, num_warps=num_warps)
    return dx
