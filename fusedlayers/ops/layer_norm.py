"""LayerNorm ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, autocast, CPU reference.

- ``layer_norm(input, normalized_shape, weight, bias, eps, residual, out_dtype) -> (y, h, stats)``: h = input +
  residual (an empty placeholder without a residual), y = (h - mean) * rsqrt(var + eps) * weight + bias over the
  normalized dims (biased variance, as torch) in ``out_dtype`` (h's dtype when None), stats (2, rows) fp32: mean and
  rstd (saved for backward, not differentiable).
- ``layer_norm_backward(grad, x, normalized_shape, weight, stats, grad_residual, dx_dtype, bias_dtype, need_dx,
  need_dw, need_db, input_dtype=None) -> (dx, dw, db, dxi)``: the gradients of the normalized tensor x (plus
  ``grad_residual``, the gradient of h), weight and bias, and dx in ``input_dtype`` as for ``rms_norm_backward``;
  those not asked for come back as empty (0,) tensors and are not computed.

``fusedlayers.functional.layer_norm`` validates the arguments. Shared pieces: ``ops/_norm.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers.ops import _norm
from fusedlayers.ops._eager import call, custom_op, register_autograd

try:
    from fusedlayers.kernels import layer_norm as kernels
except ImportError:  # no Triton (macOS, Windows): the reference runs everywhere
    kernels = None


@custom_op("fusedlayers::layer_norm")
def layer_norm(input: Tensor, normalized_shape: list[int], weight: Tensor | None, bias: Tensor | None, eps: float,
               residual: Tensor | None, out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor]:
    if _norm.run_kernel(input, weight, bias, residual):
        _, n_cols = _norm.rows_of(input, normalized_shape)
        out_dtype = out_dtype or _norm.h_dtype(input, residual)
        y, h, stats = kernels.layer_norm_forward(input, n_cols, weight, bias, residual, eps, out_dtype)
        return y, _norm.or_empty(h, input), stats
    return _norm.norm_forward_reference(input, normalized_shape, weight, bias, residual, eps, out_dtype, rms=False)


@layer_norm.register_fake
def _(input, normalized_shape, weight, bias, eps, residual, out_dtype):
    return _norm.empty_outputs(input, normalized_shape, residual, out_dtype, 2, weight, bias)


def _setup_context(ctx, inputs, output):
    input, normalized_shape, weight, bias, _, residual, _ = inputs
    ctx.normalized_shape = normalized_shape
    ctx.bias_dtype = bias.dtype if bias is not None else None
    _norm.save_forward(ctx, input, weight, residual, output)


def _autograd(ctx, grad, grad_h, _grad_stats):
    x, weight, stats = ctx.saved_tensors
    need_input, need_residual, dx_dtype = _norm.grad_plan(ctx, 0, 5)
    need_dx, need_dw, need_db = need_input or need_residual, ctx.needs_input_grad[2], ctx.needs_input_grad[3]
    if not (need_dx or need_dw or need_db):
        return None, None, None, None, None, None, None
    grad_residual = grad_h if ctx.has_residual and need_dx else None
    input_dtype = _norm.second_dx_dtype(ctx, need_input, need_residual, dx_dtype)
    dx, dw, db, dxi = call(layer_norm_backward, grad, x, ctx.normalized_shape, weight, stats, grad_residual, dx_dtype,
                           ctx.bias_dtype, need_dx, need_dw, need_db, input_dtype)
    grad_input, grad_res = _norm.split_dh(dx, ctx, need_input, need_residual, dxi if input_dtype else None)
    return grad_input, None, dw if need_dw else None, db if need_db else None, None, grad_res, None


register_autograd(layer_norm, _autograd, _setup_context)


@custom_op("fusedlayers::layer_norm_backward")
def layer_norm_backward(grad: Tensor, x: Tensor, normalized_shape: list[int], weight: Tensor | None, stats: Tensor,
                        grad_residual: Tensor | None, dx_dtype: torch.dtype, bias_dtype: torch.dtype | None,
                        need_dx: bool, need_dw: bool, need_db: bool, input_dtype: torch.dtype | None = None
                        ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if _norm.run_kernel(x, grad, weight, grad_residual):
        _, n_cols = _norm.rows_of(x, normalized_shape)
        dx, dxi, dw, db = kernels.layer_norm_backward(grad, x, n_cols, weight, stats, grad_residual, dx_dtype,
                                                      bias_dtype, need_dx, need_dw, need_db, input_dtype)
        dw = dw.view(weight.shape) if dw is not None and weight.dim() != 1 else dw
        db = db.view(normalized_shape) if db is not None and len(normalized_shape) != 1 else db
    else:
        dx, dw, db = _norm.norm_backward_reference(grad, x, normalized_shape, weight, stats, grad_residual,
                                                   dx_dtype, bias_dtype, need_dx, need_dw, need_db, rms=False)
        dxi = dx.to(input_dtype) if dx is not None and input_dtype is not None else None
    return _norm.or_empty(dx, x), _norm.or_empty(dw, x), _norm.or_empty(db, x), _norm.or_empty(dxi, x)


@layer_norm_backward.register_fake
def _(grad, x, normalized_shape, weight, stats, grad_residual, dx_dtype, bias_dtype, need_dx, need_dw, need_db,
      input_dtype=None):
    return (*_norm.empty_grads(x, weight, normalized_shape, dx_dtype, bias_dtype, need_dx, need_dw, need_db),
            _norm.empty_second_dx(x, need_dx, input_dtype))


# Under CUDA autocast torch.layer_norm runs in fp32 (see ops/_norm.py); CPU autocast leaves it alone, as here.
_autocast_lib = torch.library.Library("fusedlayers", "FRAGMENT")


def _autocast(_keyset, input, normalized_shape, weight, bias, eps, residual, out_dtype):
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)):
        return layer_norm(input, normalized_shape, weight, bias, eps, residual,
                          _norm.autocast_out_dtype(input, residual, out_dtype))


_autocast_lib.impl("layer_norm", _autocast, "AutocastCUDA", with_keyset=True)
