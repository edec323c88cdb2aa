"""Triton kernels shared by RMSNorm and LayerNorm (``kernels/rms_norm.py``, ``kernels/layer_norm.py``), forward and
backward, with the optional fused residual add (h = x + residual, then the norm of h).

Every kernel sees its tensors as 2-D (rows, cols) views, cols = the normalized dims flattened (N), with a row stride and
a column stride for what it reads (inputs may be strided); what it writes is contiguous. Math in fp32.

- Forward, rows up to ``MAX_ONE_PASS_COLS``: a (BLOCK_M, BLOCK_N) tile holds BLOCK_M whole rows in registers (several
  rows per program for short rows, one for long ones); x (and the residual) are read once, y (and h) written once,
  plus the per-row statistics: rstd (RMSNorm) or mean and rstd (LayerNorm), fp32. LayerNorm's variance is the mean of
  the centered squares (two passes over registers, as torch).
- Forward, longer rows: one program per row in two sweeps over blocks of the row — running statistics (sum of squares,
  or Chan's merge of per-block mean and centered sum of squares for LayerNorm), then the output, the last block first
  (what the first sweep read last is likeliest still in L2). With a residual, the first sweep writes h and the second
  reads it back.
- Backward: dx = rstd * (w*dy - xhat * mean(xhat * w*dy) [- mean(w*dy)]), dw = sum over rows of dy * xhat, db = sum of
  dy. A grid of a few programs per SM (``backward_config``), each owning a contiguous range of rows that it walks
  BLOCK_M rows at a time (a software-pipelined loop, ``BWD_STAGES``): it writes dx per row and accumulates its
  partial dw / db in fp32 registers, stored once at the end into a (programs, N) fp32 buffer; a second small kernel
  sums those columns into the weight's dtype. No atomics: the result is deterministic and the reduction reads
  programs * N * 4 bytes (a few MB) instead of contending on N addresses.
  Rows past ``MAX_ONE_PASS_COLS``: a first kernel computes each row's two sums in a looped sweep, then the same backward
  kernel runs over (row range, column chunk) programs with those sums, so dw's partials stay in registers.

The backward's tile, warps, programs per SM and pipeline depth at 2K-8K columns are tuned on an H100
(``BWD_CONFIGS``, ``benchmarks/bench_rms_norm.py --tune``); other sizes use the first-choice rules below.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from fusedlayers.kernels import cdiv, launch, next_power_of_2

# Rows up to this many columns run the one-pass kernels (whole rows in registers), longer rows the looped ones.
MAX_ONE_PASS_COLS = 16384
# Elements per one-pass tile: short rows are grouped BLOCK_M to a program until the tile holds this many. Warps: the
# forward 16 elements per thread (4 to 16 warps: 26-63 registers at 2K-16K bf16 columns, compiled for sm_90 with
# ptxas 13), the backward 8 (4 to 32 warps), which holds x, dy, w, their products and the dw / db accumulators: at 16
# elements per thread it took 124-224 registers at 4K-8K columns (one program per SM), at 8 it takes 58-93, no spills
# up to 8K columns (64 registers of 32 warps at 8K; 16K spills 80-216 bytes per thread).
FWD_TILE_ELEMENTS = 4096
BWD_TILE_ELEMENTS = 2048
MAX_BLOCK_M = 64
# Backward grid: programs per SM (each a contiguous range of rows) as many as fit next to one another (32 warps'
# worth, at most 4), at most one per BWD_MIN_ROWS rows; the depth of the software pipeline of its loop over rows
# (loads of the next rows into shared memory while this one computes).
BWD_MAX_PROGRAMS_PER_SM = 4
BWD_MIN_ROWS = 8
BWD_STAGES = 2


class FwdConfig(NamedTuple):
    block_m: int  # rows per program
    warps: int


class BwdConfig(NamedTuple):
    block_m: int  # rows per loop step
    warps: int
    programs_per_sm: int
    stages: int


# Tuned settings of the one-pass kernels, by ("rms" | "layer", BLOCK_N = columns rounded up to a power of 2); rows
# not listed follow the rules above. The forward's first choices run at copy bandwidth (not tuned). The backward:
# `benchmarks/bench_rms_norm.py --tune` / `bench_layer_norm.py --tune` on an H100, bf16, 256 MiB tensors, the kernel
# alone (x, dy read, dx written; dw, db partials): one row per step, 8 warps, a 3-deep pipeline, 2 programs per SM
# (1 at 8K columns). Fraction of copy bandwidth, first choice -> tuned: RMSNorm 2K 0.904 -> 0.915, 4K 0.873 -> 0.929,
# 8K 0.815 -> 0.931; LayerNorm 2K 0.646 -> 0.899, 4K 0.633 -> 0.919, 8K 0.757 -> 0.923.
FWD_CONFIGS: dict = {}
BWD_CONFIGS: dict = {
    (op, block_n): BwdConfig(block_m=1, warps=8, programs_per_sm=1 if block_n >= 8192 else 2, stages=3)
    for op in ("rms", "layer") for block_n in (2048, 4096, 8192)
}
# Looped kernels (long rows): columns per block for 16-bit input (fp32 takes half), and warps.
LOOP_BLOCK_N = 4096
LOOP_WARPS = 8
LOOP_STAGES = 2
# Reduction of the weight-gradient partials: (partials, columns) per tile.
SUM_BLOCK_P = 64
SUM_BLOCK_C = 32


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _tile(ptr, rows, cols, stride_r, stride_c, mask):
    """A (rows x cols) tile of a strided 2-D view, as fp32 (0 outside ``mask``)."""
    offsets = rows[:, None].to(tl.int64) * stride_r + cols[None, :].to(tl.int64) * stride_c
    return tl.load(ptr + offsets, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _add_pair(a0, a1, b0, b1):
    return a0 + b0, a1 + b1


@triton.jit
def _norm_fwd_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, h_ptr, stats_ptr,
    n_rows, n_cols, stride_xr, stride_xc, stride_rr, stride_rc, eps,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # the row length as fp32 for correctly rounded divisions (div_rn): '/' compiles to an approximate
    # division, which is not exact even where the quotient is (x / 1), breaking exact cancellations
    n_cols_f = (n_cols + tl.zeros([], tl.int32)).to(tl.float32)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_in = rows < n_rows
    col_in = cols < n_cols
    inside = row_in[:, None] & col_in[None, :]
    out_offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
    x = _tile(x_ptr, rows, cols, stride_xr, stride_xc, inside)
    if HAS_RES:  # h = x + residual, rounded to h's dtype as torch's add does; the norm reads the rounded h
        h = (x + _tile(res_ptr, rows, cols, stride_rr, stride_rc, inside)).to(h_ptr.dtype.element_ty)
        tl.store(h_ptr + out_offsets, h, mask=inside)
        x = h.to(tl.float32)
    if RMS:
        rstd = tl.math.rsqrt(tl.math.div_rn(tl.sum(x * x, axis=1), n_cols_f) + eps)
        y = x * rstd[:, None]
        tl.store(stats_ptr + rows, rstd, mask=row_in)
    else:
        mean = tl.math.div_rn(tl.sum(x, axis=1), n_cols_f)
        xc = tl.where(inside, x - mean[:, None], 0.0)
        rstd = tl.math.rsqrt(tl.math.div_rn(tl.sum(xc * xc, axis=1), n_cols_f) + eps)
        y = xc * rstd[:, None]
        tl.store(stats_ptr + rows, mean, mask=row_in)
        tl.store(stats_ptr + n_rows + rows, rstd, mask=row_in)
    if HAS_W:
        y = y * tl.load(w_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    if HAS_B:
        y = y + tl.load(b_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + out_offsets, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _norm_fwd_looped_kernel(
    x_ptr, res_ptr, w_ptr, b_ptr, y_ptr, h_ptr, stats_ptr,
    n_rows, n_cols, stride_xr, stride_xc, stride_rr, stride_rc, eps,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_B: tl.constexpr, HAS_RES: tl.constexpr,
    BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    # the row length as fp32 for correctly rounded divisions (div_rn): '/' compiles to an approximate
    # division, which is not exact even where the quotient is (x / 1), breaking exact cancellations
    n_cols_f = (n_cols + tl.zeros([], tl.int32)).to(tl.float32)
    """One row per program: statistics in a first sweep, the output in a second (last block first)."""
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * stride_xr
    res_row = res_ptr + row * stride_rr
    h_row = h_ptr + row * n_cols
    y_row = y_ptr + row * n_cols
    sum_sq = tl.zeros((BLOCK_N,), tl.float32)  # RMSNorm
    count = tl.zeros([], tl.float32)  # LayerNorm: Chan's running (count, mean, centered sum of squares)
    mean = tl.zeros([], tl.float32)
    m2 = tl.zeros([], tl.float32)
    for start in tl.range(0, n_cols, BLOCK_N, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK_N)
        inside = cols < n_cols
        x = tl.load(x_row + cols.to(tl.int64) * stride_xc, mask=inside, other=0.0).to(tl.float32)
        if HAS_RES:
            r = tl.load(res_row + cols.to(tl.int64) * stride_rc, mask=inside, other=0.0).to(tl.float32)
            h = (x + r).to(h_ptr.dtype.element_ty)
            tl.store(h_row + cols, h, mask=inside)
            x = h.to(tl.float32)
        if RMS:
            sum_sq += x * x
        else:
            n_block = tl.sum(inside.to(tl.float32), axis=0)
            block_mean = tl.sum(x, axis=0) / n_block
            d = tl.where(inside, x - block_mean, 0.0)
            delta = block_mean - mean
            total = count + n_block
            mean = mean + delta * (n_block / total)
            m2 = m2 + tl.sum(d * d, axis=0) + delta * delta * (count * n_block / total)
            count = total
    if RMS:
        rstd = tl.math.rsqrt(tl.math.div_rn(tl.sum(sum_sq, axis=0), n_cols_f) + eps)
        tl.store(stats_ptr + row, rstd)
    else:
        rstd = tl.math.rsqrt(tl.math.div_rn(m2, n_cols_f) + eps)
        tl.store(stats_ptr + row, mean)
        tl.store(stats_ptr + n_rows + row, rstd)
    if HAS_RES:
        tl.debug_barrier()  # the second sweep reads back h, which other threads of the program may have written
    last = tl.cdiv(n_cols, BLOCK_N) - 1
    for step in tl.range(0, last + 1, num_stages=STAGES):
        cols = (last - step) * BLOCK_N + tl.arange(0, BLOCK_N)
        inside = cols < n_cols
        if HAS_RES:
            x = tl.load(h_row + cols, mask=inside, other=0.0).to(tl.float32)
        else:
            x = tl.load(x_row + cols.to(tl.int64) * stride_xc, mask=inside, other=0.0).to(tl.float32)
        if RMS:
            y = x * rstd
        else:
            y = (x - mean) * rstd
        if HAS_W:
            y = y * tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        if HAS_B:
            y = y + tl.load(b_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=inside)


@triton.jit
def _norm_bwd_kernel(
    dy_ptr, x_ptr, w_ptr, stats_ptr, gres_ptr, sums_ptr, dx_ptr, dxi_ptr, dw_ptr, db_ptr,
    n_rows, n_cols, rows_per_program,
    stride_dyr, stride_dyc, stride_xr, stride_xc, stride_gr, stride_gc,
    RMS: tl.constexpr, HAS_W: tl.constexpr, HAS_GRES: tl.constexpr, NEED_DX: tl.constexpr, HAS_DXI: tl.constexpr,
    NEED_DW: tl.constexpr, NEED_DB: tl.constexpr, PRECOMPUTED: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    # the row length as fp32 for correctly rounded divisions (div_rn): '/' compiles to an approximate
    # division, which is not exact even where the quotient is (x / 1), breaking exact cancellations
    n_cols_f = (n_cols + tl.zeros([], tl.int32)).to(tl.float32)
    """Program (p, c) walks rows [p * rows_per_program, ...) over columns chunk c (chunk 0 = the whole row unless
    PRECOMPUTED, where the rows' two sums come from ``sums_ptr``), writing dx and its partial dw / db (row p of the
    (programs, N) fp32 buffers)."""
    pid = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_in = cols < n_cols
    first = pid * rows_per_program
    end = tl.minimum(first + rows_per_program, n_rows)
    if HAS_W:
        w = tl.load(w_ptr + cols, mask=col_in, other=0.0).to(tl.float32)[None, :]
    dw_acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    db_acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for start in tl.range(first, end, BLOCK_M, num_stages=STAGES):
        rows = start + tl.arange(0, BLOCK_M)
        row_in = rows < end
        inside = row_in[:, None] & col_in[None, :]
        x = _tile(x_ptr, rows, cols, stride_xr, stride_xc, inside)
        dy = _tile(dy_ptr, rows, cols, stride_dyr, stride_dyc, inside)
        if RMS:
            rstd = tl.load(stats_ptr + rows, mask=row_in, other=0.0)
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(stats_ptr + rows, mask=row_in, other=0.0)
            rstd = tl.load(stats_ptr + n_rows + rows, mask=row_in, other=0.0)
            xhat = (x - mean[:, None]) * rstd[:, None]  # not 0 in padding columns, but dy is
        if HAS_W:
            wdy = dy * w
        else:
            wdy = dy
        if NEED_DX:
            if RMS:
                if PRECOMPUTED:
                    c1 = tl.load(sums_ptr + 2 * rows, mask=row_in, other=0.0)
                else:
                    c1 = tl.math.div_rn(tl.sum(xhat * wdy, axis=1), n_cols_f)
                dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
            else:
                if PRECOMPUTED:
                    c1 = tl.load(sums_ptr + 2 * rows, mask=row_in, other=0.0)
                    c2 = tl.load(sums_ptr + 2 * rows + 1, mask=row_in, other=0.0)
                else:  # both row sums in one reduction (one exchange between warps instead of two)
                    s1, s2 = tl.reduce((xhat * wdy, wdy), 1, _add_pair)
                    c1 = tl.math.div_rn(s1, n_cols_f)
                    c2 = tl.math.div_rn(s2, n_cols_f)
                dx = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
            if HAS_GRES:
                dx += _tile(gres_ptr, rows, cols, stride_gr, stride_gc, inside)
            offsets = rows[:, None].to(tl.int64) * n_cols + cols[None, :]
            tl.store(dx_ptr + offsets, dx.to(dx_ptr.dtype.element_ty),
                     mask=inside, cache_modifier=".cs")  # streaming, as the softmax backward (measured there)
            if HAS_DXI:  # the same gradient in the input's dtype too (the residual's is dx)
                tl.store(dxi_ptr + offsets, dx.to(dxi_ptr.dtype.element_ty), mask=inside, cache_modifier=".cs")
        if NEED_DW:
            dw_acc += dy * xhat
        if NEED_DB:
            db_acc += dy
    part = pid.to(tl.int64) * n_cols + cols
    if NEED_DW:
        tl.store(dw_ptr + part, tl.sum(dw_acc, axis=0), mask=col_in)
    if NEED_DB:
        tl.store(db_ptr + part, tl.sum(db_acc, axis=0), mask=col_in)


@triton.jit
def _norm_bwd_row_sums_kernel(
    dy_ptr, x_ptr, w_ptr, stats_ptr, sums_ptr, n_rows, n_cols, stride_dyr, stride_dyc, stride_xr, stride_xc,
    RMS: tl.constexpr, HAS_W: tl.constexpr, BLOCK_N: tl.constexpr, STAGES: tl.constexpr,
):
    # the row length as fp32 for correctly rounded divisions (div_rn): '/' compiles to an approximate
    # division, which is not exact even where the quotient is (x / 1), breaking exact cancellations
    n_cols_f = (n_cols + tl.zeros([], tl.int32)).to(tl.float32)
    """Long rows: mean(xhat * w*dy) and mean(w*dy) of each row (one program per row, a looped sweep) into
    ``sums_ptr`` (2 per row), for ``_norm_bwd_kernel`` with PRECOMPUTED."""
    row = tl.program_id(0).to(tl.int64)
    if RMS:
        mean = 0.0
        rstd = tl.load(stats_ptr + row)
    else:
        mean = tl.load(stats_ptr + row)
        rstd = tl.load(stats_ptr + n_rows + row)
    acc1 = tl.zeros((BLOCK_N,), tl.float32)
    acc2 = tl.zeros((BLOCK_N,), tl.float32)
    for start in tl.range(0, n_cols, BLOCK_N, num_stages=STAGES):
        cols = start + tl.arange(0, BLOCK_N)
        inside = cols < n_cols
        c64 = cols.to(tl.int64)
        x = tl.load(x_ptr + row * stride_xr + c64 * stride_xc, mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row * stride_dyr + c64 * stride_dyc, mask=inside, other=0.0).to(tl.float32)
        if HAS_W:
            dy = dy * tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        acc1 += (x - mean) * rstd * dy
        acc2 += dy
    tl.store(sums_ptr + 2 * row, tl.math.div_rn(tl.sum(acc1, axis=0), n_cols_f))
    tl.store(sums_ptr + 2 * row + 1, tl.math.div_rn(tl.sum(acc2, axis=0), n_cols_f))


@triton.jit
def _sum_partials_kernel(part_ptr, out0_ptr, out1_ptr, n_parts, n_cols, BLOCK_P: tl.constexpr,
                         BLOCK_C: tl.constexpr):
    """Column sums of the (n_parts, n_cols) fp32 partials: grid axis 1 picks the buffer (0: dw into out0, 1: db into
    out1; the buffers lie one after the other at part_ptr), written in the output's dtype."""
    which = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_in = cols < n_cols
    base = part_ptr + which.to(tl.int64) * n_parts * n_cols
    acc = tl.zeros((BLOCK_P, BLOCK_C), tl.float32)
    for p in range(0, n_parts, BLOCK_P):
        parts = p + tl.arange(0, BLOCK_P)
        mask = (parts[:, None] < n_parts) & col_in[None, :]
        acc += tl.load(base + parts[:, None].to(tl.int64) * n_cols + cols[None, :], mask=mask, other=0.0)
    total = tl.sum(acc, axis=0)
    if which == 0:
        tl.store(out0_ptr + cols, total.to(out0_ptr.dtype.element_ty), mask=col_in)
    else:
        tl.store(out1_ptr + cols, total.to(out1_ptr.dtype.element_ty), mask=col_in)


