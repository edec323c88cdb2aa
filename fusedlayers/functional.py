"""F-style functions with torch-compatible signatures. Each validates its input, then calls its op."""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers import _validate as v
from fusedlayers.ops import softmax as _softmax_ops  # noqa: F401  (registers torch.ops.fusedlayers.softmax*)

__all__ = ["softmax", "scaled_masked_softmax"]


def softmax(input: Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> Tensor:
    """Softmax over ``dim``, equal to ``torch.softmax(input, dim, dtype=dtype)``.

    ``dtype``: if given, the output's dtype (input is cast to it first, as torch does; widening casts
    happen inside the kernel for free). Accumulates in fp32 (fp64 for fp64). Any rank and shape,
    non-contiguous input, empty tensors. A row of all -inf gives NaN, as in torch.
    """
    v.check_tensor("input", input)
    dim = v.check_dim("dim", dim, input.dim())
    if dtype is not None and dtype not in v.FLOAT_DTYPES:
        raise TypeError(f"dtype must be a floating dtype (float16, bfloat16, float32, float64), got {dtype}")
    if dtype is None:
        v.check_float_tensor("input", input)
    elif not (input.is_floating_point() and dtype.itemsize > input.dtype.itemsize):
        input = input.to(dtype)  # not a widening: torch rounds to dtype before the softmax
        dtype = None
    if input.dim() == 0:
        return torch.ops.fusedlayers.softmax(input.reshape(1), dtype).reshape(())
    return torch.ops.fusedlayers.softmax(input.movedim(dim, -1), dtype).movedim(-1, dim)


def scaled_masked_softmax(
    scores: Tensor, scale: float = 1.0, attn_mask: Tensor | None = None, is_causal: bool = False
) -> Tensor:
    """``softmax(scores * scale + mask, dim=-1)`` in one kernel, forward and backward.

    ``attn_mask``: bool (True = keep) or additive float, broadcastable to ``scores``; a float mask that
    requires grad gets its gradient. ``is_causal``: keep key j for query i when j <= i (top-left, as in
    ``F.scaled_dot_product_attention``); needs ``scores`` of at least 2 dims (..., L, S). Both masks may
    be given together. Rows where every entry is masked give zeros (not NaN) and zero gradients.
    The output has the dtype of ``scores``.
    """
    v.check_float_tensor("scores", scores)
    scale = v.check_number("scale", scale)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scores.dim() == 0:
        raise ValueError("scores must have at least 1 dim (the softmax runs over the last)")
    if is_causal and scores.dim() < 2:
        raise ValueError(f"is_causal=True needs scores of shape (..., L, S), got {tuple(scores.shape)}")
    if attn_mask is not None:
        v.check_tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in v.FLOAT_DTYPES:
            raise TypeError(f"attn_mask must be bool (True = keep) or floating (additive), got {attn_mask.dtype}")
        v.check_broadcastable("attn_mask", attn_mask, scores)
    return torch.ops.fusedlayers.scaled_masked_softmax(scores, scale, attn_mask, is_causal)
