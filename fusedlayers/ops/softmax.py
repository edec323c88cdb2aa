"""Softmax ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, autocast, CPU reference.

Ops (all over the last dim; ``fusedlayers.functional`` moves any other dim there and validates input):

- ``softmax(x, dtype)``: softmax of x, written in ``dtype`` (x's dtype when None).
- ``scaled_masked_softmax(scores, scale, attn_mask, is_causal)``: softmax(scores * scale + mask);
  rows with every entry masked give zeros.
- ``softmax_backward(grad, out, scale, input_dtype)``: scale * out * (grad - sum(grad * out)), the
  gradient of both; an op of its own so torch.compile traces forward and backward without a graph
  break, and differentiable itself (double backward).

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


def softmax_rows_reference(z: Tensor, zero_empty_rows: bool) -> Tensor:
    """Softmax over the last dim of ``z`` in z's dtype, max-subtracted, in three passes."""
    row_max = z.amax(-1, keepdim=True)
    if zero_empty_rows:
        row_max = row_max.masked_fill(row_max == float("-inf"), 0.0)
    e = torch.exp(z - row_max)
    denom = e.sum(-1, keepdim=True)
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


def softmax_backward_reference(grad: Tensor, out: Tensor, scale: float, acc: torch.dtype) -> Tensor:
    g, y = grad.to(acc), out.to(acc)
    return scale * y * (g - (g * y).sum(-1, keepdim=True))


# ----------------------------------------------------------------------------- softmax


@custom_op("fusedlayers::softmax")
def softmax(x: Tensor, dtype: torch.dtype | None) -> Tensor:
    out_dtype = dtype or x.dtype
    if x.numel() == 0:
        return torch.empty(x.shape, dtype=out_dtype, device=x.device)
    if _run_kernel(x, x.dtype, out_dtype):
        return kernels.softmax_forward(x, out_dtype)
    z = x.to(_accumulator(x.dtype, out_dtype))
    return softmax_rows_reference(z, zero_empty_rows=False).to(out_dtype).contiguous()


@softmax.register_fake
def _(x, dtype):
    return x.new_empty(x.shape, dtype=dtype or x.dtype)


def _softmax_setup_context(ctx, inputs, output):
    x, _ = inputs
    ctx.input_dtype = x.dtype
    ctx.save_for_backward(output)


def _softmax_autograd(ctx, grad):
    (out,) = ctx.saved_tensors
    return call(softmax_backward, grad, out, 1.0, ctx.input_dtype), None


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
        grad_scores = call(softmax_backward, grad, out, ctx.scale, ctx.scores_dtype)
    if ctx.needs_input_grad[2]:  # an additive float mask that requires grad
        mask_shape, mask_dtype = ctx.mask_meta
        dz = call(softmax_backward, grad, out, 1.0, torch.promote_types(grad.dtype, mask_dtype))
        grad_mask = dz.sum_to_size(mask_shape).to(mask_dtype)
    return grad_scores, None, grad_mask, None


register_autograd(scaled_masked_softmax, _scaled_masked_autograd, _scaled_masked_setup_context)


# ----------------------------------------------------------------------------- backward


@custom_op("fusedlayers::softmax_backward")
def softmax_backward(grad: Tensor, out: Tensor, scale: float, input_dtype: torch.dtype) -> Tensor:
    if out.numel() == 0:
        return torch.empty(out.shape, dtype=input_dtype, device=out.device)
    if _run_kernel(out, grad.dtype, out.dtype, input_dtype):
        return kernels.softmax_backward(grad, out, scale, input_dtype)
    acc = _accumulator(grad.dtype, out.dtype, input_dtype)
    return softmax_backward_reference(grad, out, scale, acc).to(input_dtype).contiguous()


@softmax_backward.register_fake
def _(grad, out, scale, input_dtype):
    return out.new_empty(out.shape, dtype=input_dtype)


def _backward_setup_context(ctx, inputs, output):
    grad, out, scale, _ = inputs
    ctx.scale = scale
    ctx.save_for_backward(grad, out)


def _backward_autograd(ctx, v):
    """Gradients of dx = s * y * (g - sum(g y)) for an upstream v: w.r.t. g it is the same op applied to v;
    w.r.t. y it is s * (v * (g - sum(g y)) - g * sum(v y))."""
    grad, out = ctx.saved_tensors
    d_grad = d_out = None
    if ctx.needs_input_grad[0]:
        d_grad = call(softmax_backward, v, out, ctx.scale, grad.dtype)
    if ctx.needs_input_grad[1]:
        acc = _accumulator(grad.dtype, out.dtype, v.dtype)
        g, y, v_ = grad.to(acc), out.to(acc), v.to(acc)
        gy = (g * y).sum(-1, keepdim=True)
        vy = (v_ * y).sum(-1, keepdim=True)
        d_out = (ctx.scale * (v_ * (g - gy) - g * vy)).to(out.dtype)
    return d_grad, d_out, None, None


register_autograd(softmax_backward, _backward_autograd, _backward_setup_context)


# Under CUDA autocast torch.softmax runs in fp32; do the same. (CPU autocast leaves softmax alone, as here.)
for _op in (softmax, scaled_masked_softmax):
    torch.library.register_autocast(_op, "cuda", torch.float32)
