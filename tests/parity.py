"""Parity helpers: compare a fused result and the stock torch result against a float64 reference.

The rule (DESIGN.md): the fused error may be at most 2x the stock error plus a small per-dtype floor.
Errors are max-abs over the tensor, measured against the float64 reference computed from the same inputs.
"""

from __future__ import annotations

import torch

# Absolute floor added to 2x the stock error, per dtype of the compared tensors.
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


def max_error(value: torch.Tensor, reference: torch.Tensor) -> float:
    diff = (value.double() - reference.double()).abs()
    both_nan = value.isnan() & reference.isnan()
    if (value.isnan() != reference.isnan()).any():
        return float("inf")
    return diff.masked_fill(both_nan, 0).max().item() if diff.numel() else 0.0


def assert_parity(fused: torch.Tensor, stock: torch.Tensor, reference: torch.Tensor, what: str = "output",
                  floor: float | None = None) -> None:
    """Assert fused is as close to the float64 reference as stock is (2x + floor)."""
    assert fused.shape == reference.shape, f"{what}: shape {tuple(fused.shape)} != {tuple(reference.shape)}"
    assert fused.dtype == stock.dtype, f"{what}: dtype {fused.dtype} != stock {stock.dtype}"
    floor = FLOOR[fused.dtype] if floor is None else floor
    fused_err, stock_err = max_error(fused, reference), max_error(stock, reference)
    assert fused_err <= 2 * stock_err + floor, (
        f"{what}: fused error {fused_err:.3e} > 2 x stock error {stock_err:.3e} + floor {floor:.0e}"
    )