# ----------------------------------------------------------------------------- launch plans


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # the interpreter runs programs one after another anyway
    return torch.cuda.get_device_properties(device).multi_processor_count


def _warps(elements: int, per_thread: int, most: int) -> int:
    return max(4, min(most, elements // (32 * per_thread)))


def _op_key(rms: bool) -> str:
    return "rms" if rms else "layer"


def forward_config(block_n: int, rms: bool) -> FwdConfig:
    """Rows per program and warps of the one-pass forward for rows of ``block_n`` (a power of 2) columns."""
    config = FWD_CONFIGS.get((_op_key(rms), block_n))
    if config is None:
        block_m = max(1, min(MAX_BLOCK_M, FWD_TILE_ELEMENTS // block_n))
        config = FwdConfig(block_m, _warps(block_m * block_n, 16, 16))
    return config


def backward_config(block_n: int, rms: bool) -> BwdConfig:
    """Rows per step, warps, programs per SM and pipeline depth of the one-pass backward."""
    config = BWD_CONFIGS.get((_op_key(rms), block_n))
    if config is None:
        block_m = max(1, min(MAX_BLOCK_M, BWD_TILE_ELEMENTS // block_n))
        warps = _warps(block_m * block_n, 8, 32)
        config = BwdConfig(block_m, warps, max(1, min(BWD_MAX_PROGRAMS_PER_SM, 32 // warps)), BWD_STAGES)
    return config


class ForwardPlan(NamedTuple):
    kernel: object
    meta: dict
    rows_per_program: int


class BackwardPlan(NamedTuple):
    meta: dict
    block_m: int
    col_chunks: int  # > 1: long rows, row sums precomputed by _norm_bwd_row_sums_kernel
    max_programs: int
    loop_meta: dict  # launch keywords of the row-sums kernel (long rows)


def _loop_block(n_cols: int, element_size: int) -> int:
    return min(LOOP_BLOCK_N * 2 // max(element_size, 2), next_power_of_2(n_cols))


@functools.cache
def forward_plan(n_cols: int, element_size: int, device: torch.device, rms: bool, has_w: bool, has_b: bool,
                 has_res: bool) -> ForwardPlan:
    flags = dict(RMS=rms, HAS_W=has_w, HAS_B=has_b, HAS_RES=has_res)
    if n_cols > MAX_ONE_PASS_COLS:
        meta = dict(BLOCK_N=_loop_block(n_cols, element_size), STAGES=LOOP_STAGES, num_warps=LOOP_WARPS)
        return ForwardPlan(_norm_fwd_looped_kernel, {**flags, **meta}, 1)
    block_n = next_power_of_2(n_cols)
    config = forward_config(block_n, rms)
    meta = dict(BLOCK_M=config.block_m, BLOCK_N=block_n, num_warps=config.warps)
    return ForwardPlan(_norm_fwd_kernel, {**flags, **meta}, config.block_m)


@functools.cache
def backward_plan(n_cols: int, element_size: int, device: torch.device, rms: bool, has_w: bool, has_gres: bool,
                  need_dx: bool, need_dw: bool, need_db: bool, has_dxi: bool = False) -> BackwardPlan:
    flags = dict(RMS=rms, HAS_W=has_w, HAS_GRES=has_gres, NEED_DX=need_dx, NEED_DW=need_dw, NEED_DB=need_db,
                 HAS_DXI=has_dxi)
    if n_cols > MAX_ONE_PASS_COLS:
        block_n = _loop_block(n_cols, element_size)
        warps = _warps(block_n, 8, 32)
        meta = dict(PRECOMPUTED=True, BLOCK_M=1, BLOCK_N=block_n, STAGES=BWD_STAGES, num_warps=warps)
        loop_meta = dict(RMS=rms, HAS_W=has_w, BLOCK_N=block_n, STAGES=LOOP_STAGES, num_warps=LOOP_WARPS)
        programs = _multiprocessors(device) * max(1, min(BWD_MAX_PROGRAMS_PER_SM, 32 // warps))
        return BackwardPlan({**flags, **meta}, 1, cdiv(n_cols, block_n), programs, loop_meta)
    block_n = next_power_of_2(n_cols)
    config = backward_config(block_n, rms)
    meta = dict(PRECOMPUTED=False, BLOCK_M=config.block_m, BLOCK_N=block_n, STAGES=config.stages,
                num_warps=config.warps)
    return BackwardPlan({**flags, **meta}, config.block_m, 1, _multiprocessors(device) * config.programs_per_sm, {})


def _backward_grid(n_rows: int, block_m: int, max_programs: int, reduce_params: bool) -> tuple[int, int]:
    """(programs, rows per program) of the backward kernel. With weight/bias gradients to reduce: a few programs per
    SM, each a contiguous range of rows (its partial sums one row of ``parts``); else one program per row block."""
    if not reduce_params:
        return cdiv(n_rows, block_m), block_m
    programs = max(1, min(max_programs, cdiv(n_rows, max(BWD_MIN_ROWS, block_m))))
    rows_per_program = cdiv(cdiv(n_rows, programs), block_m) * block_m
    return cdiv(n_rows, rows_per_program), rows_per_program


def forget_plans() -> None:
    """Drop the memoized launch plans (after changing the tuning constants above, as tests and the tuner do)."""
    forward_plan.cache_clear()
    backward_plan.cache_clear()


# ----------------------------------------------------------------------------- launchers


def rows_view(t: torch.Tensor, n_cols: int) -> tuple[torch.Tensor, int, int, int]:
    """``t`` as rows of ``n_cols``: (tensor to pass, n_rows, row stride, column stride). Contiguous tensors pass as they
    are; others as a (rows, n_cols) view where their strides allow one (a copy otherwise)."""
    if t.is_contiguous():
        return t, t.numel() // n_cols, n_cols, 1
    t2 = t.reshape(-1, n_cols)
    return t2, t2.shape[0], t2.stride(0), t2.stride(1)


def _flat(p: torch.Tensor | None) -> torch.Tensor | None:
    """A parameter as the contiguous vector of n_cols the kernels index (a copy only for a strided one)."""
    if p is None or (p.dim() == 1 and p.is_contiguous()):  # the usual case, without making a view (host time)
        return p
    return p.reshape(-1).contiguous()


def norm_forward(x: torch.Tensor, n_cols: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                 residual: torch.Tensor | None, eps: float, out_dtype: torch.dtype, rms: bool
                 ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(y, h, stats): y = norm(h) * weight + bias in ``out_dtype`` with h = x + residual (or x), h as a new tensor of
    the promoted dtype when ``residual`` is given (else None); stats fp32, rstd (n_rows,) for RMSNorm, mean and rstd
    (2, n_rows) for LayerNorm. x and residual: (..., n_cols) with any strides; weight and bias n_cols elements."""
    x2, n_rows, stride_xr, stride_xc = rows_view(x, n_cols)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    stats = torch.empty((n_rows,) if rms else (2, n_rows), dtype=torch.float32, device=x.device)
    h = None
    if residual is not None:
        h = torch.empty(x.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
        r2, _, stride_rr, stride_rc = rows_view(residual, n_cols)
    else:
        r2, stride_rr, stride_rc = x2, 0, 0
    if n_rows == 0 or n_cols == 0:
        return y, h, stats.zero_()
    w, b = _flat(weight), _flat(bias)
    plan = forward_plan(n_cols, max(x.element_size(), h.element_size() if h is not None else 0), x.device,
                        rms, w is not None, b is not None, h is not None)
    launch(plan.kernel, (cdiv(n_rows, plan.rows_per_program),), x2, r2, w if w is not None else x2,
           b if b is not None else x2, y, h if h is not None else y, stats,
           n_rows, n_cols, stride_xr, stride_xc, stride_rr, stride_rc, float(eps), **plan.meta)
    return y, h, stats


def norm_backward(grad: torch.Tensor, x: torch.Tensor, n_cols: int, weight: torch.Tensor | None,
                  stats: torch.Tensor, grad_residual: torch.Tensor | None, dx_dtype: torch.dtype,
                  need_dx: bool, need_dw: bool, need_db: bool, rms: bool, bias_dtype: torch.dtype | None = None,
                  input_dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dxi, dw, db), None where not needed: dx (x's shape, ``dx_dtype``) = the input gradient (+
    ``grad_residual``), dxi the same values in ``input_dtype`` (written by the same kernel; None without it), dw and db
    as flat n_cols tensors in the weight's dtype and ``bias_dtype``. ``x`` is what the forward normalized (the input,
    or h with a residual), with the forward's ``stats``."""
    dx = torch.empty(x.shape, dtype=dx_dtype, device=x.device) if need_dx else None
    dxi = torch.empty(x.shape, dtype=input_dtype, device=x.device) if need_dx and input_dtype is not None else None
    dw = torch.empty(n_cols, dtype=weight.dtype, device=x.device) if need_dw else None
    db = torch.empty(n_cols, dtype=bias_dtype, device=x.device) if need_db else None
    n_rows = x.numel() // n_cols if n_cols else 0
    if n_rows == 0 or n_cols == 0:
        return dx, dxi, None if dw is None else dw.zero_(), None if db is None else db.zero_()
    x2, _, stride_xr, stride_xc = rows_view(x, n_cols)
    g2, _, stride_dyr, stride_dyc = rows_view(grad, n_cols)
    if grad_residual is not None:
        gr2, _, stride_gr, stride_gc = rows_view(grad_residual, n_cols)
    else:
        gr2, stride_gr, stride_gc = g2, 0, 0
    w = _flat(weight)
    plan = backward_plan(n_cols, max(x.element_size(), grad.element_size()), x.device, rms, w is not None,
                         grad_residual is not None, need_dx, need_dw, need_db, dxi is not None)
    programs, rows_per_program = _backward_grid(n_rows, plan.block_m, plan.max_programs, need_dw or need_db)
    n_out = int(need_dw) + int(need_db)
    parts = torch.empty((max(n_out, 1), programs, n_cols) if n_out else (1,), dtype=torch.float32, device=x.device)
    sums = stats
    if plan.col_chunks > 1:
        sums = torch.empty((n_rows, 2), dtype=torch.float32, device=x.device)
        launch(_norm_bwd_row_sums_kernel, (n_rows,), g2, x2, w if w is not None else x2, stats, sums,
               n_rows, n_cols, stride_dyr, stride_dyc, stride_xr, stride_xc, **plan.loop_meta)
    # the slabs of parts: dw's is its first (parts itself: no view to make), db's the next one when both are asked
    db_parts = parts[1] if need_dw and need_db else parts
    dw_parts = parts
    launch(_norm_bwd_kernel, (programs, plan.col_chunks), g2, x2, w if w is not None else x2, stats,
           gr2, sums, dx if dx is not None else x2, dxi if dxi is not None else x2, dw_parts, db_parts,
           n_rows, n_cols, rows_per_program, stride_dyr, stride_dyc, stride_xr, stride_xc, stride_gr, stride_gc,
           **plan.meta)
    if n_out:
        out0 = dw if need_dw else db
        out1 = db if (need_dw and need_db) else out0
        launch(_sum_partials_kernel, (cdiv(n_cols, SUM_BLOCK_C), n_out), parts, out0, out1, programs, n_cols,
               BLOCK_P=SUM_BLOCK_P, BLOCK_C=SUM_BLOCK_C, num_warps=4)
    return dx, dxi, dw, db
