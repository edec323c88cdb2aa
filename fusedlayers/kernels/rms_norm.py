"""Triton launchers of RMSNorm (with the optional fused residual add); the kernels are shared with LayerNorm in
``kernels/_norm.py``, which describes them."""

from __future__ import annotations

import torch

from fusedlayers.kernels import _norm


def rms_norm_forward(x: torch.Tensor, n_cols: int, weight: torch.Tensor | None, residual: torch.Tensor | None,
                     eps: float, out_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(y, h, rstd): y = h * rsqrt(mean(h**2) + eps) * weight over the last ``n_cols`` elements of each row, h = x +
    residual (None without a residual), rstd fp32 per row."""
    return _norm.norm_forward(x, n_cols, weight, None, residual, eps, out_dtype, rms=True)


def rms_norm_backward(grad: torch.Tensor, x: torch.Tensor, n_cols: int, weight: torch.Tensor | None,
                      rstd: torch.Tensor, grad_residual: torch.Tensor | None, dx_dtype: torch.dtype, need_dx: bool,
                      need_dw: bool, input_dtype: torch.dtype | None = None
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dxi, dw) of the forward that normalized ``x`` (None where not needed); dx includes ``grad_residual``, dxi
    is dx in ``input_dtype``."""
    dx, dxi, dw, _ = _norm.norm_backward(grad, x, n_cols, weight, rstd, grad_residual, dx_dtype, need_dx, need_dw,
                                         False, rms=True, input_dtype=input_dtype)
    return dx, dxi, dw
