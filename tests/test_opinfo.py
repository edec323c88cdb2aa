"""Drop-in check against torch itself: PyTorch's own OpInfo sample inputs through the ``fl.*`` twins.

For every sample of the OpInfo entries below that torch accepts, the fused twin must give torch's value
(parity rule of tests/parity.py: at most 2x torch's error against a float64 evaluation of torch's own op,
plus the dtype's floor), torch's output dtype, shape and strides, and the gradient of every input that
requires grad (same rule). A sample torch refuses is not counted. Run on the reference backend (every
dtype) and on the Triton kernels (the interpreter on CPU: fp32/fp16, as the interpreter mishandles bf16
dot products; the compiled kernels on the GPU, every dtype, ``cuda``-marked).

Attention samples with ``dropout_p > 0`` cannot match torch's random stream. For those we read the
probabilities that were applied, dropout included, by running the same call (same seed) with
``value = eye(S)`` (our keep mask hashes (key, query, batch*head) and never depends on ``value``), check
each kept entry is the undropped probability / (1 - p) and each dropped one is 0, and then check the
output and the gradients equal float64 attention with that keep mask.

Known exceptions (samples torch accepts that a twin refuses with a clear error): none.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch.utils._pytree import tree_flatten, tree_map

import fusedlayers as fl
from tests.conftest import HAS_CUDA, INTERPRETER
from tests.parity import FLOOR, UNIT_ROUNDOFF, gamma, max_error

common_methods_invocations = pytest.importorskip(
    "torch.testing._internal.common_methods_invocations", reason="OpInfo needs the expecttest package")

TWINS = {
    ("softmax", ""): fl.softmax,
    ("softmax", "with_dtype"): fl.softmax,
    ("nn.functional.cross_entropy", ""): fl.cross_entropy,
    ("nn.functional.scaled_dot_product_attention", ""): fl.scaled_dot_product_attention,
    ("nn.functional.linear_cross_entropy", ""): fl.linear_cross_entropy,
    ("nn.functional.linear_cross_entropy", "chunked"): fl.linear_cross_entropy,
    ("nn.functional.linear_cross_entropy", "chunked_none"): fl.linear_cross_entropy,
    ("nn.functional.rms_norm", ""): fl.rms_norm,
    ("nn.functional.layer_norm", ""): fl.layer_norm,
}
OPINFOS = {(op.name, op.variant_test_name): op for op in common_methods_invocations.op_db
           if (op.name, op.variant_test_name) in TWINS}


def entry_id(key) -> str:
    return key[0].split(".")[-1] + (f".{key[1]}" if key[1] else "")


def cases(device: str, backend: str, dtypes=None):
    out = []
    for key in TWINS:
        if key not in OPINFOS:  # torch 2.11 has no linear_cross_entropy OpInfo
            continue
        for dtype in sorted(OPINFOS[key].supported_dtypes(device), key=str):
            if dtypes is None or dtype in dtypes:
                out.append(pytest.param(key, dtype, device, backend, id=f"{entry_id(key)}-{str(dtype)[6:]}"))
    return out


def torch_op(key):
    op = OPINFOS[key]
    if key[0] == "nn.functional.scaled_dot_product_attention":
        return torch.nn.functional.scaled_dot_product_attention  # the OpInfo wraps it in a seed setter
    return op.op


def floating(t) -> bool:
    return isinstance(t, torch.Tensor) and t.is_floating_point()


def to_float64(x):
    """The sample in float64 (leaves that required grad still do); dtype arguments become float64."""
    if floating(x):
        return x.detach().double().requires_grad_(x.requires_grad)
    if isinstance(x, torch.dtype) and x.is_floating_point:
        return torch.float64
    return x


def grad_leaves(sample) -> list[torch.Tensor]:
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return [t for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad]


def run(fn, sample, grad_out=None):
    """fn on the sample under a fixed seed; its gradients (for ``grad_out``) of every input that requires grad."""
    torch.manual_seed(1234)
    out = fn(sample.input, *sample.args, **sample.kwargs)
    leaves = grad_leaves(sample)
    if grad_out is None or not leaves or not out.requires_grad:
        return out.detach(), []
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype), allow_unused=True)
    return out.detach(), [torch.zeros_like(t) if g is None else g for t, g in zip(leaves, grads, strict=True)]


def in_float64(sample) -> SimpleNamespace:
    """The sample with every floating tensor (and dtype argument) in float64, leaves still requiring grad."""
    input, args, kwargs = tree_map(to_float64, (sample.input, sample.args, sample.kwargs))
    if kwargs.get("options") is not None:  # chunking options (an fp32 accumulator): torch's exact path instead
        kwargs = {**kwargs, "options": None}
    return SimpleNamespace(input=input, args=args, kwargs=kwargs)


def strides_agree(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal strides on every dim of size > 1 (a stride of a size-0/1 dim is never used to address)."""
    return all(sa == sb for n, sa, sb in zip(a.shape, a.stride(), b.stride(), strict=True) if n > 1)


