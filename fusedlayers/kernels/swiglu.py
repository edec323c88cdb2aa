"""Triton kernels of SwiGLU, ``silu(gate) * up``, forward and backward (elementwise, memory-bound); the same kernels
compute GeGLU, ``gelu(gate) * up`` (``ACT``: SiLU, GELU's tanh form, exact GELU; ``fusedlayers.kernels.geglu``).

- Forward: reads gate and up, writes out = gate * sigmoid(gate) * up (3 tensors moved).
- Backward: reads dy, gate and up, writes dgate = dy * up * s * (1 + gate * (1 - s)) and dup = dy * gate * s with
  s = sigmoid(gate) recomputed (5 tensors moved); only the gradients asked for are written. Nothing but the inputs is
  saved for it.

Math in fp32 whatever the storage dtypes (fp16 / bf16 / fp32; each tensor is read in its own dtype and every output
written in its own). sigmoid(g) = 1 / (1 + exp(-g)) with a correctly rounded division (div_rn): it is 0 for
g -> -inf and 1 for g -> +inf, no NaN from the exp's overflow.

Layout: where every tensor is contiguous the kernels run over the flat elements. Otherwise every tensor is seen as a
(rows, cols) view, cols = the last dim, with its own row and column strides (``reshape(-1, cols)``, a copy only where
the strides allow no such view): gate and up taken as the two halves of one fused gate_up projection (``chunk(2,
-1)``), transposed or sliced tensors and expanded (stride 0) gradients are read in place. Outputs are contiguous. A
program covers BLOCK elements of one row; the grid is 1-D (row, column block) flattened, so neither the number of
rows nor the row length meets the grid's 65535 limit of its other dims.

BLOCK and the warps below: at 102-103% of the device copy's bandwidth each way on an H100 (bf16, 16K-64K rows of
8192-14336; benchmarks/results/h100-swiglu.md), as fast as memory allows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedlayers.kernels import cdiv, launch, next_power_of_2

# Elements per program (16 per thread at 4 warps: two 16-byte vectors of bf16 per tensor) and its warps.
BLOCK = 2048
WARPS = 4
MIN_BLOCK = 128


@triton.jit
def _offsets(n_cols, BLOCK: tl.constexpr):
    """(row, cols, mask) of this program: column block ``pid % blocks_per_row`` of row ``pid // blocks_per_row``."""
    pid = tl.program_id(0).to(tl.int64)
    blocks_per_row = tl.cdiv(n_cols, BLOCK)
    row = pid // blocks_per_row
    cols = (pid % blocks_per_row) * BLOCK + tl.arange(0, BLOCK)
    return row, cols, cols < n_cols


@triton.jit
def _sigmoid(g):
    return tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + tl.exp(-g))


