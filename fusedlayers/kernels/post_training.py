"""Triton row kernel of the generalized Jensen-Shannon divergence between a student's and a teacher's logits
(``fusedlayers.post_training.linear_generalized_jsd_loss``).

Per row, with s and t the student's and teacher's logits divided by the temperature, log-softmaxes ls and lt,
probabilities ps and pt, and the mixture M = (1 - beta) ps + beta pt (log lm)::

    beta = 0:  J = KL(pt || ps) = sum pt (lt - ls)                 dJ/ds_j = ps_j - pt_j
    beta = 1:  J = KL(ps || pt) = sum ps (ls - lt)                 dJ/ds_j = ps_j ((ls_j - lt_j) - J)
    else:      J = beta KL(pt || M) + (1 - beta) KL(ps || M)       dJ/ds_j = (1 - beta) ps_j (r_j - R),
               r = ls - lm, R = sum ps r = KL(ps || M)

(the derivative of J in ps_k is (1 - beta) r_k: the mixture's terms cancel), as TRL's ``generalized_jsd_loss``.
Each head's logits x may be transformed first, as the model that owns it does (``_transform_with_slope``: a scale,
a soft-cap; the student's gradient then times dz/dx). One program per row, three passes: the two logsumexps
(online), then J (and R), then dJ/d(student logits) times the row's factor over the student's chunk (our own
buffer). The teacher is only read.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from fusedlayers.kernels import INTERPRETED, launch, next_power_of_2
from fusedlayers.kernels.cross_entropy import _transform_with_slope

BLOCK = 4096


@triton.jit
def _load(x_ptr, cols, mask, inv_t, scale, cap, HAS_SCALE: tl.constexpr, HAS_CAP: tl.constexpr):
    """A block of a row's logits, transformed and / temperature, with the transform's slope dz/dx."""
    x = tl.load(x_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    slope = tl.full(x.shape, 1.0, tl.float32)  # unused (and dropped by the compiler) without a transform
    if HAS_SCALE or HAS_CAP:
        x, slope = _transform_with_slope(x, scale, cap, HAS_SCALE, HAS_CAP)
    return x * inv_t, slope


@triton.jit
def _lse(x_ptr, n_cols, inv_t, scale, cap, HAS_SCALE: tl.constexpr, HAS_CAP: tl.constexpr, BLOCK_N: tl.constexpr):
    """logsumexp of a row (transformed) / temperature as (max, log sum)."""
    m = -float("inf")
    s = 0.0
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        z, _ = _load(x_ptr, cols, mask, inv_t, scale, cap, HAS_SCALE, HAS_CAP)
        z = tl.where(mask, z, -float("inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    return m, tl.log(s)


@triton.jit
def _log_mixture(ls, lt, log_beta, log_1m_beta):
    """log((1 - beta) ps + beta pt) from the log-probabilities, as hi + log(1 + exp(lo - hi)). On the GPU the log of
    that sum in [1, 2] is the hardware's lg2.approx (absolute error ~1e-7 there): libdevice's accurate logf cost a
    quarter of the row kernel's time (1.31 against 1.01 ms a 1792 x 128256 bf16 chunk, H200)."""
    a = log_1m_beta + ls
    b = log_beta + lt
    hi = tl.maximum(a, b)
    x = 1.0 + tl.exp(tl.minimum(a, b) - hi)
    if INTERPRETED:  # the interpreter has no libdevice
        return hi + tl.log(x)
    return hi + libdevice.fast_logf(x)


