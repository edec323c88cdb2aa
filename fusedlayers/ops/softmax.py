"""Softmax ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, autocast, CPU reference.

Ops (``fusedlayers.functional`` validates input):

- ``softmax(x, dim, dtype)``: softmax of x over ``dim``, written in ``dtype`` (x's dtype when None).
- ``scaled_masked_softmax(scores, scale, attn_mask, is_causal)``: softmax(scores * scale + mask) over the
  last dim; rows with every entry masked give zeros.
- ``softmax_backward(grad, out, dim, scale, input_dtype)``: scale * out * (grad - sum(grad * out, dim)),
  the gradient of both; an op of its own so torch.compile traces forward and backward without a graph
  break, and differentiable itself (double backward).

Every output is a new contiguous tensor, whatever the layout of the inputs and the dim, as torch's
``_softmax`` / ``_softmax_backward_data`` give (their meta functions allocate
LEGACY_CONTIGUOUS_MEMORY_FORMAT, on CPU and CUDA alike). A dim other than the last runs the strided
kernels, which read and write (outer, dim, inner) views in place: no transposed copy.

Each op body picks the Triton kernel or the PyTorch reference through ``fusedlayers.backend``.
float64 always runs the reference (the kernels accumulate in fp32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers.backend import use_triton
from fusedlayers.ops._eager import call, custom_op, register_autograd

try:
    from fusedlayers.kernels import softmax as kernels
except ImportError:  # no Triton (macOS, Windows): the reference runs everywhere
    kernels = None


def _accumulator(*dtypes: torch.dtype) -> torch.dtype:
    return torch.float64 if torch.float64 in dtypes else torch.float32


def _run_kernel(x: Tensor, *dtypes: torch.dtype) -> bool:
    return torch.float64 not in dtypes and use_triton(x)


# ----------------------------------------------------------------------------- reference (PyTorch)


def _contiguous_strides(shape) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))


def as_contiguous(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t`` in ``dtype`` with torch's contiguous strides, those of ``torch.empty(t.shape)`` (size-1 dims included,
    which ``Tensor.contiguous`` leaves as they are): the layout torch's softmax ops give. No copy beyond the cast
    where t has them."""
    if t.stride() == _contiguous_strides(t.shape):
        return t.to(dtype)
    return torch.empty(t.shape, dtype=dtype, device=t.device).copy_(t)


def softmax_rows_reference(z: Tensor, zero_empty_rows: bool, dim: int = -1) -> Tensor:
    """Softmax over ``dim`` of ``z`` in z's dtype, max-subtracted, in three passes."""
    row_max = z.amax(dim, keepdim=True)
    if zero_empty_rows:
        row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)
    e = torch.exp(z - row_max)
    denom = e.sum(dim, keepdim=True)
    if zero_empty_rows:
        denom = denom.masked_fill(denom == 0, 1.0)
    return e / denom


def causal_keep(q_len: int, k_len: int, device) -> Tensor:
    """Bool (q_len, k_len), True where key j <= query i (top-left aligned, as SDPA)."""
    return torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()


def scaled_masked_scores_reference(
    scores: Tensor, scale: float, attn_mask: Tensor | None, is_causal: bool, acc: torch.dtype
) -> Tensor:
    """scores * scale with the masks applied (-inf where masked), in ``acc``."""
    z = scores.to(acc) * scale
    if is_causal:
        z = z.masked_fill(~causal_keep(z.shape[-2], z.shape[-1], z.device), float("-inf"))
    if attn_mask is not None:
        if attn_mask.dtype == torch.bool:
            z = z.masked_fill(~attn_mask, float("-inf"))
        else:
            z = z + attn_mask.to(acc)
    return z


def softmax_backward_reference(grad: Tensor, out: Tensor, scale: float, acc: torch.dtype, dim: int = -1) -> Tensor:
    g, y = grad.to(acc), out.to(acc)
    return scale * y * (g - (g * y).sum(dim, keepdim=True))


# ----------------------------------------------------------------------------- softmax


@custom_op("fusedlayers::softmax")
def softmax(x: Tensor, dim: int, dtype: torch.dtype | None) -> Tensor:
    out_dtype = dtype or x.dtype
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if _run_kernel(x, x.dtype, out_dtype):
        if x.dim() == 0:
            return kernels.softmax_forward(x.reshape(1), out_dtype).reshape(())
        return kernels.softmax_forward(x, out_dtype, dim=dim)
    z = x.to(_accumulator(x.dtype, out_dtype))
    return as_contiguous(softmax_rows_reference(z, zero_empty_rows=False, dim=dim), out_dtype)


@softmax.register_fake
def _(x, dim, dtype):
    return x.new_empty(x.shape, dtype=dtype or x.dtype)  # contiguous, as the op's output


def _softmax_setup_context(ctx, inputs, output):
    x, dim, _ = inputs
    ctx.input_dtype = x.dtype
    ctx.dim = dim
    ctx.save_for_backward(output)


