"""Triton kernels for fake quantization: static qparams (per tensor / channel / group), LSQ backward,
and dynamic per-row qparams (per token, or per channel / group of a weight) computed in the kernel.

Every kernel sees its input as a contiguous 2-D (M, N) view; the quantization parameters are indexed
one of three ways (``QP_MODE``):

- 0, per tensor: one scale and zero point.
- 1, per row: row r uses qparams[r % C] (per channel with elements after the axis: M = outer * C rows of
  N = inner elements; per group: M groups of N = group_size elements, C = M).
- 2, per column: column c uses qparams[c] (per channel along the last dim: M = outer rows of N = C).

All math is fp32 with IEEE rounding, as torch's kernels: ``inv = 1 / scale`` (correctly rounded,
``div_rn``), ``q = round_half_even(x * inv) + zero_point``, clipped to [quant_min, quant_max], and
``(q - zero_point) * scale`` rounded once to fp32 and then to the output dtype. ``ROUND_MODE`` says where
the zero point enters the rounding, because torch's own kernels differ by op and device:

- 0: ``rint(x * inv) + z`` (torch's forward kernels, per tensor and per channel, CPU and CUDA; torch's LSQ
  backward on CUDA; torchao's per group / per token).
- 1: ``rint(fma(x, inv, z))`` (torch's LSQ backward on CPU, AVX2 / AVX512 kernels).
- 2: ``rint((x * inv) + z)``, two roundings (torch's LSQ backward on CPU, its default kernel).

``ZP_MODE`` says how the kernel turns the zero point it loads into the one it uses: 0 as is (an integer
zero point), 1 ``clamp(rint(z))`` (a floating one, in the forward and the per-channel LSQ backward), 2
``trunc(clamp(z + 0.5))`` (torch's per-tensor LSQ backward) -- in the kernel, so that no small torch op runs
per call.

The forward kernels also write the straight-through mask bit-packed (``quant_min <= q <= quant_max``, one
bit per element: row r of the (M, N) view takes ``cdiv(N, 8)`` bytes, bit k of byte j is column
``8 * j + k``), so that the backward reads 1/8 byte per element instead of recomputing it from x (4 bytes).

The kernels are launched with ``enable_fp_fusion=False`` so that no multiply-add is contracted behind
our back (that would change which way a value next to .5 rounds). NaN inputs quantize to quant_min with
a zero mask (as torch's per-tensor CPU kernel); +-inf clip to the range ends.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl

from fusedlayers.kernels import cdiv, launch, next_power_of_2

PER_TENSOR, PER_ROW, PER_COL = 0, 1, 2
ROUND_AFTER, ROUND_FMA, ROUND_INSIDE = 0, 1, 2

# Elements per program of the elementwise kernels (memory bound: big enough to hide latency).
TILE_ELEMENTS = 4096
# Rows up to this long run the one-pass dynamic kernel (whole row in registers); longer rows loop.
MAX_ONE_PASS_COLS = 16384
LOOP_BLOCK_N = 4096


@triton.jit
def _rint(y):
    """Round half to even for fp32, exact at every magnitude: below 2**23 adding and subtracting 2**23
    rounds |y| to an integer (ties to even); at 2**23 and above every fp32 is an integer already."""
    a = tl.abs(y)
    t = (a + 8388608.0) - 8388608.0
    return tl.where(a < 8388608.0, tl.where(y < 0, -t, t), y)


@triton.jit
def _quantize(x, inv, z, qmin, qmax, ROUND_MODE: tl.constexpr):
    """(q unclipped, q clipped, in-range mask), all fp32; NaN becomes -inf (so quant_min, mask 0)."""
    if ROUND_MODE == 0:
        q = _rint(x * inv) + z
    elif ROUND_MODE == 1:
        q = _rint(tl.fma(x, tl.broadcast_to(inv, x.shape), tl.broadcast_to(z, x.shape)))
    else:
        q = _rint(x * inv + z)
    q = tl.where(q == q, q, float("-inf"))
    keep = (q >= qmin) & (q <= qmax)
    qc = tl.minimum(tl.maximum(q, qmin), qmax)
    return q, qc, keep


@triton.jit
def _zero_point(z, qmin, qmax, ZP_MODE: tl.constexpr):
    """The zero point the math uses, from the one loaded (see ZP_MODE in the module docstring)."""
    if ZP_MODE == 1:
        z = tl.minimum(tl.maximum(_rint(z), qmin), qmax)
    elif ZP_MODE == 2:
        z = tl.minimum(tl.maximum(z + 0.5, qmin), qmax)
        z = tl.where(z < 0, -tl.floor(-z), tl.floor(z))  # trunc
    return z


@triton.jit
def _load_qparams(s_ptr, z_ptr, rows, cols, M, N, C, qmin, qmax, QP_MODE: tl.constexpr, ZP_MODE: tl.constexpr):
    """scale, 1 / scale and zero point, shaped to broadcast against a (rows, cols) tile."""
    if QP_MODE == 0:
        s = tl.load(s_ptr).to(tl.float32)
        z = tl.load(z_ptr).to(tl.float32)
    elif QP_MODE == 1:
        ch = rows % C
        s = tl.load(s_ptr + ch, mask=rows < M, other=1.0).to(tl.float32)[:, None]
        z = tl.load(z_ptr + ch, mask=rows < M, other=0.0).to(tl.float32)[:, None]
    else:
        s = tl.load(s_ptr + cols, mask=cols < N, other=1.0).to(tl.float32)[None, :]
        z = tl.load(z_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    return s, inv, _zero_point(z, qmin, qmax, ZP_MODE)


@triton.jit
def _store_mask(mask_ptr, keep, inside, rows, col0, M, row_bytes, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Pack a (BLOCK_M, BLOCK_N) keep tile of columns col0... (both multiples of 8) 8 columns a byte."""
    bits = (keep & inside).to(tl.int32).reshape(BLOCK_M, BLOCK_N // 8, 8)
    byte = tl.sum(bits << tl.arange(0, 8)[None, None, :], axis=2).to(tl.uint8)
    byte_cols = col0 // 8 + tl.arange(0, BLOCK_N // 8)
    offs = rows[:, None].to(tl.int64) * row_bytes + byte_cols[None, :]
    tl.store(mask_ptr + offs, byte, mask=(rows[:, None] < M) & (byte_cols[None, :] < row_bytes))


@triton.jit
def _load_mask(mask_ptr, inside, rows, cols, row_bytes):
    """The mask bits of a (rows, cols) tile (0 outside it), as fp32."""
    byte = tl.load(mask_ptr + rows[:, None].to(tl.int64) * row_bytes + cols[None, :] // 8, mask=inside, other=0)
    return ((byte.to(tl.int32) >> (cols[None, :] % 8).to(tl.int32)) & 1).to(tl.float32)


@triton.jit
def _tile(M, N, grid_n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    pid_m = pid // grid_n
    pid_n = pid % grid_n
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    return pid, pid_m, pid_n, rows, cols, inside, offs


@triton.jit
def _fq_fwd_kernel(
    x_ptr, y_ptr, mask_ptr, s_ptr, z_ptr, M, N, C, grid_n, row_bytes, qmin, qmax,
    QP_MODE: tl.constexpr, ZP_MODE: tl.constexpr, ROUND_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """y = fake_quant(x) and the packed mask: reads x once, writes y and 1/8 byte per element."""
    pid, pid_m, pid_n, rows, cols, inside, offs = _tile(M, N, grid_n, BLOCK_M, BLOCK_N)
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    s, inv, z = _load_qparams(s_ptr, z_ptr, rows, cols, M, N, C, qmin, qmax, QP_MODE, ZP_MODE)
    q, qc, keep = _quantize(x, inv, z, qmin, qmax, ROUND_MODE)
    y = (qc - z) * s
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)
    _store_mask(mask_ptr, keep, inside, rows, pid_n.to(tl.int64) * BLOCK_N, M, row_bytes, BLOCK_M, BLOCK_N)


@triton.jit
def _fq_ste_bwd_kernel(
    g_ptr, mask_ptr, dx_ptr, M, N, grid_n, row_bytes, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """dx = g * mask (straight-through estimator with the clipping mask the forward packed)."""
    pid, pid_m, pid_n, rows, cols, inside, offs = _tile(M, N, grid_n, BLOCK_M, BLOCK_N)
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    dx = g * _load_mask(mask_ptr, inside, rows, cols, row_bytes)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _fq_lsq_bwd_kernel(
    g_ptr, x_ptr, dx_ptr, s_ptr, z_ptr, part_ptr, M, N, C, grid_n, n_parts, qmin, qmax, grad_factor,
    QP_MODE: tl.constexpr, ZP_MODE: tl.constexpr, ROUND_MODE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """LSQ: dx = g * mask recomputed from x, and the per-element gradients of scale and zero point (torch's
    formulas, in torch's order of operations), summed over the tile into partial sums: per row (QP_MODE 1,
    at [pid_n, row]), per column (QP_MODE 2, at [pid_m, col]) or per tile (QP_MODE 0, at [pid]); the
    scale's at part_ptr, the zero point's n_parts further on.
    """
    pid, pid_m, pid_n, rows, cols, inside, offs = _tile(M, N, grid_n, BLOCK_M, BLOCK_N)
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    s, inv, z = _load_qparams(s_ptr, z_ptr, rows, cols, M, N, C, qmin, qmax, QP_MODE, ZP_MODE)
    q, qc, keep = _quantize(x, inv, z, qmin, qmax, ROUND_MODE)
    dx = g * keep.to(tl.float32)
    tl.store(dx_ptr + offs, dx.to(dx_ptr.dtype.element_ty), mask=inside)
    xfq = (qc - z) * s
    d_in = g * (xfq - x) * inv
    d_out = tl.where(q < qmin, g * (qmin - z), g * (qmax - z))
    ds = tl.where(inside, tl.where(keep, d_in, d_out) * grad_factor, 0.0)
    dz = tl.where(inside, tl.where(keep, 0.0, g * -1.0 * s) * grad_factor, 0.0)
    dz_ptr = part_ptr + n_parts
    if QP_MODE == 0:
        tl.store(part_ptr + pid, tl.sum(tl.sum(ds, axis=1), axis=0))
        tl.store(dz_ptr + pid, tl.sum(tl.sum(dz, axis=1), axis=0))
    elif QP_MODE == 1:
        part = pid_n.to(tl.int64) * M + rows
        tl.store(part_ptr + part, tl.sum(ds, axis=1), mask=rows < M)
        tl.store(dz_ptr + part, tl.sum(dz, axis=1), mask=rows < M)
    else:
        part = pid_m.to(tl.int64) * N + cols
        tl.store(part_ptr + part, tl.sum(ds, axis=0), mask=cols < N)
        tl.store(dz_ptr + part, tl.sum(dz, axis=0), mask=cols < N)


@triton.jit
def _dynamic_qparams(mn, mx, qmin, qmax, half_range, q_range, eps, SYMMETRIC: tl.constexpr):
    """torchao's choose_qparams: symmetric (absmax / ((qmax - qmin) / 2), zero point 0) or asymmetric
    (scale (max - min) / (qmax - qmin), zero point from the smaller of the two range errors), with the
    range widened to include 0 and the scale at least eps."""
    mn = tl.minimum(mn, 0.0)
    mx = tl.maximum(mx, 0.0)
    if SYMMETRIC:
        amax = tl.maximum(-mn, mx)
        s = tl.maximum(tl.math.div_rn(amax, tl.full(amax.shape, half_range, tl.float32)), eps)
        z = tl.zeros(s.shape, tl.float32)
    else:
        s = tl.maximum(tl.math.div_rn(mx - mn, tl.full(mx.shape, q_range, tl.float32)), eps)
        dmin = tl.math.div_rn(mn, s)
        dmax = tl.math.div_rn(mx, s)
        zf = tl.where((qmin + dmin) + (qmax + dmax) > 0, qmin - dmin, qmax - dmax)
        z = _rint(tl.minimum(tl.maximum(zf, qmin), qmax))
    return s, z


@triton.jit
def _fq_dynamic_kernel(
    x_ptr, y_ptr, mask_ptr, s_ptr, z_ptr, M, N, row_bytes, qmin, qmax, half_range, q_range, eps,
    SYMMETRIC: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """BLOCK_M whole rows per program: min/max, qparams, fake quant; writes y, the mask and the qparams."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    inside = (rows[:, None] < M) & (cols[None, :] < N)
    offs = rows[:, None].to(tl.int64) * N + cols[None, :]
    # Padding lanes read 0, which the range includes anyway.
    x = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    s, z = _dynamic_qparams(tl.min(x, axis=1), tl.max(x, axis=1), qmin, qmax, half_range, q_range, eps, SYMMETRIC)
    tl.store(s_ptr + rows, s, mask=rows < M)
    tl.store(z_ptr + rows, z, mask=rows < M)
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    q, qc, keep = _quantize(x, inv[:, None], z[:, None], qmin, qmax, 0)
    y = (qc - z[:, None]) * s[:, None]
    tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=inside)
    _store_mask(mask_ptr, keep, inside, rows, 0, M, row_bytes, BLOCK_M, BLOCK_N)


@triton.jit
def _fq_dynamic_looped_kernel(
    x_ptr, y_ptr, mask_ptr, s_ptr, z_ptr, M, N, row_bytes, qmin, qmax, half_range, q_range, eps,
    SYMMETRIC: tl.constexpr, BLOCK_N: tl.constexpr,
):
    """One long row per program: a sweep for min/max, a second sweep (from L2) to fake-quantize."""
    row = tl.program_id(0).to(tl.int64)
    mn_acc = tl.zeros((BLOCK_N,), tl.float32)
    mx_acc = tl.zeros((BLOCK_N,), tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        x = tl.load(x_ptr + row * N + cols, mask=cols < N, other=0.0).to(tl.float32)
        mn_acc = tl.minimum(mn_acc, x)
        mx_acc = tl.maximum(mx_acc, x)
    s, z = _dynamic_qparams(tl.min(mn_acc, axis=0), tl.max(mx_acc, axis=0), qmin, qmax, half_range, q_range,
                            eps, SYMMETRIC)
    tl.store(s_ptr + row, s)
    tl.store(z_ptr + row, z)
    inv = tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)
    rows = row + tl.arange(0, 1)
    for start in range(0, N, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        inside = (cols < N)[None, :]
        x = tl.load(x_ptr + row * N + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        q, qc, keep = _quantize(x, inv, z, qmin, qmax, 0)
        y = (qc - z) * s
        tl.store(y_ptr + row * N + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=inside)
        _store_mask(mask_ptr, keep, inside, rows, start, M, row_bytes, 1, BLOCK_N)


# ----------------------------------------------------------------------------- launchers


@functools.cache  # a microsecond of host time per launch otherwise; cache_clear() after changing TILE_ELEMENTS
def _tile_config(M: int, N: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps): about TILE_ELEMENTS elements per program, rows a multiple of 8 wide
    (a whole number of mask bytes)."""
    block_n = max(8, min(next_power_of_2(max(N, 1)), TILE_ELEMENTS))
    block_m = min(next_power_of_2(max(M, 1)), max(1, TILE_ELEMENTS // block_n))
    num_warps = 4 if block_m * block_n <= 1024 else 8
    return block_m, block_n, num_warps


def _packed_shape(M: int, N: int) -> tuple[int, int]:
    """Shape of the packed mask of an (M, N) view: a byte per 8 columns of each row."""
    return M, (N + 7) // 8


def _zp_mode(zero_point: torch.Tensor, lsq_per_tensor: bool = False) -> int:
    if not zero_point.is_floating_point():
        return 0
    return 2 if lsq_per_tensor else 1


def fake_quantize_forward(
    x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int, quant_max: int,
    layout: tuple[int, int, int, int], round_mode: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Fake-quantize ``x`` (any float dtype but fp64) into a new contiguous tensor of x's dtype, and the
    packed mask (uint8, ``_packed_shape(M, N)``).

    ``scale``: fp32 qparams, ``zero_point``: integer (used as is) or floating (rounded half to even and
    clamped in the kernel); both indexed per ``layout = (M, N, C, qp_mode)``.
    """
    x = x.contiguous()
    y = torch.empty_like(x)
    M, N, C, qp_mode = layout
    mask_bytes = (N + 7) // 8
    mask = torch.empty((M, mask_bytes), dtype=torch.uint8, device=x.device)
    if M * N == 0:
        return y, mask
    block_m, block_n, num_warps = _tile_config(M, N)
    grid_n = cdiv(N, block_n)
    launch(_fq_fwd_kernel, (cdiv(M, block_m) * grid_n,),
        x, y, mask, scale.contiguous(), zero_point.contiguous(), M, N, C, grid_n, mask_bytes, float(quant_min),
        float(quant_max), QP_MODE=qp_mode, ZP_MODE=_zp_mode(zero_point), ROUND_MODE=round_mode,
        BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, enable_fp_fusion=False,
    )
    return y, mask


def fake_quantize_ste_backward(grad: torch.Tensor, mask: torch.Tensor, M: int, N: int) -> torch.Tensor:
    """grad * mask (the forward's packed mask of the (M, N) view), contiguous, in grad's dtype."""
    grad = grad.contiguous()
    dx = torch.empty_like(grad)
    if M * N == 0:
        return dx
    block_m, block_n, num_warps = _tile_config(M, N)
    grid_n = cdiv(N, block_n)
    launch(_fq_ste_bwd_kernel, (cdiv(M, block_m) * grid_n,),
        grad, mask, dx, M, N, grid_n, mask.shape[1], BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
    )
    return dx


def fake_quantize_lsq_backward(
    grad: torch.Tensor, x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, quant_min: int,
    quant_max: int, layout: tuple[int, int, int, int], round_mode: int, grad_factor: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """dx (x's dtype, contiguous) and the fp32 LSQ gradients of scale and zero point, stacked (2, C) (C = 1
    per tensor), finished from the kernel's partial sums in one reduction.

    ``zero_point`` as torch's LSQ backward uses it: integer as is, floating rounded and clamped (per
    tensor: ``trunc(clamp(z + 0.5))``) in the kernel."""
    x = x.contiguous()
    grad = grad.contiguous()
    dx = torch.empty_like(x)
    M, N, C, qp_mode = layout
    if M * N == 0:
        return dx, torch.zeros(2, C, dtype=torch.float32, device=x.device)
    # (Rows of 8192 elements in one program, so that no reduction runs, measured 0.835 of copy on an H200
    # against 1.003 for two programs of 4096: the reduction of the partial sums costs less than that.)
    block_m, block_n, num_warps = _tile_config(M, N)
    grid_m, grid_n = cdiv(M, block_m), cdiv(N, block_n)
    part_shape = (grid_m * grid_n,) if qp_mode == PER_TENSOR else (grid_n, M) if qp_mode == PER_ROW else (grid_m, N)
    parts = torch.empty((2, *part_shape), dtype=torch.float32, device=x.device)  # scale's, zero point's
    launch(_fq_lsq_bwd_kernel, (grid_m * grid_n,),
        grad, x, dx, scale.contiguous(), zero_point.contiguous(), parts, M, N, C, grid_n, math.prod(part_shape),
        float(quant_min), float(quant_max), float(grad_factor),
        QP_MODE=qp_mode, ZP_MODE=_zp_mode(zero_point, lsq_per_tensor=qp_mode == PER_TENSOR),
        ROUND_MODE=round_mode, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps, enable_fp_fusion=False,
    )
    if qp_mode == PER_TENSOR:
        return dx, parts.sum(1, keepdim=True)
    if qp_mode == PER_ROW and M != C:  # rows are (outer, channel) pairs
        return dx, parts.view(2, grid_n * (M // C), C).sum(1)
    return dx, parts[:, 0] if parts.shape[1] == 1 else parts.sum(1)  # one partial per qparam: no reduction to run


def fake_quantize_dynamic_forward(
    x: torch.Tensor, quant_min: int, quant_max: int, group_size: int, symmetric: bool, eps: float,
    looped: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Fake-quantize each group of ``group_size`` consecutive elements of x's last dim with qparams from
    the group's own min/max. Returns (y, scale, zero_point, mask): the qparams fp32 with one entry per group,
    the mask packed as ``_packed_shape(groups, group_size)``."""
    x = x.contiguous()
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    n_groups = x.numel() // group_size if group_size else 0
    scale = torch.empty(n_groups, dtype=torch.float32, device=x.device)
    zero_point = torch.empty(n_groups, dtype=torch.float32, device=x.device)
    M, N = n_groups, group_size
    mask = torch.empty(_packed_shape(M, N), dtype=torch.uint8, device=x.device)
    if y.numel() == 0:
        return y, scale, zero_point, mask
    args = (x, y, mask, scale, zero_point, M, N, mask.shape[1], float(quant_min), float(quant_max),
            float(quant_max - quant_min) / 2, float(quant_max - quant_min), float(eps))
    if looped is None:
        looped = N > MAX_ONE_PASS_COLS
    if looped:
        block_n = max(8, min(LOOP_BLOCK_N, next_power_of_2(N)))
        launch(_fq_dynamic_looped_kernel, (M,), *args, SYMMETRIC=symmetric, BLOCK_N=block_n,
               num_warps=8 if block_n >= 2048 else 4, enable_fp_fusion=False)
    else:
        block_n = max(8, next_power_of_2(N))
        block_m = min(next_power_of_2(M), max(1, TILE_ELEMENTS // block_n))
        elements = block_m * block_n
        num_warps = 4 if elements <= 1024 else 8 if elements <= 8192 else 16
        launch(_fq_dynamic_kernel, (cdiv(M, block_m),),
            *args, SYMMETRIC=symmetric, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps,
            enable_fp_fusion=False,
        )
    return y, scale, zero_point, mask
