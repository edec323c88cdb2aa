"""Parity helpers: compare a fused result and the stock torch result against a float64 reference.

The rule (docs/design.md): the fused error may be at most 2x the stock error plus a small per-dtype floor.
Errors are max-abs over the tensor, measured against the float64 reference computed from the same inputs.

That rule is sound where both errors are dominated by the same deterministic rounding (fp16/bf16 results:
the final rounding to a 10- or 7-bit mantissa). It is not sound for fp32 results of long accumulations
(attention: dots over the head dim, sums over keys and queries): there both errors are set by the order of
accumulation, which the BLAS library picks per CPU (numpy's OpenBLAS, under the Triton interpreter, selects
its sgemm microkernel by CPU; torch's MKL takes other code paths on AMD than on Intel), so the ratio of the
two max errors is a ratio of two samples that varies from CPU to CPU. For those, ``assert_within_bound``
checks each element against an a-priori error bound built from the float64 magnitudes of the computation
(Higham's gamma_n model, ``gamma``), which holds for any summation order, with or without FMA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Absolute floor added to 2x the stock error, per dtype of the compared tensors.
FLOOR = {torch.float64: 1e-12, torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3}


# Unit roundoff (half an ulp of 1) of each dtype.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}


def gamma(n: int, u: float) -> float:
    """Higham's gamma_n = n u / (1 - n u) ("Accuracy and Stability of Numerical Algorithms", 2nd ed., Lemma 3.1
    and (3.4)-(3.5)): a sum of n + 1 terms, or a dot product of length n, computed in floating point in ANY
    order (blocked, pairwise, split over SIMD lanes, with or without FMA) is off from the exact value by at
    most gamma_n times the same sum of absolute values. A rigorous bound, independent of the CPU and library."""
    assert n * u < 1
    return n * u / (1 - n * u)


def assert_within_bound(value: torch.Tensor, reference: torch.Tensor, bound: torch.Tensor,
                        what: str = "output") -> None:
    """Assert |value - reference| <= bound elementwise (NaN only where the reference is NaN)."""
    assert value.shape == reference.shape, f"{what}: shape {tuple(value.shape)} != {tuple(reference.shape)}"
    nan = reference.isnan()
    assert torch.equal(value.isnan(), nan), f"{what}: NaN where the reference has none (or the reverse)"
    err = (value.double() - reference.double()).abs().masked_fill(nan, 0.0)
    bound = bound.double().expand_as(err)
    excess = err - bound
    if excess.numel() and excess.max() > 0:
        i = int(excess.flatten().argmax())
        idx = tuple(int(x) for x in torch.unravel_index(torch.tensor(i), err.shape))
        raise AssertionError(
            f"{what}: error {err[idx]:.3e} at {idx} exceeds the error bound {bound[idx]:.3e} "
            f"({(err > bound).sum().item()} of {err.numel()} elements over it; value {value[idx].item():.6e}, "
            f"reference {reference[idx].item():.6e})"
        )


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


def float64_hf_norms(model: torch.nn.Module) -> torch.nn.Module:
    """Give a float64 transformers model float64 RMSNorms, in place: transformers' Llama and Gemma RMSNorms compute
    in fp32 whatever their input (``.to(torch.float32)``, ``.float()``), so a float64 stock model is only fp32-exact
    there; this gives its norms the same formulas in float64 (Llama: ``weight * normalized``, Gemma:
    ``normalized * (1 + weight)``). Returns ``model``."""
    from fusedlayers.integrations import transformers as flt

    def normalized(x, eps):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)

    for m in model.modules():
        kind = flt._norm_forward(m)
        if kind is flt._rms_norm_forward:
            m.forward = lambda x, m=m: m.weight * normalized(x, m.variance_epsilon)
        elif kind is flt._gemma_rms_norm_forward:
            m.forward = lambda x, m=m: normalized(x, m.eps) * (1.0 + m.weight)
    return model


def stock_cross_entropy(x, t, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0):
    """F.cross_entropy plus the z-loss written with torch ops (in x's dtype, or float64 for the reference): per
    non-ignored row z * lse^2, times weight[t] with class weights; "mean" over the same denominator. The stock twin
    of ``fl.cross_entropy`` (and, on F.linear's logits, of ``fl.linear_cross_entropy``)."""
    soft = t.is_floating_point()
    kw = dict(weight=weight, reduction=reduction, label_smoothing=label_smoothing)
    loss = F.cross_entropy(x, t, **kw) if soft else F.cross_entropy(x, t, ignore_index=ignore_index, **kw)
    if z_loss:
        lse = torch.logsumexp(x, 1)
        if soft:
            z, denom = z_loss * lse.square(), lse.numel()
        else:
            keep = t != ignore_index
            w_t = weight[torch.where(keep, t, 0)] if weight is not None else torch.ones_like(lse)
            w_t = torch.where(keep, w_t, 0.0)
            z, denom = z_loss * w_t * lse.square(), w_t.sum()
        loss = loss + (z if reduction == "none" else z.sum() / denom if reduction == "mean" else z.sum())
    return loss


def loss_floor(value: torch.Tensor, reference: torch.Tensor) -> float:
    """FLOOR scaled to the magnitude of a reduced loss (a sum of ~300 in fp32 is only known to ~3e-5: one rounding
    to the output dtype)."""
    scale = reference.detach().abs().max().item() if reference.numel() else 0.0
    return FLOOR[value.dtype] * max(1.0, scale if scale == scale else 1.0)
