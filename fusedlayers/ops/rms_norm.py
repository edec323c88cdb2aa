"""RMSNorm ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, autocast, CPU reference.

- ``rms_norm(input, normalized_shape, weight, eps, residual, out_dtype) -> (y, h, rstd)``: h = input + residual (an
  empty placeholder without a residual), y = h * rsqrt(mean(h**2 over the normalized dims) + eps) * weight in
  ``out_dtype`` (h's dtype when None), rstd fp32 per row (saved for backward, not differentiable).
- ``rms_norm_backward(grad, x, normalized_shape, weight, rstd, grad_residual, dx_dtype, need_dx, need_dw,
  input_dtype=None) -> (dx, dw, dxi)``: the gradient of the normalized tensor x (plus ``grad_residual``, the gradient
  of h) and of the weight; with ``input_dtype``, dxi holds dx's values in that dtype too (the input's gradient, where
  the residual's dtype is dx's: one kernel writes both, no cast kernel); gradients not asked for come back as empty
  (0,) tensors and are not computed.

``fusedlayers.functional.rms_norm`` validates the arguments and resolves eps. Shared pieces: ``ops/_norm.py``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers.ops import _norm
from fusedlayers.ops._eager import call, custom_op, register_autograd

try:
    from fusedlayers.kernels import rms_norm as kernels
except ImportError:  # no Triton (macOS, Windows): the reference runs everywhere
    kernels = None


@custom_op("fusedlayers::rms_norm")
def rms_norm(input: Tensor, normalized_shape: list[int], weight: Tensor | None, eps: float,
             residual: Tensor | None, out_dtype: torch.dtype | None) -> tuple[Tensor, Tensor, Tensor]:
    if _norm.run_kernel(input, weight, residual):
        _, n_cols = _norm.rows_of(input, normalized_shape)
        out_dtype = out_dtype or _norm.h_dtype(input, residual)
        y, h, rstd = kernels.rms_norm_forward(input, n_cols, weight, residual, eps, out_dtype)
        return y, _norm.or_empty(h, input), rstd
    return _norm.norm_forward_reference(input, normalized_shape, weight, None, residual, eps, out_dtype, rms=True)


@rms_norm.register_fake
def _(input, normalized_shape, weight, eps, residual, out_dtype):
    return _norm.empty_outputs(input, normalized_shape, residual, out_dtype, 1, weight)


def _setup_context(ctx, inputs, output):
    input, normalized_shape, weight, _, residual, _ = inputs
    ctx.normalized_shape = normalized_shape
    _norm.save_forward(ctx, input, weight, residual, output)


def _autograd(ctx, grad, grad_h, _grad_rstd):
    x, weight, rstd = ctx.saved_tensors
    need_input, need_residual, dx_dtype = _norm.grad_plan(ctx, 0, 4)
    need_dx, need_dw = need_input or need_residual, ctx.needs_input_grad[2]
    if not (need_dx or need_dw):
        return None, None, None, None, None, None
    grad_residual = grad_h if ctx.has_residual and need_dx else None
    input_dtype = _norm.second_dx_dtype(ctx, need_input, need_residual, dx_dtype)
    dx, dw, dxi = call(rms_norm_backward, grad, x, ctx.normalized_shape, weight, rstd, grad_residual, dx_dtype,
                       need_dx, need_dw, input_dtype)
    grad_input, grad_res = _norm.split_dh(dx, ctx, need_input, need_residual, dxi if input_dtype else None)
    return grad_input, None, dw if need_dw else None, None, grad_res, None


register_autograd(rms_norm, _autograd, _setup_context)


@custom_op("fusedlayers::rms_norm_backward")
def rms_norm_backward(grad: Tensor, x: Tensor, normalized_shape: list[int], weight: Tensor | None, rstd: Tensor,
                      grad_residual: Tensor | None, dx_dtype: torch.dtype, need_dx: bool, need_dw: bool,
                      input_dtype: torch.dtype | None = None) -> tuple[Tensor, Tensor, Tensor]:
    if _norm.run_kernel(x, grad, weight, grad_residual):
        _, n_cols = _norm.rows_of(x, normalized_shape)
        dx, dxi, dw = kernels.rms_norm_backward(grad, x, n_cols, weight, rstd, grad_residual, dx_dtype, need_dx,
                                                need_dw, input_dtype)
        dw = dw.view(weight.shape) if dw is not None and weight.dim() != 1 else dw
    else:
        dx, dw, _ = _norm.norm_backward_reference(grad, x, normalized_shape, weight, rstd, grad_residual, dx_dtype,
                                                  None, need_dx, need_dw, False, rms=True)
        dxi = dx.to(input_dtype) if dx is not None and input_dtype is not None else None
    return _norm.or_empty(dx, x), _norm.or_empty(dw, x), _norm.or_empty(dxi, x)


@rms_norm_backward.register_fake
def _(grad, x, normalized_shape, weight, rstd, grad_residual, dx_dtype, need_dx, need_dw, input_dtype=None):
    dx, dw, _ = _norm.empty_grads(x, weight, normalized_shape, dx_dtype, None, need_dx, need_dw, False)
    return dx, dw, _norm.empty_second_dx(x, need_dx, input_dtype)


# Autocast as torch's rms_norm: torch >= 2.12 has it on CUDA autocast's fp32 list (fp32 output, see ops/_norm.py),
# older torch leaves it alone (the input's dtype out), and so does CPU autocast. Which one this torch does is read from
# its dispatcher: whether aten::rms_norm has a kernel of its own for AutocastCUDA.
TORCH_AUTOCASTS_RMS_NORM = torch._C._dispatch_has_kernel_for_dispatch_key("aten::rms_norm", "AutocastCUDA")
_autocast_lib = torch.library.Library("fusedlayers", "FRAGMENT")


def _autocast(_keyset, input, normalized_shape, weight, eps, residual, out_dtype):
    with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)):
        return rms_norm(input, normalized_shape, weight, eps, residual,
                        _norm.autocast_out_dtype(input, residual, out_dtype))


if TORCH_AUTOCASTS_RMS_NORM:
    _autocast_lib.impl("rms_norm", _autocast, "AutocastCUDA", with_keyset=True)