def compare(what: str, fused: torch.Tensor, stock: torch.Tensor, reference: torch.Tensor, check_strides=True):
    """Problems with ``fused`` against torch's ``stock`` result (parity rule against the float64 reference)."""
    if fused.shape != stock.shape or fused.dtype != stock.dtype:
        return [f"{what}: {fused.dtype}{tuple(fused.shape)} != torch's {stock.dtype}{tuple(stock.shape)}"]
    problems = []
    if check_strides and not strides_agree(fused, stock):
        problems.append(f"{what}: strides {fused.stride()} != torch's {stock.stride()}")
    if fused.is_floating_point():
        # the dtype's floor, relative to the output's scale (a few ulps of its largest value: an exact result
        # rounded differently differs by that much, however large the values are)
        finite = reference[reference.isfinite()].abs()
        floor = FLOOR[fused.dtype] * max(1.0, finite.max().item() if finite.numel() else 1.0)
        fused_err, stock_err = max_error(fused, reference), max_error(stock, reference)
        if not fused_err <= 2 * stock_err + floor:
            problems.append(f"{what}: error {fused_err:.3e} > 2 x torch's {stock_err:.3e} + {floor:.0e}")
    elif not torch.equal(fused, stock):
        problems.append(f"{what}: differs from torch's")
    return problems


def describe(sample) -> str:
    def one(x):
        if isinstance(x, torch.Tensor):
            layout = "" if x.is_contiguous() else f" strides {x.stride()}"
            return f"{str(x.dtype)[6:]}{tuple(x.shape)}{layout}"
        return repr(x)
    args = ", ".join(one(a) for a in (sample.input, *sample.args))
    kwargs = ", ".join(f"{k}={one(v)}" for k, v in sample.kwargs.items())
    return f"({args}{', ' if kwargs else ''}{kwargs})"


def check_sample(key, sample, twin, backend: str) -> list[str] | None:
    """Problems of the twin on this sample; None when torch itself refuses the sample."""
    op = torch_op(key)
    try:
        stock, _ = run(op, sample)
    except Exception:
        return None  # torch refuses it: not a sample to match
    grad_out = torch.randn(stock.shape, dtype=torch.float64, device=stock.device) if grad_leaves(sample) else None
    stock, stock_grads = run(op, sample, grad_out)
    if key[0] == "nn.functional.scaled_dot_product_attention" and sample.kwargs.get("dropout_p", 0.0) > 0:
        return check_dropout_sample(sample, twin, backend, grad_out, stock)
    reference, reference_grads = run(op, in_float64(sample), grad_out)
    try:
        with fl.use_backend(backend):
            fused, fused_grads = run(twin, sample, grad_out)
    except Exception as e:
        return [f"raised {type(e).__name__}: {e}"]
    if key[0] == "nn.functional.scaled_dot_product_attention" and fused.dtype in (torch.float32, torch.float64):
        return check_attention_bound(sample, grad_out, fused, fused_grads, stock)
    problems = compare("output", fused, stock, reference)
    if len(fused_grads) != len(stock_grads):
        return [*problems, f"{len(fused_grads)} gradients, torch gives {len(stock_grads)}"]
    for i, (gf, gs, gr) in enumerate(zip(fused_grads, stock_grads, reference_grads, strict=True)):
        problems += compare(f"grad {i}", gf, gs, gr, check_strides=False)
    return problems


