"""Triton kernels for cross-entropy over (rows, classes) logits: class-index or class-probability targets,
optional per-class weights.

Notation per row: x the logits, C classes, L = logsumexp(x), p = softmax(x), e the label smoothing, z the
z-loss weight, w the class weights (all 1 without ``weight``), W = sum_c w_c.

Class-index target t (torch's formula for label smoothing with weights, LossNLL.cpp)::

    loss = (1 - e) w_t (L - x_t) + (e / C) sum_c w_c (L - x_c) + z w_t L^2       (0 where t == ignore_index)
    dloss / dx_j = (k + 2 z w_t L) p_j - (1 - e) w_t [j == t] - (e / C) w_j,     k = (1 - e) w_t + (e / C) W

Class-probability target q (rows of C floats), q' = (1 - e) q + e / C::

    loss = sum_c w_c q'_c (L - x_c) + z L^2
    dloss / dx_j = (S + 2 z L) p_j - w_j q'_j,   S = sum_c w_c q'_c;   dloss / dq_j = (1 - e) w_j (L - x_j)

"mean" divides by the sum of w_t over the non-ignored rows (their count without weights) for class indices,
by the number of rows for probabilities, as torch does.

Kernels, working on (BLOCK_M rows x BLOCK_N columns) tiles and looping over the columns, in fp32:

- ``_ce_fwd_kernel``: one pass over each row (and its target row). Online max / sum (the running sum is
  rescaled when the block max grows); the smoothing and probability sums are kept relative to the running max,
  and L is kept as an unevaluated sum hi + lo of two fp32 numbers (so L - x keeps fp32's relative precision
  even for logits of 1e4, as torch's log_softmax does). Writes the per-row loss and L (hi, lo), and where the
  backward needs it the per-row coefficient k (weights with smoothing) or S (probabilities): ``aux``.
- ``_ce_reduce_kernel``: one program: the sum of the row losses and the denominator of "mean", the mean or
  sum written in the output dtype (the reduction in one launch, deterministic).
- ``_ce_bwd_kernel``: one pass: reads the row (and target row) and the saved L (and aux), writes g_r * dloss/dx
  (g_r / denominator for "mean") and, when asked, g_r * dloss/dq. The output is a new tensor for
  ``fl.cross_entropy``; ``linear_cross_entropy`` writes it over its own logits chunk (``out=x``).

Each variant is a constexpr flag (``HAS_SMOOTHING``, ``HAS_Z``, ``HAS_WEIGHT``, ``SOFT``, ``TARGET_GRAD``,
``HAS_SCALE``, ``HAS_SOFTCAP``): the plain class-index case compiles to the same code as before weights and
probabilities existed.

Logit transform (``linear_cross_entropy``'s ``logit_scale`` and ``softcap``, as model heads that scale or
soft-cap their logits): the loss above is taken of z = scale * x, then z = softcap * tanh(z / softcap), applied
as each block is loaded; the gradient is that of z times dz/dx = scale sech^2(scale x / softcap).

Long rows (CUDA) run one row per program with (BLOCK_N, num_warps) autotuned once per size class and flags;
the choice is cached and later launches skip the autotuner. In-place launches never autotune (a tuning run
would read its own output): they use a cached choice or ``DEFAULT_LONG_ROW``.

Rows whose target is ``ignore_index`` are never read: loss 0, gradient 0. A class index outside [0, C) that is
not ``ignore_index`` is never used as an address: its loss and its gradient row are NaN (the CPU path
raises before any kernel runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedlayers.kernels import cdiv, launch, next_power_of_2

# Rows at least this long run one row per program with the column block autotuned (CUDA).
LONG_ROW = 4096
# (BLOCK_N, num_warps) candidates for long rows, forward and backward.
LONG_ROW_CONFIGS = [(2048, 4), (4096, 8), (8192, 8), (8192, 16), (16384, 16), (16384, 32), (32768, 32)]
# Untuned (BLOCK_N, num_warps) for long rows, by kernel: the autotuner's picks on an H200 for 32K-128K rows.
DEFAULT_LONG_ROW = {"fwd": (8192, 8), "bwd": (16384, 32)}
FLAGS = ("HAS_SMOOTHING", "HAS_Z", "HAS_WEIGHT", "SOFT", "TARGET_GRAD", "HAS_SCALE", "HAS_SOFTCAP")


# ----------------------------------------------------------------------------- shared pieces


@triton.jit
def _targets(t_ptr, rows, n_rows, n_cols, stride_t, ignore_index):
    """Targets of a block of rows (int64), which rows count (valid) and which targets are in [0, C)."""
    in_rows = rows < n_rows
    t = tl.load(t_ptr + rows.to(tl.int64) * stride_t, mask=in_rows, other=0).to(tl.int64)
    valid = in_rows & (t != ignore_index)
    in_range = (t >= 0) & (t < n_cols)
    return t, valid, in_range


@triton.jit
def _class_weight(w_ptr, t, valid, in_range, HAS_WEIGHT: tl.constexpr):
    """w[t] of each row (0 where not valid or out of range); 1.0 without weights."""
    if HAS_WEIGHT:
        w_t = tl.load(w_ptr + tl.where(in_range, t, 0), mask=valid & in_range, other=0.0).to(tl.float32)
    else:
        w_t = tl.full(t.shape, 1.0, tl.float32)
    return w_t


@triton.jit
def _transform(x, mask, scale, softcap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """The logits the loss sees (fp32), as the backward computes them: scale * x, then softcap * tanh(. / softcap);
    -inf where ``mask`` is off (scale > 0 keeps a masked -inf load at -inf; tanh would not)."""
    z, _ = _transform_with_slope(x, scale, softcap, HAS_SCALE, HAS_SOFTCAP)
    if HAS_SOFTCAP:
        z = tl.where(mask, z, float("-inf"))
    return z


@triton.jit
def _transform_with_slope(x, scale, softcap, HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr):
    """(z, dz/dx) at raw logits x, for the backward: with a soft-cap, tanh(v) and sech^2(v) (v = scale x / softcap)
    from one e = exp(-2 |v|) as (1 - e) / (1 + e) and 4 e / (1 + e)^2 -- no cancellation where tanh saturates (1 -
    tanh^2 would lose it all there) and two special-function operations an element where tanh then 1 - tanh^2 via a
    sigmoid take four (the soft-capped backward is bound by them)."""
    if HAS_SCALE:
        x = x * scale
    if HAS_SOFTCAP:
        e = tl.exp(-2.0 * tl.abs(x / softcap))
        r = 1.0 / (1.0 + e)
        c = (1.0 - e) * r
        z = softcap * tl.where(x < 0, -c, c)
        slope = 4.0 * e * r * r
        if HAS_SCALE:
            slope = slope * scale
    else:
        z = x
        slope = tl.full(x.shape, scale, tl.float32)
    return z, slope


@triton.jit
def _split_lse(m, s):
    """logsumexp = m + log(s) as hi + lo: hi its fp32 rounding, lo the rest (m - hi is exact), so that L - x and
    x - L keep fp32's precision relative to the result even where |L| is large. Rows that saw no finite value
    (m = -inf): hi = -inf, lo = 0."""
    log_s = tl.log(tl.maximum(s, 1e-30))  # s >= 1 for rows that saw a finite value (no log(0) warning)
    hi = m + log_s
    finite = m != float("-inf")
    lo = tl.where(finite, (tl.where(finite, m, 0.0) - tl.where(finite, hi, 0.0)) + log_s, 0.0)
    return hi, lo


@triton.jit
def _row_stats(x_ptr, w_ptr, rows64, active, n_cols, stride_xr, stride_xc, scale, softcap,
               HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_SCALE: tl.constexpr,
               HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """logsumexp L (hi, lo) of each active row, reading it once (online softmax); when smoothing, also
    sum_c w_c (L - x_c) and W = sum_c w_c (w = 1 without weights), the first kept relative to the running max."""
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    ref = tl.zeros((BLOCK_M,), tl.float32)  # the running max (0 while a row has seen no finite value)
    rel = tl.zeros((BLOCK_M,), tl.float32)  # sum_c w_c (x_c - ref)
    sum_w = tl.zeros((BLOCK_M,), tl.float32)
    base = x_ptr + rows64[:, None] * stride_xr
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_cols = cols < n_cols
        mask = active[:, None] & in_cols[None, :]
        x = tl.load(base + cols[None, :] * stride_xc, mask=mask, other=float("-inf")).to(tl.float32)
        x = _transform(x, mask, scale, softcap, HAS_SCALE, HAS_SOFTCAP)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows not (yet) seen: keep s = 0, no NaN
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
        m = m_new
        if HAS_SMOOTHING:
            wx = tl.where(mask, x - m_safe[:, None], 0.0)
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
                wx = w[None, :] * wx
                w_block = tl.sum(tl.where(mask, w[None, :], 0.0), axis=1)
            else:
                w_block = tl.sum(mask.to(tl.float32), axis=1)
            rel = rel + (ref - m_safe) * sum_w + tl.sum(wx, axis=1)
            sum_w += w_block
            ref = m_safe
    hi, lo = _split_lse(m, s)
    span = tl.where(m == float("-inf"), 0.0, (hi - ref) + lo)  # L - ref (rows that saw no finite value: 0)
    return hi, lo, span * sum_w - rel, sum_w


@triton.jit
def _soft_row_stats(x_ptr, t_ptr, w_ptr, rows64, active, n_cols, stride_xr, stride_xc, stride_tr, stride_tc,
                    smoothing, scale, softcap, HAS_SMOOTHING: tl.constexpr, HAS_WEIGHT: tl.constexpr,
                    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr):
    """Probability targets: L (hi, lo), sum_c w_c q'_c (L - x_c) (kept relative to the running max) and
    S = sum_c w_c q'_c."""
    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    s = tl.zeros((BLOCK_M,), tl.float32)
    ref = tl.zeros((BLOCK_M,), tl.float32)
    rel = tl.zeros((BLOCK_M,), tl.float32)
    sum_q = tl.zeros((BLOCK_M,), tl.float32)
    x_base = x_ptr + rows64[:, None] * stride_xr
    t_base = t_ptr + rows64[:, None] * stride_tr
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        in_cols = cols < n_cols
        mask = active[:, None] & in_cols[None, :]
        x = tl.load(x_base + cols[None, :] * stride_xc, mask=mask, other=float("-inf")).to(tl.float32)
        x = _transform(x, mask, scale, softcap, HAS_SCALE, HAS_SOFTCAP)
        q = tl.load(t_base + cols[None, :] * stride_tc, mask=mask, other=0.0).to(tl.float32)
        if HAS_SMOOTHING:
            q = q * (1.0 - smoothing) + smoothing / n_cols
        if HAS_WEIGHT:
            w = tl.load(w_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
            q = q * w[None, :]
        # also where q is the bare load (0 there already): Triton 3.6's TritonGPUOptimizeThreadLocality pass fails
        # to compile the loop when sum_q accumulates a reduction of the bare load (H100; reproduced locally)
        q = tl.where(mask, q, 0.0)
        m_new = tl.maximum(m, tl.max(x, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        s = s * tl.exp(m - m_safe) + tl.sum(tl.exp(x - m_safe[:, None]), axis=1)
        m = m_new
        rel = rel + (ref - m_safe) * sum_q + tl.sum(q * tl.where(mask, x - m_safe[:, None], 0.0), axis=1)
        sum_q += tl.sum(q, axis=1)
        ref = m_safe
    hi, lo = _split_lse(m, s)
    span = tl.where(m == float("-inf"), 0.0, (hi - ref) + lo)  # L - ref (rows that saw no finite value: 0)
    return hi, lo, span * sum_q - rel, sum_q


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _ce_fwd_kernel(
    x_ptr, t_ptr, w_ptr, loss_ptr, lse_ptr, aux_ptr, n_rows, n_cols, stride_xr, stride_xc, stride_tr, stride_tc,
    stride_lse, ignore_index, smoothing, z_loss, scale, softcap, cols_key, HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr, HAS_WEIGHT: tl.constexpr, SOFT: tl.constexpr, TARGET_GRAD: tl.constexpr,
    HAS_SCALE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    in_rows = rows < n_rows
    if SOFT:
        hi, lo, loss, sum_q = _soft_row_stats(x_ptr, t_ptr, w_ptr, rows64, in_rows, n_cols, stride_xr, stride_xc,
                                              stride_tr, stride_tc, smoothing, scale, softcap, HAS_SMOOTHING,
                                              HAS_WEIGHT, HAS_SCALE, HAS_SOFTCAP, BLOCK_M, BLOCK_N)
        if HAS_Z:
            loss += z_loss * (hi + lo) * (hi + lo)
        tl.store(aux_ptr + rows64, sum_q, mask=in_rows)
    else:
        t, valid, in_range = _targets(t_ptr, rows, n_rows, n_cols, stride_tr, ignore_index)
        hi, lo, smooth, sum_w = _row_stats(x_ptr, w_ptr, rows64, valid, n_cols, stride_xr, stride_xc, scale,
                                           softcap, HAS_SMOOTHING, HAS_WEIGHT, HAS_SCALE, HAS_SOFTCAP, BLOCK_M,
                                           BLOCK_N)
        hi = tl.where(valid, hi, 0.0)
        lo = tl.where(valid, lo, 0.0)
        w_t = _class_weight(w_ptr, t, valid, in_range, HAS_WEIGHT)
        x_t = tl.load(x_ptr + rows64 * stride_xr + tl.where(in_range, t, 0) * stride_xc,
                      mask=valid & in_range, other=0.0).to(tl.float32)
        x_t = _transform(x_t, valid & in_range, scale, softcap, HAS_SCALE, HAS_SOFTCAP)
        if HAS_WEIGHT:
            loss = (1.0 - smoothing) * w_t * ((hi - x_t) + lo)
        else:
            loss = (1.0 - smoothing) * ((hi - x_t) + lo)
        if HAS_SMOOTHING:
            loss += smoothing / n_cols * smooth
            if HAS_WEIGHT:  # the backward's coefficient of p: (1 - e) w_t + (e / C) W
                tl.store(aux_ptr + rows64, (1.0 - smoothing) * w_t + smoothing / n_cols * sum_w, mask=in_rows)
        if HAS_Z:
            loss += z_loss * w_t * (hi + lo) * (hi + lo)
        loss = tl.where(in_range, loss, float("nan"))
        loss = tl.where(valid, loss, 0.0)
    tl.store(loss_ptr + rows64, loss, mask=in_rows)
    tl.store(lse_ptr + rows64, hi, mask=in_rows)
    tl.store(lse_ptr + stride_lse + rows64, lo, mask=in_rows)


@triton.jit
def _ce_bwd_kernel(
    x_ptr, t_ptr, w_ptr, lse_ptr, aux_ptr, g_ptr, denom_ptr, dx_ptr, dt_ptr, n_rows, n_cols, stride_xr, stride_xc,
    stride_tr, stride_tc, stride_g, stride_dr, stride_dtr, stride_lse, ignore_index, smoothing, z_loss, scale,
    softcap, cols_key, MEAN: tl.constexpr, HAS_SMOOTHING: tl.constexpr, HAS_Z: tl.constexpr,
    HAS_WEIGHT: tl.constexpr, SOFT: tl.constexpr, TARGET_GRAD: tl.constexpr, HAS_SCALE: tl.constexpr,
    HAS_SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx = g_r * dloss_r/dx (and dq = g_r * dloss_r/dq for TARGET_GRAD), g_r = g[r * stride_g] (stride 0: one
    factor for all rows), / denominator if MEAN."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rows64 = rows.to(tl.int64)
    in_rows = rows < n_rows
    g = tl.load(g_ptr + rows64 * stride_g, mask=in_rows, other=0.0).to(tl.float32)
    if MEAN:
        g = g / tl.load(denom_ptr).to(tl.float32)
    x_base = x_ptr + rows64[:, None] * stride_xr
    dx_base = dx_ptr + rows64[:, None] * stride_dr
    if SOFT:
        hi = tl.load(lse_ptr + rows64, mask=in_rows, other=0.0)
        lo = tl.load(lse_ptr + stride_lse + rows64, mask=in_rows, other=0.0)
        sum_q = tl.load(aux_ptr + rows64, mask=in_rows, other=0.0)
        if HAS_Z:
            a = g * (sum_q + 2.0 * z_loss * (hi + lo))
        else:
            a = g * sum_q
        t_base = t_ptr + rows64[:, None] * stride_tr
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            in_cols = cols < n_cols
            mask = in_rows[:, None] & in_cols[None, :]
            x = tl.load(x_base + cols[None, :] * stride_xc, mask=mask, other=0.0).to(tl.float32)
            if HAS_SCALE or HAS_SOFTCAP:
                x, slope = _transform_with_slope(x, scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            q = tl.load(t_base + cols[None, :] * stride_tc, mask=mask, other=0.0).to(tl.float32)
            if HAS_SMOOTHING:
                q = q * (1.0 - smoothing) + smoothing / n_cols
            if HAS_WEIGHT:
                w = tl.load(w_ptr + cols, mask=in_cols, other=0.0).to(tl.float32)
                q = q * w[None, :]
            d = a[:, None] * tl.exp((x - hi[:, None]) - lo[:, None]) - g[:, None] * q
            if HAS_SCALE or HAS_SOFTCAP:
                d = d * slope
            tl.store(dx_base + cols[None, :], d.to(dx_ptr.dtype.element_ty), mask=mask)
            if TARGET_GRAD:
                dq = (g * (1.0 - smoothing))[:, None] * ((hi[:, None] - x) + lo[:, None])
                if HAS_WEIGHT:
                    dq = dq * w[None, :]
                tl.store(dt_ptr + rows64[:, None] * stride_dtr + cols[None, :], dq.to(dt_ptr.dtype.element_ty),
                         mask=mask)
    else:
        t, valid, in_range = _targets(t_ptr, rows, n_rows, n_cols, stride_tr, ignore_index)
        hi = tl.load(lse_ptr + rows64, mask=valid, other=0.0)
        lo = tl.load(lse_ptr + stride_lse + rows64, mask=valid, other=0.0)
        g = tl.where(in_range, g, float("nan"))
        w_t = _class_weight(w_ptr, t, valid, in_range, HAS_WEIGHT)
        if HAS_WEIGHT:
            if HAS_SMOOTHING:
                coef = tl.load(aux_ptr + rows64, mask=valid, other=0.0)
            else:
                coef = w_t
            c_target = g * (1.0 - smoothing) * w_t
        else:
            coef = 1.0
            c_target = g * (1.0 - smoothing)
        if HAS_Z:
            a = g * (coef + 2.0 * z_loss * w_t * (hi + lo))
        else:
            a = g * coef
        c_smooth = g * (smoothing / n_cols)
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            in_cols = cols[None, :] < n_cols
            x = tl.load(x_base + cols[None, :] * stride_xc, mask=valid[:, None] & in_cols, other=0.0).to(tl.float32)
            if HAS_SCALE or HAS_SOFTCAP:  # masked-off entries: any finite value (never stored)
                x, slope = _transform_with_slope(x, scale, softcap, HAS_SCALE, HAS_SOFTCAP)
            d = a[:, None] * tl.exp((x - hi[:, None]) - lo[:, None])
            if HAS_SMOOTHING:
                if HAS_WEIGHT:
                    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
                    d -= c_smooth[:, None] * w[None, :]
                else:
                    d -= c_smooth[:, None]
            d = tl.where(cols[None, :] == t[:, None], d - c_target[:, None], d)
            if HAS_SCALE or HAS_SOFTCAP:
                d = d * slope
            d = tl.where(valid[:, None], d, 0.0)
            tl.store(dx_base + cols[None, :], d.to(dx_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols)


@triton.jit
def _ce_reduce_kernel(loss_ptr, t_ptr, w_ptr, out_ptr, denom_ptr, n_rows, n_cols, stride_t, ignore_index,
                      MEAN: tl.constexpr, HAS_WEIGHT: tl.constexpr, SOFT: tl.constexpr, BLOCK: tl.constexpr):
    """out = sum(loss) (/ denominator for MEAN). denominator: the number of rows (SOFT), else the sum of w[t]
    over the rows whose target is not ignore_index (their number without weights), written as fp32. The row
    losses are summed in fp64 (N adds: free), so the sum costs no precision beyond the rows' own (as torch's
    CPU reductions, which accumulate fp32 in double)."""
    total = tl.zeros((BLOCK,), tl.float64)
    count = tl.zeros((BLOCK,), tl.int32)
    weight_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, n_rows, BLOCK):
        rows = start + tl.arange(0, BLOCK)
        inside = rows < n_rows
        total += tl.load(loss_ptr + rows, mask=inside, other=0.0).to(tl.float64)
        if SOFT:
            count += inside.to(tl.int32)
        else:
            t = tl.load(t_ptr + rows.to(tl.int64) * stride_t, mask=inside, other=0).to(tl.int64)
            valid = inside & (t != ignore_index)
            if HAS_WEIGHT:
                in_range = (t >= 0) & (t < n_cols)
                weight_sum += tl.load(w_ptr + tl.where(in_range, t, 0), mask=valid & in_range,
                                      other=0.0).to(tl.float32)
            else:
                count += valid.to(tl.int32)
    if HAS_WEIGHT and not SOFT:
        denom = tl.sum(weight_sum, axis=0)
    else:
        denom = tl.sum(count, axis=0).to(tl.float32)
    result = tl.sum(total, axis=0)
    if MEAN:
        result = result / denom.to(tl.float64)  # 0 / 0 = NaN when every row is ignored (or there are none), as torch
    tl.store(out_ptr, result.to(out_ptr.dtype.element_ty))
    tl.store(denom_ptr, denom)


# ----------------------------------------------------------------------------- configs


def _prune(configs, named_args, **kwargs):
    """Drop column blocks more than twice the row length (all the same once the row fits)."""
    n_cols = named_args["cols_key"]
    kept = [c for c in configs if c.kwargs["BLOCK_N"] <= max(2048, 2 * next_power_of_2(n_cols))]
    return kept or configs[:1]


def _autotuned(kernel):
    configs = [triton.Config({"BLOCK_M": 1, "BLOCK_N": n}, num_warps=w) for n, w in LONG_ROW_CONFIGS]
    # cols_key: the row length rounded up to a power of two (one tuning per size class, not per length)
    return triton.autotune(configs, key=["cols_key", *FLAGS], prune_configs_by={"early_config_prune": _prune})(kernel)


_KERNELS = {"fwd": (_ce_fwd_kernel, _autotuned(_ce_fwd_kernel)), "bwd": (_ce_bwd_kernel, _autotuned(_ce_bwd_kernel))}
_tuned_configs: dict[tuple, tuple[int, int]] = {}  # (kernel, cols_key, dtype, device, flags) -> (BLOCK_N, warps)


def _short_row_config(n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): several rows per program, ~4K elements per tile."""
    block_n = min(next_power_of_2(max(n_cols, 1)), LONG_ROW)
    block_m = max(1, min(16, 4096 // block_n))
    elements = block_m * block_n
    return block_m, block_n, 4 if elements <= 2048 else 8


def _launch(name: str, x: torch.Tensor, args: tuple, consts: dict, may_tune: bool = True) -> None:
    kernel, tuned = _KERNELS[name]
    n_rows, n_cols = x.shape
    if n_cols < LONG_ROW or x.device.type != "cuda":
        block_m, block_n, num_warps = _short_row_config(n_cols)
        launch(kernel, (cdiv(n_rows, block_m),), *args, **consts, BLOCK_M=block_m, BLOCK_N=block_n,
               num_warps=num_warps)
        return
    key = (name, next_power_of_2(n_cols), x.dtype, x.device, tuple(consts.get(f) for f in FLAGS))
    config = _tuned_configs.get(key)
    if config is None and may_tune:
        tuned[(n_rows,)](*args, **consts)
        best = getattr(tuned, "best_config", None)
        if best is not None:
            _tuned_configs[key] = (best.kwargs["BLOCK_N"], best.num_warps)
        return
    block_n, num_warps = config or DEFAULT_LONG_ROW[name]
    launch(kernel, (n_rows,), *args, **consts, BLOCK_M=1, BLOCK_N=min(block_n, next_power_of_2(n_cols)),
           num_warps=num_warps)


def needs_aux(soft: bool, has_weight: bool, smoothing: float) -> bool:
    """Whether the forward writes a per-row coefficient the backward reads (S, or k with weights and smoothing)."""
    return soft or (has_weight and smoothing != 0.0)


def _consts(smoothing: float, z_loss: float, weight, soft: bool, target_grad: bool, scale: float,
            softcap: float | None) -> dict:
    return dict(HAS_SMOOTHING=smoothing != 0.0, HAS_Z=z_loss != 0.0, HAS_WEIGHT=weight is not None, SOFT=soft,
                TARGET_GRAD=target_grad, HAS_SCALE=scale != 1.0, HAS_SOFTCAP=softcap is not None)


def _target_strides(target: torch.Tensor) -> tuple[int, int]:
    if target.dim() == 2:
        return target.stride(0), target.stride(1)
    return (target.stride(0) if target.numel() else 1), 0


# ----------------------------------------------------------------------------- launchers


def cross_entropy_forward(
    x: torch.Tensor, target: torch.Tensor, ignore_index: int, smoothing: float, z_loss: float,
    loss: torch.Tensor | None = None, lse: torch.Tensor | None = None, *, weight: torch.Tensor | None = None,
    aux: torch.Tensor | None = None, scale: float = 1.0, softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Per-row loss (fp32, (rows,)), logsumexp (fp32, (2, rows): hi and lo, the value is hi + lo) and aux (fp32,
    (rows,); None where the backward needs none) of 2-D logits ``x`` (any strides) and ``target``: 1-D class
    indices or 2-D (rows, C) probabilities (any strides).

    ``weight``: None or contiguous fp32 (C,) class weights. ``loss``/``lse``/``aux``: optional fp32 outputs to
    write into (unit stride along the rows). ``scale`` (> 0), ``softcap`` (None or > 0): the logit transform
    (see the module's docstring).
    """
    n_rows, n_cols = x.shape
    soft = target.is_floating_point()
    new = lambda: torch.empty(n_rows, dtype=torch.float32, device=x.device)  # noqa: E731
    loss = new() if loss is None else loss
    lse = torch.empty(2, n_rows, dtype=torch.float32, device=x.device) if lse is None else lse
    if needs_aux(soft, weight is not None, smoothing):
        aux = new() if aux is None else aux
    else:
        aux = None
    if n_rows == 0:
        return loss, lse, aux
    stride_tr, stride_tc = _target_strides(target)
    args = (x, target, weight if weight is not None else loss, loss, lse, aux if aux is not None else loss, n_rows,
            n_cols, x.stride(0), x.stride(1), stride_tr, stride_tc, lse.stride(0), ignore_index, float(smoothing),
            float(z_loss), float(scale), float(softcap or 1.0), next_power_of_2(n_cols))
    _launch("fwd", x, args, _consts(smoothing, z_loss, weight, soft, False, scale, softcap))
    return loss, lse, aux


def cross_entropy_reduce(loss_rows: torch.Tensor, target: torch.Tensor, ignore_index: int, mean: bool,
                         out_dtype: torch.dtype, *, weight: torch.Tensor | None = None
                         ) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum or mean of the fp32 row losses as a 0-d ``out_dtype`` tensor, the 0-d fp32 denominator of "mean":
    the number of rows for probability targets, else the sum of weight[t] (the count without weights) over the
    rows whose target is not ignore_index)."""
    out = torch.empty((), dtype=out_dtype, device=loss_rows.device)
    denom = torch.empty((), dtype=torch.float32, device=loss_rows.device)
    n_rows = loss_rows.shape[0]
    soft = target.is_floating_point()
    block = min(4096, max(128, next_power_of_2(max(n_rows, 1))))
    launch(_ce_reduce_kernel, (1,), loss_rows, target, weight if weight is not None else loss_rows, out, denom, n_rows,
           weight.numel() if weight is not None else 0, target.stride(0) if n_rows else 1, ignore_index, MEAN=mean,
           HAS_WEIGHT=weight is not None, SOFT=soft, BLOCK=block, num_warps=4 if block <= 1024 else 8)
    return out, denom


def cross_entropy_backward(
    grad: torch.Tensor, x: torch.Tensor, target: torch.Tensor, lse: torch.Tensor, ignore_index: int,
    smoothing: float, z_loss: float, out: torch.Tensor, denom: torch.Tensor | None = None, *,
    weight: torch.Tensor | None = None, aux: torch.Tensor | None = None, grad_target: torch.Tensor | None = None,
    scale: float = 1.0, softcap: float | None = None,
) -> torch.Tensor:
    """Write g_r * d loss_r / d x into ``out`` (2-D, unit column stride) and return it. ``out`` may be ``x``
    itself when the caller owns ``x`` (each element is read before it is written, by the same program).

    ``grad``: 0-d (one factor for every row) or (rows,); divided by ``denom`` (0-d) when given ("mean").
    ``lse`` ((2, rows)), ``aux``: from the forward. ``grad_target``: for probability targets, also write
    g_r * d loss_r / d q into it (2-D, unit column stride).
    """
    n_rows, n_cols = x.shape
    if n_rows == 0 or n_cols == 0:
        return out
    assert out.stride(1) == 1 and out.shape == x.shape
    soft = target.is_floating_point()
    if grad_target is not None:
        assert soft and grad_target.stride(1) == 1 and grad_target.shape == x.shape
    stride_g = 0 if grad.dim() == 0 else grad.stride(0)
    stride_tr, stride_tc = _target_strides(target)
    in_place = out.data_ptr() == x.data_ptr()
    args = (x, target, weight if weight is not None else grad, lse, aux if aux is not None else grad, grad,
            denom if denom is not None else grad, out, grad_target if grad_target is not None else out, n_rows,
            n_cols, x.stride(0), x.stride(1), stride_tr, stride_tc, stride_g, out.stride(0),
            grad_target.stride(0) if grad_target is not None else 0, lse.stride(0), ignore_index, float(smoothing),
            float(z_loss), float(scale), float(softcap or 1.0), next_power_of_2(n_cols))
    consts = dict(MEAN=denom is not None, **_consts(smoothing, z_loss, weight, soft, grad_target is not None, scale,
                                                    softcap))
    _launch("bwd", x, args, consts, may_tune=not in_place)
    return out
