"""Triton kernels of GeGLU, ``gelu(gate) * up``, forward and backward: the SwiGLU kernels
(:mod:`fusedlayers.kernels.swiglu`: layout, block sizes, fp32 math, only the gradients asked for) with GELU's tanh
form (``approximate="tanh"``, Gemma's ``gelu_pytorch_tanh``) or exact GELU (``approximate="none"``) as the gate's
activation."""

from __future__ import annotations

import torch

from fusedlayers.kernels.swiglu import GELU, GELU_TANH, swiglu_backward, swiglu_forward


def _act(approximate: str) -> int:
    return GELU_TANH if approximate == "tanh" else GELU


def geglu_forward(gate: torch.Tensor, up: torch.Tensor, out_dtype: torch.dtype, approximate: str) -> torch.Tensor:
    """gelu(gate, approximate) * up (same shapes, any strides) as a new contiguous tensor of ``out_dtype``."""
    return swiglu_forward(gate, up, out_dtype, _act(approximate))


def geglu_backward(grad: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, approximate: str, need_dgate: bool,
                   need_dup: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dgate, dup) in gate's and up's dtypes (contiguous; None where not asked for) for the upstream ``grad``."""
    return swiglu_backward(grad, gate, up, need_dgate, need_dup, _act(approximate))