SILU, GELU_TANH, GELU = 0, 1, 2  # ACT
SQRT_2_OVER_PI = tl.constexpr(0.7978845608028654)
GELU_TANH_CUBIC = tl.constexpr(0.044715)
INV_SQRT_2 = tl.constexpr(0.7071067811865476)
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _act_and_slope(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32. SiLU: g s, s (1 + g (1 - s)), s = sigmoid(g). GELU's tanh form: 0.5 g (1 +
    tanh(a)) = g sigmoid(2a), a = sqrt(2 / pi) (g + 0.044715 g^3) -- written with the sigmoid, no 1 + tanh to cancel
    where g is very negative; its slope s + 2 g s (1 - s) a', with 1 - s = sigmoid(-2a) from the same exponential (not
    a difference that cancels as s -> 1). Exact GELU: g Phi(g), slope Phi(g) + g phi(g)."""
    if ACT == 0:
        s = _sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    elif ACT == 1:
        a2 = 2.0 * SQRT_2_OVER_PI * (g + GELU_TANH_CUBIC * g * g * g)
        e = tl.exp(-tl.abs(a2))
        r = tl.math.div_rn(tl.full(g.shape, 1.0, tl.float32), 1.0 + e)
        s = tl.where(a2 >= 0, r, e * r)  # sigmoid(a2)
        s_neg = tl.where(a2 >= 0, e * r, r)  # sigmoid(-a2) = 1 - s
        da2 = 2.0 * SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_TANH_CUBIC * g * g)
        return g * s, s + g * s * s_neg * da2
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(g * INV_SQRT_2))
        return g * cdf, cdf + g * INV_SQRT_2PI * tl.exp(-0.5 * g * g)


@triton.jit
def _swiglu_fwd_kernel(
    gate_ptr, up_ptr, out_ptr, n_cols, stride_gr, stride_gc, stride_ur, stride_uc,
    ACT: tl.constexpr, BLOCK: tl.constexpr,
):
    row, cols, mask = _offsets(n_cols, BLOCK)
    g = tl.load(gate_ptr + row * stride_gr + cols * stride_gc, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(up_ptr + row * stride_ur + cols * stride_uc, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        out = g * _sigmoid(g) * u
    else:
        act, _ = _act_and_slope(g, ACT)
        out = act * u
    tl.store(out_ptr + row * n_cols + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n_cols,
    stride_dr, stride_dc, stride_gr, stride_gc, stride_ur, stride_uc,
    NEED_DGATE: tl.constexpr, NEED_DUP: tl.constexpr, ACT: tl.constexpr, BLOCK: tl.constexpr,
):
    row, cols, mask = _offsets(n_cols, BLOCK)
    dy = tl.load(dy_ptr + row * stride_dr + cols * stride_dc, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(gate_ptr + row * stride_gr + cols * stride_gc, mask=mask, other=0.0).to(tl.float32)
    act, slope = _act_and_slope(g, ACT)
    out_offsets = row * n_cols + cols
    if NEED_DGATE:
        u = tl.load(up_ptr + row * stride_ur + cols * stride_uc, mask=mask, other=0.0).to(tl.float32)
        dgate = dy * u * slope
        tl.store(dgate_ptr + out_offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    if NEED_DUP:
        dup = dy * act
        tl.store(dup_ptr + out_offsets, dup.to(dup_ptr.dtype.element_ty), mask=mask)


# ----------------------------------------------------------------------------- launchers


def _views(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], int, int, list[int]]:
    """(tensors to pass, n_rows, n_cols, [row stride, column stride] of each): flat (one row of every element) where
    all are contiguous, else (rows, last dim) views."""
    numel = tensors[0].numel()
    if all(t.is_contiguous() for t in tensors):
        return tensors, 1, numel, [s for _ in tensors for s in (numel, 1)]
    n_cols = tensors[0].shape[-1] if tensors[0].dim() else 1
    views = [t.reshape(-1, n_cols) for t in tensors]
    return views, numel // n_cols, n_cols, [s for t in views for s in t.stride()]


def _block(n_cols: int) -> int:
    return max(MIN_BLOCK, min(BLOCK, next_power_of_2(n_cols)))


def swiglu_forward(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype, act: int = SILU) -> torch.Tensor:
    """act(gate) * up (same shapes, any strides; ``act``: SILU, GELU_TANH or GELU) as a new contiguous tensor of
    ``out_dtype``."""
    out = torch.empty(gate.shape, dtype=out_dtype, device=gate.device)
    if out.numel() == 0:
        return out
    (g, u), n_rows, n_cols, strides = _views([gate, up])
    block = _block(n_cols)
    launch(_swiglu_fwd_kernel, (n_rows * cdiv(n_cols, block),), g, u, out, n_cols, *strides,
           ACT=act, BLOCK=block, num_warps=WARPS)
    return out


def swiglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, need_dgate: bool, need_dup: bool,
                    act: int = SILU) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dgate, dup) in gate's and up's dtypes (contiguous; None where not asked for) for the upstream ``grad``."""
    dgate = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device) if need_dgate else None
    dup = torch.empty(up.shape, dtype=up.dtype, device=up.device) if need_dup else None
    if gate.numel() == 0 or not (need_dgate or need_dup):
        return dgate, dup
    (d, g, u), n_rows, n_cols, strides = _views([grad, gate, up])
    block = _block(n_cols)
    launch(_swiglu_bwd_kernel, (n_rows * cdiv(n_cols, block),), d, g, u,
           dgate if dgate is not None else g, dup if dup is not None else g, n_cols, *strides,
           NEED_DGATE=need_dgate, NEED_DUP=need_dup, ACT=act, BLOCK=block, num_warps=WARPS)
    return dgate, dup