@triton.jit
def _jsd_kernel(s_ptr, t_ptr, loss_ptr, n_cols, stride_s, stride_t, inv_t, beta, log_beta, log_1m_beta, grad_scale,
                s_scale, s_cap, t_scale, t_cap, MODE: tl.constexpr, S_SCALE: tl.constexpr, S_CAP: tl.constexpr,
                T_SCALE: tl.constexpr, T_CAP: tl.constexpr, BLOCK_N: tl.constexpr):
    """MODE 0: beta = 0, 1: beta = 1, 2: in between. Writes the row's J and g dJ/ds over the student row."""
    row = tl.program_id(0).to(tl.int64)
    s_row = s_ptr + row * stride_s
    t_row = t_ptr + row * stride_t
    ms, log_ss = _lse(s_row, n_cols, inv_t, s_scale, s_cap, S_SCALE, S_CAP, BLOCK_N)
    mt, log_st = _lse(t_row, n_cols, inv_t, t_scale, t_cap, T_SCALE, T_CAP, BLOCK_N)
    total = 0.0
    kl_s = 0.0  # R (mode 2) or J (mode 1)
    if MODE != 0:
        for start in range(0, n_cols, BLOCK_N):
            cols = start + tl.arange(0, BLOCK_N)
            mask = cols < n_cols
            zs, _ = _load(s_row, cols, mask, inv_t, s_scale, s_cap, S_SCALE, S_CAP)
            zt, _ = _load(t_row, cols, mask, inv_t, t_scale, t_cap, T_SCALE, T_CAP)
            ls = (zs - ms) - log_ss
            lt = (zt - mt) - log_st
            ps = tl.where(mask, tl.exp(ls), 0.0)
            if MODE == 1:
                kl_s += tl.sum(ps * (ls - lt), axis=0)
            else:
                lm = _log_mixture(ls, lt, log_beta, log_1m_beta)
                pt = tl.where(mask, tl.exp(lt), 0.0)
                kl_s += tl.sum(ps * (ls - lm), axis=0)
                total += tl.sum(pt * (lt - lm), axis=0)
    g = grad_scale * inv_t
    for start in range(0, n_cols, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        mask = cols < n_cols
        zs, slope = _load(s_row, cols, mask, inv_t, s_scale, s_cap, S_SCALE, S_CAP)
        zt, _ = _load(t_row, cols, mask, inv_t, t_scale, t_cap, T_SCALE, T_CAP)
        ls = (zs - ms) - log_ss
        lt = (zt - mt) - log_st
        ps = tl.exp(ls)
        if MODE == 0:
            pt = tl.exp(lt)
            total += tl.sum(tl.where(mask, pt * (lt - ls), 0.0), axis=0)
            d = ps - pt
        elif MODE == 1:
            d = ps * ((ls - lt) - kl_s)
        else:
            lm = _log_mixture(ls, lt, log_beta, log_1m_beta)
            d = (1.0 - beta) * ps * ((ls - lm) - kl_s)
        if S_SCALE or S_CAP:
            d = d * slope
        tl.store(s_row + cols, (d * g).to(s_ptr.dtype.element_ty), mask=mask)
    if MODE == 1:
        total = kl_s
    elif MODE == 2:
        total = beta * total + (1.0 - beta) * kl_s
    tl.store(loss_ptr + row, total)


def jsd_rows_(student: torch.Tensor, teacher: torch.Tensor, beta: float, temperature: float, grad_scale: float,
              loss: torch.Tensor, student_transform=(1.0, None), teacher_transform=(1.0, None)) -> None:
    """Per row of the (rows, V) chunks: J into ``loss`` (fp32) and ``grad_scale`` dJ/d(student logits) written over
    ``student``; each head's logits first through its (logit_scale, softcap)."""
    n_rows, n_cols = student.shape
    if n_rows == 0:
        return
    assert student.stride(1) == 1 and teacher.stride(1) == 1
    mode = 0 if beta == 0 else 1 if beta == 1 else 2
    block = min(BLOCK, next_power_of_2(n_cols))
    launch(_jsd_kernel, (n_rows,), student, teacher, loss, n_cols, student.stride(0), teacher.stride(0),
           1.0 / temperature, float(beta), math.log(beta) if mode == 2 else 0.0,
           math.log1p(-beta) if mode == 2 else 0.0, float(grad_scale), float(student_transform[0]),
           float(student_transform[1] or 1.0), float(teacher_transform[0]), float(teacher_transform[1] or 1.0),
           MODE=mode, S_SCALE=student_transform[0] != 1.0, S_CAP=student_transform[1] is not None,
           T_SCALE=teacher_transform[0] != 1.0, T_CAP=teacher_transform[1] is not None, BLOCK_N=block,
           num_warps=8 if block >= 2048 else 4)
