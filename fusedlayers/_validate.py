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


def check_float_dtype(name: str, value) -> torch.dtype:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise TypeError(f"{name} must be a floating torch.dtype (e.g. torch.bfloat16), got {value!r}")
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


# ----------------------------------------------------------------------------- losses (cross-entropy)

REDUCTIONS = ("none", "mean", "sum")
INDEX_DTYPES = (torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8)


class TargetOutOfRangeError(ValueError, IndexError):
    """A class-index target outside [0, C) that is not ignore_index (an IndexError too, as torch raises)."""


def check_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    return value


def check_reduction(reduction) -> str:
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, got {reduction!r}")
    return reduction


def check_fraction(name: str, value) -> float:
    """A Python number in [0, 1] (label_smoothing)."""
    value = check_number(name, value)
    if not 0.0 <= value <= 1.0:
        raise ValueError(f"{name} must be between 0.0 and 1.0, got {value}")
    return value


def check_non_negative(name: str, value) -> float:
    """A finite Python number >= 0 (z_loss)."""
    value = check_number(name, value)
    if not (value >= 0.0 and value != float("inf")):
        raise ValueError(f"{name} must be a finite number >= 0, got {value}")
    return value


def check_index_tensor(name: str, value) -> Tensor:
    """A tensor of class indices (integer, not bool)."""
    check_tensor(name, value)
    if value.dtype not in INDEX_DTYPES:
        raise TypeError(f"{name} must hold class indices (int64, int32, int16, int8 or uint8), got {value.dtype}"
                        + ("; class probabilities must have the logits' shape" if value.is_floating_point() else ""))
    return value


def check_target_range(name: str, target: Tensor, num_classes: int, ignore_index: int) -> None:
    """Raise TargetOutOfRangeError if a target is outside [0, num_classes) and not ignore_index.

    Reads the values, so call it on CPU tensors only (on CUDA it would synchronise).
    """
    bad = ((target < 0) | (target >= num_classes)) & (target != ignore_index)
    if bad.any():
        value = int(target[bad][0])
        raise TargetOutOfRangeError(
            f"{name} {value} is out of bounds: class indices must be in [0, {num_classes}) or equal "
            f"ignore_index={ignore_index}"
        )


# ----------------------------------------------------------------------------- attention

def check_bool(name: str, value) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def check_broadcastable_to(name: str, value: Tensor, shape: tuple[int, ...]) -> None:
    try:
        ok = torch.broadcast_shapes(value.shape, shape) == torch.Size(shape)
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"{name} of shape {tuple(value.shape)} does not broadcast to {tuple(shape)}")


QUANT_LIMIT = 2**24  # fp32 holds every integer up to here exactly: the kernels compare q with the range in fp32


def check_quant_range(quant_min, quant_max) -> tuple[int, int]:
    check_int("quant_min", quant_min)
    check_int("quant_max", quant_max)
    if quant_min > quant_max:
        raise ValueError(f"quant_min ({quant_min}) must be <= quant_max ({quant_max})")
    if not (-QUANT_LIMIT <= quant_min and quant_max <= QUANT_LIMIT):
        raise ValueError(f"quant_min and quant_max must lie in [-2**24, 2**24], got [{quant_min}, {quant_max}]")
    return quant_min, quant_max


def check_bits(name: str, bits, allow_none: bool = True) -> int | None:
    """A quantization bit width: an int in 2..8 (or None, meaning no quantization, where allowed)."""
    if bits is None and allow_none:
        return None
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{name} must be an int in 2..8{' or None' if allow_none else ''}, got {type(bits).__name__}")
    if not 2 <= bits <= 8:
        raise ValueError(f"{name} must be in 2..8, got {bits}")
    return bits


def check_group_size(name: str, group_size, size: int, what: str = "the last dim") -> int:
    """A positive int dividing ``size``."""
    check_int(name, group_size)
    if group_size <= 0:
        raise ValueError(f"{name} must be positive, got {group_size}")
    if size % group_size:
        raise ValueError(f"{name}={group_size} does not divide {what} ({size})")
    return group_size
