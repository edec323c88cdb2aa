"""Fake-quantization ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, CPU reference.

Ops (``fusedlayers.functional`` validates input and calls them):

- ``fake_quantize(x, scale, zero_point, quant_min, quant_max, axis, group_size, grad_factor) -> (y, mask)``:
  affine fake quantization with given qparams: per tensor (axis None, group_size 0), per channel along
  ``axis``, or per group of ``group_size`` consecutive elements of the last dim (scale of shape
  ``(*x.shape[:-1], x.shape[-1] // group_size)``); ``mask`` is the straight-through mask, bit-packed (see
  ``pack_mask``), not differentiable. Gradient: the straight-through estimator with the clipping mask for x
  (only the packed mask is saved: 1/8 byte per element); when scale / zero_point require grad, LSQ's
  gradients for them (and for x the mask of torch's learnable op; x and the qparams are saved).
- ``fake_quantize_backward(grad, mask, axis, group_size)``: the STE gradient ``grad * mask``. Linear in grad,
  so differentiable (double backward).
- ``fake_quantize_lsq_backward(grad, x, scale, zero_point, ...) -> (dx, dqparams)``: LSQ's gradients in one
  pass over x, ``dqparams`` = (dscale, dzero_point) flat and stacked, in the accumulation dtype; the kernel
  writes partial sums of both, finished by one small reduction.
- ``fake_quantize_dynamic(x, quant_min, quant_max, group_size, symmetric)``: qparams computed from each
  group's (row's, for per-token) min/max in the same kernel; returns (y, scale, zero_point, mask); gradient
  STE from the mask.

Numerics are torch's: fp32 ``inv = 1 / scale``, ``q = round_half_even(x * inv) + zero_point``, the STE mask
``quant_min <= q <= quant_max`` taken before clipping, ``y = (clip(q) - zero_point) * scale`` rounded to fp32
and then to x's dtype. torch's LSQ backward rounds differently (``ROUND_*`` in
``fusedlayers.kernels.fake_quantize``): on CPU ``rint(z + x * inv)``, fused into an fma or not depending on
the CPU kernel torch dispatches to, on CUDA ``rint(x * inv) + z``; the LSQ backward follows torch's kernel
for the device of x, so its mask and per-element terms are torch's on that device. Each op body picks the
Triton kernel or the PyTorch reference through ``fusedlayers.backend``; float64 always runs the reference.
"""

from __future__ import annotations

import functools
import math

import torch
from torch import Tensor

from fusedlayers.backend import use_triton
from fusedlayers.ops._eager import call, custom_op, register_autograd

try:
    from fusedlayers.kernels import fake_quantize as kernels
except ImportError:  # no Triton: the reference runs everywhere
    kernels = None

PER_TENSOR, PER_ROW, PER_COL = 0, 1, 2
ROUND_AFTER, ROUND_FMA, ROUND_INSIDE = 0, 1, 2
EPS = torch.finfo(torch.float32).eps


# ----------------------------------------------------------------------------- helpers


def layout(shape: torch.Size | tuple[int, ...], axis: int | None, group_size: int) -> tuple[int, int, int, int]:
    """The kernels' 2-D view of a contiguous tensor of ``shape``: (M rows, N cols, C qparams, qp_mode)."""
    numel = math.prod(shape)
    if group_size:
        rows = numel // group_size
        return rows, group_size, max(rows, 1), PER_ROW
    if axis is None:
        return 1, numel, 1, PER_TENSOR
    outer, channels, inner = math.prod(shape[:axis]), shape[axis], math.prod(shape[axis + 1:])
    if inner == 1:
        return outer, channels, channels, PER_COL
    return outer * channels, inner, channels, PER_ROW


def forward_round_mode(x: Tensor, axis: int | None, group_size: int) -> int:
    """How torch's forward kernels round: ``rint(x * inv) + z``, per tensor and per channel, on CPU and on
    CUDA (measured against torch 2.11 on an H200 and torch 2.13 on CPU, on data full of near-.5 ties)."""
    return ROUND_AFTER


