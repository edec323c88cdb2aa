"""What the RMSNorm and LayerNorm ops (``ops/rms_norm.py``, ``ops/layer_norm.py``) share: the PyTorch reference of
forward and backward, output metadata, and the gradient bookkeeping of the fused residual add.

Both ops normalize h over its last dims (N elements per row), where h = input + residual when a residual is given
(rounded to the promoted dtype, as torch's add) and h = input otherwise; the forward returns (y, h, stats), h an empty
placeholder without a residual, stats fp32 per row (fp64 where an fp64 tensor is involved): rstd (rows,) for RMSNorm,
mean and rstd (2, rows) for LayerNorm. Backward saves h (the input, or the new residual, which the caller holds
anyway), the weight and the stats.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusedlayers.backend import use_triton


def accumulator(*dtypes: torch.dtype | None) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def dtypes_of(*tensors: Tensor | None) -> tuple[torch.dtype, ...]:
    return tuple(t.dtype for t in tensors if t is not None)


def run_kernel(x: Tensor, *tensors: Tensor | None) -> bool:
    """The Triton kernels (fp32 math) for fp16/bf16/fp32 on the triton backend; float64 runs the reference, and so
    do empty tensors (nothing to compute)."""
    return x.numel() > 0 and torch.float64 not in dtypes_of(x, *tensors) and use_triton(x)


def h_dtype(input: Tensor, residual: Tensor | None) -> torch.dtype:
    return input.dtype if residual is None else torch.promote_types(input.dtype, residual.dtype)


def rows_of(input: Tensor, normalized_shape) -> tuple[int, int]:
    """(rows, N): the number of rows and the elements per row (the normalized dims)."""
    n_cols = math.prod(normalized_shape)
    rows = math.prod(input.shape[: input.dim() - len(normalized_shape)])
    return rows, n_cols


def empty_outputs(input: Tensor, normalized_shape, residual: Tensor | None, out_dtype: torch.dtype | None,
                  stats_rows: int, *params: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
    """(y, h, stats) of the right shapes and dtypes (the fake impls' answer; the reference and kernels agree)."""
    hd = h_dtype(input, residual)
    rows, _ = rows_of(input, normalized_shape)
    y = input.new_empty(input.shape, dtype=out_dtype or hd)
    h = input.new_empty(input.shape, dtype=hd) if residual is not None else input.new_empty((0,))
    acc = accumulator(input.dtype, *dtypes_of(residual, *params))
    stats = input.new_empty((rows,) if stats_rows == 1 else (stats_rows, rows), dtype=acc)
    return y, h, stats


# ----------------------------------------------------------------------------- reference (PyTorch)


def add_residual(input: Tensor, residual: Tensor | None) -> Tensor:
    """h = input + residual in the promoted dtype, as torch's add rounds it (summed in fp32 for 16-bit)."""
    if residual is None:
        return input
    acc = accumulator(input.dtype, residual.dtype)
    return (input.to(acc) + residual.to(acc)).to(h_dtype(input, residual))


def norm_forward_reference(input: Tensor, normalized_shape, weight: Tensor | None, bias: Tensor | None,
                           residual: Tensor | None, eps: float, out_dtype: torch.dtype | None, rms: bool
                           ) -> tuple[Tensor, Tensor, Tensor]:
    """(y, h, stats) in PyTorch; math in fp32 (fp64 where any tensor is fp64)."""
    h = add_residual(input, residual)
    rows, n_cols = rows_of(input, normalized_shape)
    acc = accumulator(input.dtype, *dtypes_of(residual, weight, bias))
    hf = h.reshape(rows, n_cols).to(acc)
    if rms:
        rstd = torch.rsqrt(hf.square().mean(-1) + eps)
        y = hf * rstd[:, None]
        stats = rstd
    else:
        mean = hf.mean(-1)
        centered = hf - mean[:, None]
        rstd = torch.rsqrt(centered.square().mean(-1) + eps)
        y = centered * rstd[:, None]
        stats = torch.stack([mean, rstd])
    if weight is not None:
        y = y * weight.reshape(n_cols).to(acc)
    if bias is not None:
        y = y + bias.reshape(n_cols).to(acc)
    # written into a tensor of the input's shape, not returned as a reshaped view: a view among a multi-output
    # function's outputs could not be modified in place, and nn.LayerNorm's output can (XLM scales it in place)
    out = torch.empty(input.shape, dtype=out_dtype or h.dtype, device=input.device)
    out.view(rows, n_cols).copy_(y)
    y = out
    h_out = h.contiguous() if residual is not None else input.new_empty((0,))
    if n_cols == 0:
        stats = stats.zero_()
    return y, h_out, stats


def norm_backward_reference(grad: Tensor, x: Tensor, normalized_shape, weight: Tensor | None, stats: Tensor,
                            grad_residual: Tensor | None, dx_dtype: torch.dtype, bias_dtype: torch.dtype | None,
                            need_dx: bool, need_dw: bool, need_db: bool, rms: bool
                            ) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
    """(dx, dw, db) in PyTorch (None where not needed); dw and db in the parameters' dtypes and shapes."""
    rows, n_cols = rows_of(x, normalized_shape)
    acc = accumulator(grad.dtype, x.dtype, stats.dtype, *dtypes_of(weight, grad_residual))
    xf = x.reshape(rows, n_cols).to(acc)
    dy = grad.reshape(rows, n_cols).to(acc)
    stats = stats.to(acc)
    if rms:
        rstd = stats
        xhat = xf * rstd[:, None]
    else:
        mean, rstd = stats[0], stats[1]
        xhat = (xf - mean[:, None]) * rstd[:, None]
    dx = dw = db = None
    if need_dx:
        wdy = dy * weight.reshape(n_cols).to(acc) if weight is not None else dy
        dxf = wdy - xhat * (xhat * wdy).mean(-1, keepdim=True) if n_cols else wdy
        if not rms and n_cols:
            dxf = dxf - wdy.mean(-1, keepdim=True)
        dxf = dxf * rstd[:, None]
        if grad_residual is not None:
            dxf = dxf + grad_residual.reshape(rows, n_cols).to(acc)
        dx = dxf.to(dx_dtype).reshape(x.shape)
    if need_dw:
        dw = (dy * xhat).sum(0).to(weight.dtype).reshape(weight.shape)
    if need_db:
        db = dy.sum(0).to(bias_dtype).reshape(normalized_shape)
    return dx, dw, db


# ----------------------------------------------------------------------------- autograd bookkeeping


def save_forward(ctx, input: Tensor, weight: Tensor | None, residual: Tensor | None, output: tuple) -> None:
    """Save what the backward reads: the normalized tensor (the input, or h with a residual), weight and stats."""
    _, h, stats = output
    ctx.mark_non_differentiable(stats)
    if residual is None:
        ctx.mark_non_differentiable(h)
    ctx.has_residual = residual is not None
    ctx.input_dtype = input.dtype
    ctx.residual_dtype = residual.dtype if residual is not None else None
    ctx.save_for_backward(h if residual is not None else input, weight, stats)


def grad_plan(ctx, input_index: int, residual_index: int) -> tuple[bool, bool, torch.dtype]:
    """(gradient of the input needed, of the residual needed, dtype the backward op writes dh in)."""
    need_input = ctx.needs_input_grad[input_index]
    need_residual = ctx.has_residual and ctx.needs_input_grad[residual_index]
    if need_input and need_residual and ctx.input_dtype != ctx.residual_dtype:
        dtype = torch.promote_types(ctx.input_dtype, ctx.residual_dtype)  # h's: both casts lose nothing first
    else:
        dtype = ctx.input_dtype if need_input else ctx.residual_dtype or ctx.input_dtype
    return need_input, need_residual, dtype


def second_dx_dtype(ctx, need_input: bool, need_residual: bool, dx_dtype: torch.dtype) -> torch.dtype | None:
    """The input's dtype where both gradients are needed and dh comes in the residual's (promoted) dtype: the backward
    op then writes dh in the input's dtype too (e.g. the bf16 output of a matmul added to an fp32 residual stream)."""
    if need_input and need_residual and ctx.input_dtype != dx_dtype and ctx.residual_dtype == dx_dtype:
        return ctx.input_dtype
    return None


def empty_second_dx(x: Tensor, need_dx: bool, input_dtype: torch.dtype | None) -> Tensor:
    return x.new_empty(x.shape, dtype=input_dtype) if need_dx and input_dtype is not None else x.new_empty((0,))


def split_dh(dh: Tensor | None, ctx, need_input: bool, need_residual: bool, dh_input: Tensor | None = None
             ) -> tuple[Tensor | None, Tensor | None]:
    """dh (the gradient of h = input + residual) as the input's and the residual's gradients; ``dh_input``: dh already
    in the input's dtype."""
    grad_input = (dh_input if dh_input is not None else _as(dh, ctx.input_dtype)) if need_input else None
    grad_residual = _as(dh, ctx.residual_dtype) if need_residual else None
    return grad_input, grad_residual


def empty_grads(x: Tensor, weight: Tensor | None, normalized_shape, dx_dtype: torch.dtype,
                bias_dtype: torch.dtype | None, need_dx: bool, need_dw: bool, need_db: bool
                ) -> tuple[Tensor, Tensor, Tensor]:
    """The backward ops' outputs: fresh empty (0,) tensors for gradients not asked for (outputs may not alias)."""
    def none():
        return x.new_empty((0,))

    return (x.new_empty(x.shape, dtype=dx_dtype) if need_dx else none(),
            weight.new_empty(weight.shape) if need_dw else none(),
            x.new_empty(tuple(normalized_shape), dtype=bias_dtype) if need_db else none())


def _as(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, skipping the call where it would return t (host time: the backward runs per layer)."""
    return t if t.dtype == dtype else t.to(dtype)


def or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return t if t is not None else like.new_empty((0,))


# ----------------------------------------------------------------------------- autocast

# torch runs layer_norm in fp32 under CUDA autocast (on its fp32 list), and rms_norm too from torch 2.12 (before, it
# left rms_norm alone; ops/rms_norm.py follows the torch it runs with); CPU autocast leaves both alone. Casting the
# input to fp32 would copy it; the kernels read 16-bit input and compute in fp32 anyway, so the autocast rule only
# asks the op for an fp32 output: the same values and dtypes as torch's, and the same gradients (the input's in its
# own dtype, as through torch's cast). The weight and bias are not cast either (their gradients come back in their
# dtypes, as through a cast). With a residual, the add runs in the tensors' own dtypes, as
# ``F.rms_norm(input + residual)`` does under autocast.
AUTOCAST_DEVICE = "cuda"


def autocast_out_dtype(input: Tensor, residual: Tensor | None, out_dtype: torch.dtype | None) -> torch.dtype | None:
    if out_dtype is None and input.device.type == AUTOCAST_DEVICE and h_dtype(input, residual) != torch.float64:
        return torch.float32
    return out_dtype