def _softmax_autograd(ctx, grad):
    (out,) = ctx.saved_tensors
    return call(softmax_backward, grad, out, ctx.dim, 1.0, ctx.input_dtype), None, None


register_autograd(softmax, _softmax_autograd, _softmax_setup_context)


# ----------------------------------------------------------------------------- scaled masked softmax


@custom_op("fusedlayers::scaled_masked_softmax")
def scaled_masked_softmax(scores: Tensor, scale: float, attn_mask: Tensor | None, is_causal: bool) -> Tensor:
    if scores.numel() == 0:
        return torch.empty(scores.shape, dtype=scores.dtype, device=scores.device)
    mask = attn_mask.expand(scores.shape) if attn_mask is not None else None
    mask_dtype = mask.dtype if mask is not None else scores.dtype
    if _run_kernel(scores, scores.dtype, mask_dtype):
        return kernels.softmax_forward(scores, scores.dtype, scale, mask, is_causal, zero_empty_rows=True)
    z = scaled_masked_scores_reference(scores, scale, mask, is_causal, _accumulator(scores.dtype, mask_dtype))
    return softmax_rows_reference(z, zero_empty_rows=True).to(scores.dtype).contiguous()


@scaled_masked_softmax.register_fake
def _(scores, scale, attn_mask, is_causal):
    return scores.new_empty(scores.shape)


def _scaled_masked_setup_context(ctx, inputs, output):
    scores, scale, attn_mask, _ = inputs
    ctx.scale = scale
    ctx.scores_dtype = scores.dtype
    ctx.mask_meta = (attn_mask.shape, attn_mask.dtype) if attn_mask is not None else None
    ctx.save_for_backward(output)


def _scaled_masked_autograd(ctx, grad):
    (out,) = ctx.saved_tensors
    grad_scores = grad_mask = None
    if ctx.needs_input_grad[0]:
        grad_scores = call(softmax_backward, grad, out, -1, ctx.scale, ctx.scores_dtype)
    if ctx.needs_input_grad[2]:  # an additive float mask that requires grad
        mask_shape, mask_dtype = ctx.mask_meta
        dz = call(softmax_backward, grad, out, -1, 1.0, torch.promote_types(grad.dtype, mask_dtype))
        grad_mask = dz.sum_to_size(mask_shape).to(mask_dtype)
    return grad_scores, None, grad_mask, None


register_autograd(scaled_masked_softmax, _scaled_masked_autograd, _scaled_masked_setup_context)


# ----------------------------------------------------------------------------- backward


@custom_op("fusedlayers::softmax_backward")
def softmax_backward(grad: Tensor, out: Tensor, dim: int, scale: float, input_dtype: torch.dtype) -> Tensor:
    if out.numel() == 0:
        return torch.empty(out.shape, dtype=input_dtype, device=out.device)
    if _run_kernel(out, grad.dtype, out.dtype, input_dtype):
        if out.dim() == 0:
            return kernels.softmax_backward(grad.reshape(1), out.reshape(1), scale, input_dtype).reshape(())
        return kernels.softmax_backward(grad, out, scale, input_dtype, dim=dim)
    acc = _accumulator(grad.dtype, out.dtype, input_dtype)
    return as_contiguous(softmax_backward_reference(grad, out, scale, acc, dim), input_dtype)


@softmax_backward.register_fake
def _(grad, out, dim, scale, input_dtype):
    return out.new_empty(out.shape, dtype=input_dtype)  # contiguous, as the op's output


def _backward_setup_context(ctx, inputs, output):
    grad, out, dim, scale, _ = inputs
    ctx.scale = scale
    ctx.dim = dim
    ctx.save_for_backward(grad, out)


def _backward_autograd(ctx, v):
    """Gradients of dx = s * y * (g - sum(g y)) for an upstream v: w.r.t. g it is the same op applied to v;
    w.r.t. y it is s * (v * (g - sum(g y)) - g * sum(v y))."""
    grad, out = ctx.saved_tensors
    d_grad = d_out = None
    if ctx.needs_input_grad[0]:
        d_grad = call(softmax_backward, v, out, ctx.dim, ctx.scale, grad.dtype)
    if ctx.needs_input_grad[1]:
        acc = _accumulator(grad.dtype, out.dtype, v.dtype)
        g, y, v_ = grad.to(acc), out.to(acc), v.to(acc)
        gy = (g * y).sum(ctx.dim, keepdim=True)
        vy = (v_ * y).sum(ctx.dim, keepdim=True)
        d_out = (ctx.scale * (v_ * (g - gy) - g * vy)).to(out.dtype)
    return d_grad, d_out, None, None, None


register_autograd(softmax_backward, _backward_autograd, _backward_setup_context)


# Under CUDA autocast torch.softmax runs in fp32; do the same. (CPU autocast leaves softmax alone, as here.)
for _op in (softmax, scaled_masked_softmax):
    torch.library.register_autocast(_op, "cuda", torch.float32)
