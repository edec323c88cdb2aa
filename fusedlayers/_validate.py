"""Input checks shared by the F-style functions: each raises a clear error naming the argument."""

from __future__ import annotations

import torch
from torch import Tensor

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_tensor(name: str, value) -> Tensor:
    if not isinstance(value, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_float_tensor(name: str, value) -> Tensor:
    check_tensor(name, value)
    if value.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {value.dtype}")
    return value


def check_dim(name: str, dim, ndim: int) -> int:
    """``dim`` normalised to [0, ndim); a 0-d tensor accepts -1 and 0, as torch does."""
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    size = max(ndim, 1)
    if not -size <= dim < size:
        raise ValueError(f"{name}={dim} is out of range for a tensor of {ndim} dims (expected {-size}..{size - 1})")
    return dim % size


def check_number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a Python number, got {type(value).__name__}")
    return float(value)


def check_broadcastable(name: str, value: Tensor, target: Tensor) -> None:
    if value.device != target.device:
        raise ValueError(f"{name} is on {value.device} but the input is on {target.device}")
    try:
        shape = torch.broadcast_shapes(value.shape, target.shape)
    except RuntimeError:
        shape = None
    if shape != target.shape:
        raise ValueError(f"{name} of shape {tuple(value.shape)} does not broadcast to {tuple(target.shape)}")