def check_attention_bound(sample, grad_out, fused, fused_grads, stock, dropout=None) -> list[str]:
    """fp32 / fp64 attention: comparing two errors (2x + floor) depends on the CPU's summation order (see
    tests/test_scaled_dot_product_attention.py), so the fused output and gradients must instead lie within the
    elementwise first-order error bound derived there (``attention_error_bounds``: gamma_n per sum, any order).
    Batch dims that broadcast are expanded for the bound; the gradient of a broadcast input is the sum of its
    expanded gradient, so its bound is the sum of the expanded bounds plus gamma_n of that sum of magnitudes."""
    from tests.test_scaled_dot_product_attention import attention_error_bounds

    q, k, v = sample.input, *sample.args[:2]
    kw = sample.kwargs
    mask, causal, scale = kw.get("attn_mask"), kw.get("is_causal", False), kw.get("scale")
    batch = torch.broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
    full = [t.detach().double().expand(*batch, *t.shape[-2:]).clone().requires_grad_() for t in (q, k, v)]
    u = UNIT_ROUNDOFF[fused.dtype]
    bounds = attention_error_bounds(*full, mask, grad_out, causal, scale, u=u, dropout=dropout)
    if dropout is None:
        out64 = torch.nn.functional.scaled_dot_product_attention(
            *full, attn_mask=None if mask is None else mask.double(), is_causal=causal, scale=scale)
    else:
        out64 = dropped_attention(*full, causal, scale, dropout)
    grads64 = torch.autograd.grad(out64, full, grad_out)
    if fused.shape != stock.shape or fused.dtype != stock.dtype or not strides_agree(fused, stock) and dropout is None:
        return [f"output: {fused.dtype}{tuple(fused.shape)} {fused.stride()} != torch's {stock.dtype}"
                f"{tuple(stock.shape)} {stock.stride()}"]
    checks = [("output", fused, out64, bounds["output"])]
    for name, t, got, g64, bound in zip(("dq", "dk", "dv"), (q, k, v), fused_grads, grads64,
                                        (bounds["dq"], bounds["dk"], bounds["dv"]), strict=False):
        n = g64.numel() // max(1, t.numel())  # expanded elements summed into each of t's
        checks.append((name, got, g64.sum_to_size(t.shape),
                       bound.sum_to_size(t.shape) + gamma(n, u) * g64.abs().sum_to_size(t.shape)))
    # fp32 underflow: each of the L * S products summed into an element may flush below 2**-126 to zero
    underflow = 2.0**-126 * 4 * full[0].shape[-2] * full[1].shape[-2]
    problems = []
    for name, got, want, bound in checks:
        excess = ((got.double() - want).abs() - bound).max().item() if got.numel() else 0.0
        if not excess <= underflow:
            problems.append(f"{name}: exceeds the fp32 error bound by {excess:.3e}")
    return problems


def dropped_attention(q, k, v, is_causal, scale, factors):
    """Attention with explicit dropout factors (0 or 1 / (1 - p)) on the probabilities: torch's math-path formula."""
    scores = q @ k.transpose(-2, -1) * (scale or 1 / math.sqrt(q.shape[-1]))
    if is_causal:
        causal = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
    return (scores.softmax(-1) * factors.to(scores.dtype)) @ v