@functools.cache
def _cpu_lsq_round_mode() -> int:
    """torch's CPU LSQ backward computes rint(z + x * inv); whether the compiler fused the multiply-add
    depends on the CPU kernel torch dispatches to (its AVX2/AVX512 builds fuse, its default build does
    not). Ask torch once with an input on which the two disagree."""
    x = torch.tensor([1085126173], dtype=torch.int32).view(torch.float32).reshape(1, 1)
    scale = torch.tensor([1051938979], dtype=torch.int32).view(torch.float32)
    dx, _, _ = torch.ops.aten._fake_quantize_learnable_per_channel_affine_backward(
        torch.ones_like(x), x, scale, torch.tensor([4.0]), 0, -19, 19, 1.0)
    return ROUND_FMA if dx.item() == 1.0 else ROUND_INSIDE


def lsq_round_mode(x: Tensor) -> int:
    """How torch's LSQ backward on x's device rounds: z after rounding on CUDA, inside on CPU."""
    return ROUND_AFTER if x.is_cuda else _cpu_lsq_round_mode()


def forward_zero_point(zero_point: Tensor, quant_min: int, quant_max: int) -> Tensor:
    """The zero point the forward uses, as fp32: a floating one rounded half to even and clamped (as
    torch's learnable ops do), an integer one as is."""
    if zero_point.is_floating_point():
        return torch.round(zero_point.float()).clamp(quant_min, quant_max)
    return zero_point.float()


def lsq_zero_point(zero_point: Tensor, quant_min: int, quant_max: int, per_tensor: bool) -> Tensor:
    """The zero point torch's LSQ backward uses: per tensor trunc(clamp(z + 0.5)), per channel
    clamp(round(z))."""
    if not zero_point.is_floating_point():
        return zero_point.float()
    if per_tensor:
        return (zero_point.float() + 0.5).clamp(quant_min, quant_max).trunc()
    return torch.round(zero_point.float()).clamp(quant_min, quant_max)


def _run_kernel(x: Tensor, *dtypes: torch.dtype) -> bool:
    return kernels is not None and torch.float64 not in (x.dtype, *dtypes) and use_triton(x)


