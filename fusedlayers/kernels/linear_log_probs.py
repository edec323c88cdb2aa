"""Triton kernels for per-token log-probabilities over a chunk of logits rows (``fusedlayers.ops.linear_log_probs``).

Per row, with x the logits, t the target, z = transform(x) (``z = scale * x``; ``z = softcap * tanh(z / softcap)``
with a soft-cap; then ``z = z / temperature``), L = logsumexp(z), p = softmax(z)::

    log_prob = z_t - L                       H (entropy) = -sum_j p_j (z_j - L) = L - sum_j p_j z_j
    d log_prob / dz_j = [j == t] - p_j       dH / dz_j = -p_j (z_j - L + H)

so for upstream gradients g (of log_prob) and h (of H)::

    dz_j = g [j == t] - p_j (g + h (z_j - L + H)),    dx_j = dz_j * dz/dx_j

Kernels:

- ``_log_probs_fwd_kernel``: one program per row, one pass over it (online max and sums, rescaled when the max
  grows): L as m + log(s) (kept as the pair, so z - L keeps fp32's precision for large logits), z_t, and with
  ``ENTROPY`` the sum of e^(z - m) (z - m), giving H = log(s) - a / s. With ``STATS`` (TRL's logged extras) also the
  mean of z, log(sum_j p_j^2) and whether the target is the first maximum (argmax).
- ``_log_probs_bwd_kernel``: (row, column block) programs; reads the chunk and the saved (m, log s, H) and writes
  dx over the chunk itself (our own logits buffer).

Rows whose target is ``ignore_index`` are never read: log-prob, entropy and statistics 0, gradient 0. A target
outside [0, V) that is not ``ignore_index`` is never used as an address: its log-prob and gradient row are NaN (the
CPU path raises before any kernel runs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedlayers.kernels import cdiv, launch, next_power_of_2

FWD_BLOCK = 4096
BWD_BLOCK = 4096


@triton.jit
def _transform(x, scale, softcap, inv_t, HAS_SOFTCAP: tl.constexpr):
    """z of raw logits x (fp32), and dz/dx."""
    u = x * scale
    if HAS_SOFTCAP:
        # tanh(v) and sech^2(v) from e = exp(-2 |v|): 1 - tanh^2 would cancel to nothing where tanh saturates
        v = u / softcap
        e = tl.exp(-2.0 * tl.abs(v))
        c = (1.0 - e) / (1.0 + e)
        c = tl.where(v < 0, -c, c)
        return softcap * c * inv_t, scale * inv_t * 4.0 * e / ((1.0 + e) * (1.0 + e))
    return u * inv_t, scale * inv_t + 0.0 * u


@triton.jit
def _log_probs_fwd_kernel(
    x_ptr, t_ptr, lp_ptr, ent_ptr, lse_ptr, stats_ptr, n_cols, stride_x, stride_lse, stride_stats, ignore_index,
    scale, softcap, inv_t, HAS_SOFTCAP: tl.constexpr, ENTROPY: tl.constexpr, STATS: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    t = tl.load(t_ptr + row).to(tl.int64)
    if t == ignore_index:  # never read: zeros everywhere
        tl.store(lp_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        tl.store(lse_ptr + stride_lse + row, 0.0)
        if ENTROPY:
            tl.store(ent_ptr + row, 0.0)
        if STATS:
            tl.store(stats_ptr + row, 0.0)
            tl.store(stats_ptr + stride_stats + row, 0.0)
            tl.store(stats_ptr + 2 * stride_stats + row, 0.0)
        return
    in_range = (t >= 0) & (t < n_cols)
    base = x_ptr + row * stride_x
    m = -float("inf")
    s = 0.0
    a = 0.0  # sum e^(z - m) (z - m)
    q = 0.0  # sum e^(2 (z - m))
    z_sum = 0.0
    before = -float("inf")  # the max of z over the columns before t
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
        z, _ = _transform(x, scale, softcap, inv_t, HAS_SOFTCAP)
        z = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        m_safe = tl.where(m_new == -float("inf"), 0.0, m_new)
        alpha = tl.exp(m - m_safe)
        e = tl.exp(z - m_safe)
        if ENTROPY:
            d = tl.where(e > 0.0, z - m_safe, 0.0)
            a = alpha * (a + tl.where(s > 0.0, m - m_safe, 0.0) * s) + tl.sum(e * d, axis=0)
        if STATS:
            q = alpha * alpha * q + tl.sum(e * e, axis=0)
            z_sum += tl.sum(tl.where(mask, z, 0.0), axis=0)
            before = tl.maximum(before, tl.max(tl.where(cols < t, z, -float("inf")), axis=0))
        s = alpha * s + tl.sum(e, axis=0)
        m = m_new
    x_t = tl.load(base + tl.where(in_range, t, 0)).to(tl.float32)
    z_t, _ = _transform(x_t, scale, softcap, inv_t, HAS_SOFTCAP)
    log_s = tl.log(s)
    lp = tl.where(in_range, (z_t - m) - log_s, float("nan"))
    tl.store(lp_ptr + row, lp)
    tl.store(lse_ptr + row, m)
    tl.store(lse_ptr + stride_lse + row, log_s)
    if ENTROPY:
        tl.store(ent_ptr + row, log_s - a / s)
    if STATS:
        tl.store(stats_ptr + row, z_sum / n_cols)
        tl.store(stats_ptr + stride_stats + row, tl.log(q) - 2.0 * log_s)
        tl.store(stats_ptr + 2 * stride_stats + row, ((z_t >= m) & (z_t > before)).to(tl.float32))


@triton.jit
def _log_probs_bwd_kernel(
    x_ptr, t_ptr, lse_ptr, ent_ptr, g_ptr, h_ptr, n_cols, stride_x, stride_lse, ignore_index, scale, softcap, inv_t,
    HAS_SOFTCAP: tl.constexpr, HAS_G: tl.constexpr, HAS_H: tl.constexpr, BLOCK_N: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_cols
    ptrs = x_ptr + row * stride_x + cols
    t = tl.load(t_ptr + row).to(tl.int64)
    if t == ignore_index:
        tl.store(ptrs, tl.zeros((BLOCK_N,), tl.float32).to(x_ptr.dtype.element_ty), mask=mask)
        return
    m = tl.load(lse_ptr + row)
    log_s = tl.load(lse_ptr + stride_lse + row)
    x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
    z, dz_dx = _transform(x, scale, softcap, inv_t, HAS_SOFTCAP)
    rel = (z - m) - log_s  # log p
    p = tl.exp(rel)
    g = 0.0
    if HAS_G:
        g = tl.load(g_ptr + row)
    coef = tl.zeros((BLOCK_N,), tl.float32) + g
    if HAS_H:
        h = tl.load(h_ptr + row)
        coef += h * (rel + tl.load(ent_ptr + row))
    dz = tl.where(cols == t, g, 0.0) - p * coef
    in_range = (t >= 0) & (t < n_cols)
    dx = tl.where(in_range, dz * dz_dx, float("nan"))
    tl.store(ptrs, dx.to(x_ptr.dtype.element_ty), mask=mask)


def _transform_args(scale: float, softcap: float | None, temperature: float) -> dict:
    return dict(scale=float(scale), softcap=float(softcap or 1.0), inv_t=1.0 / float(temperature),
                HAS_SOFTCAP=softcap is not None)


def log_probs_forward(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, scale: float,
                      softcap: float | None, temperature: float, lp: torch.Tensor, lse: torch.Tensor,
                      entropy: torch.Tensor | None, stats: torch.Tensor | None) -> None:
    """Per row of ``logits`` (rows, V), unit column stride: log-prob into ``lp`` (rows,), (m, log s) into ``lse``
    (2, rows), the entropy into ``entropy`` and (mean z, log sum p^2, is-top-1) into ``stats`` (3, rows) when
    given. fp32 outputs."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    assert logits.stride(1) == 1
    block = min(FWD_BLOCK, next_power_of_2(n_cols))
    launch(_log_probs_fwd_kernel, (n_rows,), logits, target, lp, entropy if entropy is not None else lp, lse,
           stats if stats is not None else lse, n_cols, logits.stride(0), lse.stride(0),
           stats.stride(0) if stats is not None else 0, ignore_index,
           **_transform_args(scale, softcap, temperature), ENTROPY=entropy is not None, STATS=stats is not None,
           BLOCK_N=block, num_warps=8 if block >= 2048 else 4)


def log_probs_backward_(logits: torch.Tensor, target: torch.Tensor, ignore_index: int, scale: float,
                        softcap: float | None, temperature: float, lse: torch.Tensor, entropy: torch.Tensor | None,
                        grad_log_probs: torch.Tensor | None, grad_entropy: torch.Tensor | None) -> None:
    """dloss/dlogits written over ``logits`` for per-row upstream gradients (fp32, or None for none)."""
    n_rows, n_cols = logits.shape
    if n_rows == 0:
        return
    assert logits.stride(1) == 1
    block = min(BWD_BLOCK, next_power_of_2(n_cols))
    has_h = grad_entropy is not None
    launch(_log_probs_bwd_kernel, (n_rows, cdiv(n_cols, block)), logits, target, lse,
           entropy if has_h else lse, grad_log_probs if grad_log_probs is not None else lse,
           grad_entropy if has_h else lse, n_cols, logits.stride(0), lse.stride(0), ignore_index,
           **_transform_args(scale, softcap, temperature), HAS_G=grad_log_probs is not None, HAS_H=has_h,
           BLOCK_N=block, num_warps=8 if block >= 2048 else 4)