def check_dropout_sample(sample, twin, backend: str, grad_out, stock) -> list[str]:
    """Dropout: the output and gradients equal float64 attention with the keep mask that was applied."""
    q, k, v = sample.input, *sample.args[:2]
    kwargs = dict(sample.kwargs)
    p, S = kwargs["dropout_p"], k.shape[-2]
    eye = torch.eye(S, dtype=v.dtype, device=v.device).expand(*v.shape[:-2], S, S)
    try:
        with fl.use_backend(backend):
            fused, fused_grads = run(twin, sample, grad_out)
            torch.manual_seed(1234)  # the seed run() used: the same keep mask
            applied = twin(q.detach(), k.detach(), eye, **kwargs).double()  # (..., L, S) probabilities applied
    except Exception as e:
        return [f"raised {type(e).__name__}: {e}"]
    if fused.shape != stock.shape or fused.dtype != stock.dtype:
        return [f"output: {fused.dtype}{tuple(fused.shape)} != torch's {stock.dtype}{tuple(stock.shape)}"]
    undropped = dict(kwargs, dropout_p=0.0)
    probs = torch.nn.functional.scaled_dot_product_attention(q.detach().double(), k.detach().double(),
                                                             eye.double(), **undropped)
    keep = applied > probs * (0.5 / (1 - p))  # kept: probs / (1 - p); dropped: 0
    tol = 1e-5 if q.dtype in (torch.float32, torch.float64) else 1e-2
    problems = []
    if not torch.allclose(applied, torch.where(keep, probs / (1 - p), 0.0), atol=tol, rtol=tol):
        problems.append("applied probabilities are not the softmax's, kept / (1 - p) or dropped")

    factors = keep / (1 - p)
    if q.dtype in (torch.float32, torch.float64):
        return problems + check_attention_bound(sample, grad_out, fused, fused_grads, fused, dropout=factors)
    explicit = SimpleNamespace(input=q, args=(k, v), kwargs=dict(is_causal=kwargs.get("is_causal", False),
                                                                 scale=kwargs.get("scale"), factors=factors))
    stock, stock_grads = run(dropped_attention, explicit, grad_out)
    reference, reference_grads = run(dropped_attention, in_float64(explicit), grad_out)
    problems += compare("output", fused, stock, reference, check_strides=False)
    for i, (gf, gs, gr) in enumerate(zip(fused_grads, stock_grads, reference_grads, strict=True)):
        problems += compare(f"grad {i}", gf, gs, gr, check_strides=False)
    return problems


def check_entry(key, dtype, device, backend):
    op = OPINFOS[key]
    samples = list(op.sample_inputs(device, dtype, requires_grad=dtype.is_floating_point))
    failures, accepted = [], 0
    for i, sample in enumerate(samples):
        problems = check_sample(key, sample, TWINS[key], backend)
        accepted += problems is not None
        failures += [f"sample {i} {describe(sample)}: {problem}" for problem in problems or ()]
    assert accepted or not dtype.is_floating_point, f"torch accepted none of the {len(samples)} samples"
    assert not failures, f"{len(failures)} problems in {len(samples)} samples:\n" + "\n".join(failures[:40])


@pytest.mark.parametrize("key, dtype, device, backend", cases("cpu", "reference"))
def test_opinfo_reference(key, dtype, device, backend):
    check_entry(key, dtype, device, backend)


@pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (CPU runs)")
@pytest.mark.parametrize("key, dtype, device, backend",
                         cases("cpu", "triton", dtypes=(torch.float32, torch.float16)))
def test_opinfo_triton_interpreter(key, dtype, device, backend):
    check_entry(key, dtype, device, backend)


@pytest.mark.cuda
@pytest.mark.parametrize("key, dtype, device, backend", cases("cuda", "triton") if HAS_CUDA else [])
def test_opinfo_cuda(key, dtype, device, backend):
    check_entry(key, dtype, device, backend)