def _qparam_shape(x_shape, axis: int | None, group_size: int) -> list[int]:
    """Shape that broadcasts qparams against x (viewed as (..., groups, group_size) for groups)."""
    if group_size:
        return [*x_shape[:-1], x_shape[-1] // group_size, 1]
    if axis is None:
        return []
    shape = [1] * len(x_shape)
    shape[axis] = x_shape[axis]
    return shape


def _grouped(x: Tensor, group_size: int) -> Tensor:
    return x.reshape(*x.shape[:-1], x.shape[-1] // group_size, group_size) if group_size else x


def mask_shape(shape, axis: int | None, group_size: int) -> tuple[int, int]:
    """Shape of the packed mask of a tensor of ``shape``: a byte per 8 columns of each row of its 2-D view."""
    M, N, _, _ = layout(shape, axis, group_size)
    return M, (N + 7) // 8


def pack_mask(keep: Tensor, shape, axis: int | None, group_size: int) -> Tensor:
    """Bit-pack a bool mask (in x's shape or its grouped view): row r of the kernels' (M, N) view takes
    ``cdiv(N, 8)`` bytes, bit k of byte j is column ``8 * j + k`` (the padding bits 0). As the kernels write it."""
    M, N, _, _ = layout(shape, axis, group_size)
    rows = keep.reshape(M, N).to(torch.uint8)
    rows = torch.nn.functional.pad(rows, (0, (-N) % 8)).reshape(M, (N + 7) // 8, 8)
    weights = torch.tensor([1 << k for k in range(8)], dtype=torch.uint8, device=keep.device)
    return (rows * weights).sum(-1, dtype=torch.uint8)


def unpack_mask(mask: Tensor, shape, axis: int | None, group_size: int) -> Tensor:
    """The bool mask in ``shape`` from its packed form."""
    M, N, _, _ = layout(shape, axis, group_size)
    shifts = torch.arange(8, dtype=torch.uint8, device=mask.device)
    bits = (mask.reshape(M, (N + 7) // 8, 1) >> shifts) & 1
    return bits.reshape(M, -1)[:, :N].reshape(shape).bool()


def _reduce_to(t: Tensor, x_shape, axis: int | None, group_size: int) -> Tensor:
    """Sum per-element LSQ terms (broadcast shape) to one value per qparam (flat)."""
    if group_size:
        return t.sum(-1).reshape(-1)
    if axis is None:
        return t.sum().reshape(1)
    dims = [d for d in range(len(x_shape)) if d != axis]
    return (t.sum(dims) if dims else t).reshape(-1)


# ----------------------------------------------------------------------------- reference (PyTorch)


def round_reference(x: Tensor, inv: Tensor, z: Tensor, mode: int) -> Tensor:
    """The unclipped quantized value, rounded half to even where ``mode`` says the zero point enters."""
    if mode == ROUND_AFTER:
        q = torch.round(x * inv) + z
    elif mode == ROUND_INSIDE or x.dtype == torch.float64:
        q = torch.round(x * inv + z)
    else:  # ROUND_FMA in fp32: the product is exact in fp64, so x * inv + z rounds once to fp32
        q = torch.round((x.double() * inv.double() + z.double()).to(x.dtype))
    return torch.where(torch.isnan(q), float("-inf"), q)


def _reference_terms(x: Tensor, scale: Tensor, z: Tensor, quant_min: int, quant_max: int,
                     axis: int | None, group_size: int, mode: int):
    acc = torch.float64 if torch.float64 in (x.dtype, scale.dtype) else torch.float32
    shape = _qparam_shape(x.shape, axis, group_size)
    s = scale.to(acc).reshape(shape)
    z = z.to(acc).reshape(shape)
    inv = 1.0 / s
    xv = _grouped(x.to(acc), group_size)
    q = round_reference(xv, inv, z, mode)
    keep = (q >= quant_min) & (q <= quant_max)
    qc = q.clamp(quant_min, quant_max)
    return xv, s, inv, z, q, qc, keep


def fake_quantize_with_mask_reference(x: Tensor, scale: Tensor, z: Tensor, quant_min: int, quant_max: int,
                                      axis: int | None, group_size: int, mode: int) -> tuple[Tensor, Tensor]:
    """Fake quantization in PyTorch and its packed STE mask; ``z`` is the (already rounded) zero point."""
    _, s, _, z, _, qc, keep = _reference_terms(x, scale, z, quant_min, quant_max, axis, group_size, mode)
    y = ((qc - z) * s).to(x.dtype).reshape(x.shape).contiguous()
    return y, pack_mask(keep, x.shape, axis, group_size)


def fake_quantize_reference(x: Tensor, scale: Tensor, z: Tensor, quant_min: int, quant_max: int,
                            axis: int | None, group_size: int, mode: int) -> Tensor:
    return fake_quantize_with_mask_reference(x, scale, z, quant_min, quant_max, axis, group_size, mode)[0]


def ste_backward_reference(grad: Tensor, mask: Tensor, axis: int | None, group_size: int) -> Tensor:
    acc = torch.float64 if grad.dtype == torch.float64 else torch.float32
    keep = unpack_mask(mask, grad.shape, axis, group_size)
    return (grad.to(acc) * keep.to(acc)).to(grad.dtype).contiguous()


def lsq_backward_reference(grad: Tensor, x: Tensor, scale: Tensor, z: Tensor, quant_min: int, quant_max: int,
                           axis: int | None, group_size: int, grad_factor: float, mode: int):
    """(dx, dscale, dzero_point) of LSQ, per element in torch's order of operations, then summed; the
    qparam gradients flat and in the accumulation dtype."""
    xv, s, inv, z, q, qc, keep = _reference_terms(x, scale, z, quant_min, quant_max, axis, group_size, mode)
    g = _grouped(grad.to(xv.dtype), group_size)
    dx = (g * keep.to(xv.dtype)).to(x.dtype).reshape(x.shape).contiguous()
    xfq = (qc - z) * s
    d_in = g * (xfq - xv) * inv
    d_out = torch.where(q < quant_min, g * (quant_min - z), g * (quant_max - z))
    ds = torch.where(keep, d_in, d_out) * grad_factor
    dz = torch.where(keep, torch.zeros_like(g), g * -1.0 * s) * grad_factor
    return dx, _reduce_to(ds, x.shape, axis, group_size), _reduce_to(dz, x.shape, axis, group_size)


def dynamic_qparams_reference(x: Tensor, quant_min: int, quant_max: int, group_size: int, symmetric: bool):
    """torchao's choose_qparams (per token asymmetric / per group symmetric) in fp32, per group of the last
    dim: (scale, zero_point) of shape (*x.shape[:-1], x.shape[-1] // group_size). Divisions are IEEE (as torch
    on CPU computes torchao's formulas; on CUDA torch would multiply by 1 / (qmax - qmin), an ulp apart)."""
    xg = _grouped(x.float(), group_size)
    mn = torch.clamp(xg.amin(-1), max=0.0)
    mx = torch.clamp(xg.amax(-1), min=0.0)
    # IEEE division by a tensor: torch's CUDA division by a Python scalar multiplies by its reciprocal instead
    if symmetric:
        scale = torch.clamp(torch.maximum(-mn, mx) / torch.full_like(mn, float(quant_max - quant_min) / 2), min=EPS)
        return scale, torch.zeros_like(scale)
    scale = torch.clamp((mx - mn) / torch.full_like(mn, float(quant_max - quant_min)), min=EPS)
    dmin, dmax = mn / scale, mx / scale
    zf = torch.where((quant_min + dmin) + (quant_max + dmax) > 0, quant_min - dmin, quant_max - dmax)
    return scale, torch.clamp(zf, quant_min, quant_max).round()


# ----------------------------------------------------------------------------- fake_quantize


def _kernel_zero_point(zero_point: Tensor) -> Tensor:
    """The zero point as the kernels load it: integer, or fp32 (they round and clamp it themselves)."""
    return zero_point.float() if zero_point.is_floating_point() else zero_point


@custom_op("fusedlayers::fake_quantize")
def fake_quantize(x: Tensor, scale: Tensor, zero_point: Tensor, quant_min: int, quant_max: int,
                  axis: int | None, group_size: int, grad_factor: float) -> tuple[Tensor, Tensor]:
    mode = forward_round_mode(x, axis, group_size)
    if _run_kernel(x, scale.dtype):
        return kernels.fake_quantize_forward(x, scale.float(), _kernel_zero_point(zero_point), quant_min, quant_max,
                                             layout(x.shape, axis, group_size), mode)
    z = forward_zero_point(zero_point, quant_min, quant_max)
    return fake_quantize_with_mask_reference(x, scale, z, quant_min, quant_max, axis, group_size, mode)


@fake_quantize.register_fake
def _(x, scale, zero_point, quant_min, quant_max, axis, group_size, grad_factor):
    return x.new_empty(x.shape), x.new_empty(mask_shape(x.shape, axis, group_size), dtype=torch.uint8)


def _fq_setup_context(ctx, inputs, output):
    x, scale, zero_point, quant_min, quant_max, axis, group_size, grad_factor = inputs
    _, mask = output
    ctx.mark_non_differentiable(mask)
    ctx.set_materialize_grads(False)  # no zeros made for the mask's gradient (a kernel per call)
    ctx.args = (quant_min, quant_max, axis, group_size)
    ctx.grad_factor = grad_factor
    ctx.lsq = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    if ctx.lsq:  # LSQ's qparam gradients need x itself
        ctx.save_for_backward(x, scale, zero_point)
    else:  # the straight-through estimator needs the mask only
        ctx.save_for_backward(mask)


def _fq_autograd(ctx, grad, _grad_mask):
    need_x, need_scale, need_zp = ctx.needs_input_grad[:3]
    dx = dscale = dzp = None
    if grad is None:  # y did not reach the loss
        return dx, dscale, dzp, None, None, None, None, None
    if ctx.lsq:
        x, scale, zero_point = ctx.saved_tensors
        dx, dq = call(fake_quantize_lsq_backward, grad, x, scale, zero_point, *ctx.args, ctx.grad_factor)
        zp_dtype = zero_point.dtype if zero_point.is_floating_point() else torch.float32
        dx = dx if need_x else None
        dscale = _like(dq[0], scale.dtype, scale.shape) if need_scale else None
        dzp = _like(dq[1], zp_dtype, zero_point.shape) if need_zp else None
    elif need_x:
        (mask,) = ctx.saved_tensors
        dx = call(fake_quantize_backward, grad, mask, *ctx.args[2:])
    return dx, dscale, dzp, None, None, None, None, None


def _like(t: Tensor, dtype: torch.dtype, shape) -> Tensor:
    """t in dtype and shape, skipping the no-op conversions (each a few microseconds of host time)."""
    t = t if t.dtype == dtype else t.to(dtype)
    return t if t.shape == shape else t.reshape(shape)


register_autograd(fake_quantize, _fq_autograd, _fq_setup_context)


# ----------------------------------------------------------------------------- STE backward


@custom_op("fusedlayers::fake_quantize_backward")
def fake_quantize_backward(grad: Tensor, mask: Tensor, axis: int | None, group_size: int) -> Tensor:
    if _run_kernel(grad):
        M, N, _, _ = layout(grad.shape, axis, group_size)
        return kernels.fake_quantize_ste_backward(grad, mask, M, N)
    return ste_backward_reference(grad, mask, axis, group_size)


@fake_quantize_backward.register_fake
def _(grad, mask, axis, group_size):
    return grad.new_empty(grad.shape)


def _bwd_setup_context(ctx, inputs, output):
    _, mask, axis, group_size = inputs
    ctx.args = (axis, group_size)
    ctx.save_for_backward(mask)


def _bwd_autograd(ctx, v):
    """dx = grad * mask is linear in grad: its gradient w.r.t. grad is v * mask."""
    (mask,) = ctx.saved_tensors
    d_grad = call(fake_quantize_backward, v, mask, *ctx.args) if ctx.needs_input_grad[0] else None
    return d_grad, None, None, None


register_autograd(fake_quantize_backward, _bwd_autograd, _bwd_setup_context)


# ----------------------------------------------------------------------------- LSQ backward


@custom_op("fusedlayers::fake_quantize_lsq_backward")
def fake_quantize_lsq_backward(grad: Tensor, x: Tensor, scale: Tensor, zero_point: Tensor, quant_min: int,
                               quant_max: int, axis: int | None, group_size: int,
                               grad_factor: float) -> tuple[Tensor, Tensor]:
    mode = lsq_round_mode(x)
    if _run_kernel(x, scale.dtype, grad.dtype):
        return kernels.fake_quantize_lsq_backward(grad, x, scale.float(), _kernel_zero_point(zero_point), quant_min,
                                                  quant_max, layout(x.shape, axis, group_size), mode, grad_factor)
    z = lsq_zero_point(zero_point, quant_min, quant_max, per_tensor=axis is None and not group_size)
    dx, dscale, dzp = lsq_backward_reference(grad, x, scale, z, quant_min, quant_max, axis, group_size, grad_factor,
                                             mode)
    return dx, torch.stack([dscale, dzp])


@fake_quantize_lsq_backward.register_fake
def _(grad, x, scale, zero_point, quant_min, quant_max, axis, group_size, grad_factor):
    acc = torch.float64 if torch.float64 in (x.dtype, scale.dtype) else torch.float32
    return x.new_empty(x.shape), x.new_empty((2, scale.numel()), dtype=acc)


# ----------------------------------------------------------------------------- dynamic qparams


@custom_op("fusedlayers::fake_quantize_dynamic")
def fake_quantize_dynamic(x: Tensor, quant_min: int, quant_max: int, group_size: int,
                          symmetric: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    qshape = (*x.shape[:-1], x.shape[-1] // group_size)
    if _run_kernel(x):
        y, scale, z, mask = kernels.fake_quantize_dynamic_forward(x, quant_min, quant_max, group_size, symmetric,
                                                                  EPS)
        return y, scale.reshape(qshape), z.reshape(qshape), mask
    if x.numel() == 0:
        empty = torch.empty(qshape, dtype=torch.float32, device=x.device)
        mask = torch.empty(mask_shape(x.shape, None, group_size), dtype=torch.uint8, device=x.device)
        return torch.empty(x.shape, dtype=x.dtype, device=x.device), empty, empty.clone(), mask
    scale, z = dynamic_qparams_reference(x, quant_min, quant_max, group_size, symmetric)
    y, mask = fake_quantize_with_mask_reference(x, scale, z, quant_min, quant_max, None, group_size, ROUND_AFTER)
    return y, scale, z, mask


@fake_quantize_dynamic.register_fake
def _(x, quant_min, quant_max, group_size, symmetric):
    qshape = (*x.shape[:-1], x.shape[-1] // group_size)
    return (x.new_empty(x.shape), x.new_empty(qshape, dtype=torch.float32), x.new_empty(qshape, dtype=torch.float32),
            x.new_empty(mask_shape(x.shape, None, group_size), dtype=torch.uint8))


def _dyn_setup_context(ctx, inputs, output):
    x, quant_min, quant_max, group_size, _ = inputs
    _, scale, zero_point, mask = output
    ctx.group_size = group_size
    ctx.mark_non_differentiable(scale, zero_point, mask)
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(mask)


def _dyn_autograd(ctx, grad, grad_scale, grad_zp, grad_mask):
    """STE: the qparams are treated as constants (as torchao's fake quantizers do)."""
    (mask,) = ctx.saved_tensors
    dx = call(fake_quantize_backward, grad, mask, None, ctx.group_size) if grad is not None else None
    return dx, None, None, None, None


register_autograd(fake_quantize_dynamic, _dyn_autograd, _dyn_setup_context)
