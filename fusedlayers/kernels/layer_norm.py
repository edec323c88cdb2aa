"""Triton launchers of LayerNorm (with the optional fused residual add); the kernels are shared with RMSNorm in
``kernels/_norm.py``, which describes them."""

from __future__ import annotations

import torch

from fusedlayers.kernels import _norm


def layer_norm_forward(x: torch.Tensor, n_cols: int, weight: torch.Tensor | None, bias: torch.Tensor | None,
                       residual: torch.Tensor | None, eps: float, out_dtype: torch.dtype
                       ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """(y, h, stats): y = (h - mean) * rsqrt(var + eps) * weight + bias over the last ``n_cols`` elements of each row,
    h = x + residual (None without a residual), stats (2, rows) fp32: mean and rstd."""
    return _norm.norm_forward(x, n_cols, weight, bias, residual, eps, out_dtype, rms=False)


def layer_norm_backward(grad: torch.Tensor, x: torch.Tensor, n_cols: int, weight: torch.Tensor | None,
                        stats: torch.Tensor, grad_residual: torch.Tensor | None, dx_dtype: torch.dtype,
                        bias_dtype: torch.dtype | None, need_dx: bool, need_dw: bool, need_db: bool,
                        input_dtype: torch.dtype | None = None
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """(dx, dxi, dw, db) of the forward that normalized ``x`` (None where not needed); dx includes
    ``grad_residual``, dxi is dx in ``input_dtype``; dw in the weight's dtype, db in ``bias_dtype``."""
    return _norm.norm_backward(grad, x, n_cols, weight, stats, grad_residual, dx_dtype, need_dx, need_dw, need_db,
                               rms=False, bias_dtype=bias_dtype, input_dtype=input_dtype)
