"""fl.linear_cross_entropy: parity with F.cross_entropy(F.linear(...)) and torch 2.13's F.linear_cross_entropy
(class weights, probability targets, K-dimensional linear weights, every reduction), chunking, torch's options,
the grad_weight accumulation dtype, in-place backward, gradients, registration, compile, errors, the module.

The reference backend runs on CPU tensors by default; `triton` runs the CE kernels between the matmuls
(under the interpreter on CPU, compiled on GPU for the `cuda`-marked tests).
"""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fusedlayers as fl
from fusedlayers.ops import linear_cross_entropy as lce_ops
from tests.parity import FLOOR, assert_parity, loss_floor, max_error, stock_cross_entropy

REDUCTIONS = ["mean", "sum", "none"]
BACKENDS = ["reference", "triton"]
HAS_TORCH_LCE = hasattr(F, "linear_cross_entropy")
LCEO = getattr(torch.nn, "LinearCrossEntropyOptions", None)
needs_torch_lce = pytest.mark.skipif(not HAS_TORCH_LCE, reason="torch < 2.13 has no F.linear_cross_entropy")


def _targets(n_rows, n_classes, ignore_every=4, ignore_index=-100, device="cpu"):
    t = torch.randint(0, n_classes, (n_rows,), device=device)
    if ignore_every:
        t[::ignore_every] = ignore_index
    return t


def _probabilities(n_rows, n_classes, device="cpu"):
    return torch.rand(n_rows, n_classes, device=device).softmax(-1)


def _class_weights(n_classes, device="cpu"):
    return torch.rand(n_classes, device=device) * 1.5 + 0.25


def stock_loss(x, w, t, b=None, weight=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0,
               logit_scale=1.0, softcap=None):
    """F.cross_entropy(F.linear(...)) plus the z-loss written with torch ops; the logits scaled and soft-capped
    as Cohere's and Gemma 2's heads do."""
    logits = F.linear(x, w, b) * logit_scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return stock_cross_entropy(logits, t, weight, ignore_index, reduction, label_smoothing, z_loss)


def _check(x, w, t, b=None, weight=None, chunk_size=None, **kw):
    """Loss and the gradients of input, linear weight (and bias, and probability targets) vs the stock ops vs
    the float64 reference."""
    soft = t.is_floating_point()
    leaves = [x, w] + ([b] if b is not None else []) + ([t] if soft else [])
    fused_in = [v.detach().clone().requires_grad_() for v in leaves]
    stock_in = [v.detach().clone().requires_grad_() for v in leaves]
    ref_in = [v.detach().double().requires_grad_() for v in leaves]
    cw = weight.to(x.dtype) if weight is not None else None

    def split(ins):
        bias = ins[2] if b is not None else None
        return ins[0], ins[1], ins[-1] if soft else t, bias

    xf, wf, tf, bf = split(fused_in)
    fused = fl.linear_cross_entropy(xf, wf, tf, linear_bias=bf, weight=cw, chunk_size=chunk_size, **kw)
    stock = stock_loss(*split(stock_in), weight=cw, **kw)
    ref = stock_loss(*split(ref_in), weight=cw.double() if cw is not None else None, **kw)
    assert fused.shape == stock.shape and fused.dtype == stock.dtype
    assert_parity(fused, stock, ref, "loss", floor=loss_floor(fused, ref))
    grad = torch.rand(stock.shape, generator=torch.Generator().manual_seed(1)).to(stock) + 0.5
    fused.backward(grad)
    stock.backward(grad)
    ref.backward(grad.double())
    names = ["input", "linear_weight"] + (["linear_bias"] if b is not None else []) + (["target"] if soft else [])
    for name, f, s, r in zip(names, fused_in, stock_in, ref_in, strict=True):
        assert f.grad.dtype == s.grad.dtype
        assert_parity(f.grad, s.grad, r.grad, f"grad {name}")


def _problem(n_rows=37, hidden=24, n_classes=101, dtype=torch.float32, bias=False, device="cpu"):
    x = torch.randn(n_rows, hidden, device=device).to(dtype)
    w = (torch.randn(n_classes, hidden, device=device) / hidden**0.5 * 2).to(dtype)
    b = (torch.randn(n_classes, device=device) * 0.5).to(dtype) if bias else None
    return x, w, b


# ----------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("bias", [False, True])
def test_reference_every_combination(dtype, reduction, label_smoothing, bias):
    x, w, b = _problem(dtype=dtype, bias=bias)
    t = _targets(37, 101)
    _check(x, w, t, b, chunk_size=8, reduction=reduction, label_smoothing=label_smoothing)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_z_loss_and_ignore_index(reduction):
    x, w, b = _problem(bias=True)
    t = _targets(37, 101, ignore_index=7)
    _check(x, w, t, b, chunk_size=10, reduction=reduction, ignore_index=7, label_smoothing=0.2, z_loss=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_class_weights(backend, reduction, label_smoothing):
    x, w, b = _problem(n_rows=29, hidden=16, n_classes=45, bias=True)
    with fl.use_backend(backend):
        _check(x, w, _targets(29, 45), b, weight=_class_weights(45), chunk_size=7, reduction=reduction,
               label_smoothing=label_smoothing)
        _check(x, w, _targets(29, 45, ignore_index=3), weight=_class_weights(45), chunk_size=7, ignore_index=3,
               reduction=reduction, label_smoothing=label_smoothing, z_loss=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("weighted", [False, True])
def test_probability_targets(backend, reduction, label_smoothing, weighted):
    """Class-probability targets, with their gradient (computed in the same chunk pass), weights per class."""
    x, w, b = _problem(n_rows=23, hidden=16, n_classes=37, bias=True)
    with fl.use_backend(backend):
        _check(x, w, _probabilities(23, 37), b, weight=_class_weights(37) if weighted else None, chunk_size=6,
               reduction=reduction, label_smoothing=label_smoothing, z_loss=1e-2 if weighted else 0.0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("transform", [dict(logit_scale=0.0625), dict(softcap=2.0), dict(logit_scale=3.0, softcap=5.0)])
def test_logit_scale_and_softcap(backend, reduction, transform):
    """The loss of scaled / soft-capped logits (Cohere, Granite, Gemma 2 heads) with every other option."""
    x, w, b = _problem(n_rows=29, hidden=16, n_classes=45, bias=True)
    with fl.use_backend(backend):
        _check(x, w, _targets(29, 45), b, chunk_size=7, reduction=reduction, **transform)
        _check(x, w, _targets(29, 45, ignore_index=3), weight=_class_weights(45), chunk_size=7, ignore_index=3,
               reduction=reduction, label_smoothing=0.2, z_loss=1e-2, **transform)
        _check(x, w, _probabilities(29, 45), b, weight=_class_weights(45), chunk_size=7, reduction=reduction,
               label_smoothing=0.1, **transform)


def test_logit_transform_on_the_exact_path_and_large_logits():
    """A K-dimensional loss (the path through the logits) applies the same transform; soft-capping keeps logits
    of 1e4 finite and its gradient (1 - tanh^2) vanishes there, as the written-out form's."""
    x, w = torch.randn(3, 5), torch.randn(10, 4, 5)
    t = torch.randint(0, 10, (3, 4))
    fused = fl.linear_cross_entropy(x, w, t, logit_scale=0.5, softcap=3.0)
    logits = torch.einsum("nh,cdh->ncd", x, w) * 0.5
    torch.testing.assert_close(fused, F.cross_entropy(torch.tanh(logits / 3.0) * 3.0, t))
    x, w, _ = _problem(n_rows=9, hidden=8, n_classes=33)
    b = torch.where(torch.arange(33) % 3 == 0, 1e4, 0.0) * torch.randn(33).sign()  # saturated columns
    for backend in BACKENDS:
        with fl.use_backend(backend):
            _check(x, w, _targets(9, 33), b, softcap=30.0, chunk_size=4)


@pytest.mark.parametrize("n_classes", [50257, 32003])
def test_large_vocab_not_a_power_of_two(n_classes):
    x, w, b = _problem(n_rows=12, hidden=16, n_classes=n_classes, dtype=torch.bfloat16, bias=True)
    t = torch.tensor([0, n_classes - 1, -100, 17, n_classes // 2, 1, 2, 3, -100, 5, 6, 7])
    for reduction in ("mean", "none"):
        _check(x, w, t, b, chunk_size=5, reduction=reduction, label_smoothing=0.1)


def test_chunk_size_does_not_change_the_result():
    x, w, b = _problem(n_rows=50, bias=True)
    t = _targets(50, 101)
    results = []
    for chunk_size in (1, 7, 16, 50, 1000, None):
        leaves = [v.clone().requires_grad_() for v in (x, w, b)]
        loss = fl.linear_cross_entropy(*leaves[:2], t, linear_bias=leaves[2], label_smoothing=0.1,
                                       chunk_size=chunk_size)
        loss.backward()
        results.append([loss.detach()] + [v.grad for v in leaves])
    for other in results[1:]:
        for a, c in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@needs_torch_lce
@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_as_torch(backend):
    """Unbatched (H,) input, K-dimensional linear weights (C, d1, ..., H) with their bias, class indices and
    probabilities, weights, every reduction: torch 2.13's F.linear_cross_entropy values, gradients, strides."""
    cases = [
        (torch.randn(6), torch.randn(9, 6), torch.tensor(4), None),
        (torch.randn(6), torch.randn(9, 6), torch.rand(9), torch.randn(9)),
        (torch.randn(5, 6), torch.randn(4, 3, 6), torch.randint(0, 4, (5, 3)), torch.randn(4, 3)),
        (torch.randn(5, 6), torch.randn(4, 3, 6), torch.rand(5, 4, 3), None),
        (torch.randn(5, 6), torch.randn(3, 2, 1, 2, 6), torch.randint(0, 3, (5, 2, 1, 2)), torch.randn(3, 2, 1, 2)),
        (torch.randn(0, 6), torch.randn(9, 6), torch.zeros(0, dtype=torch.long), None),
        (torch.randn(0, 6), torch.randn(9, 6), torch.zeros(0, 9), None),
    ]
    with fl.use_backend(backend):
        for x, w, t, b in cases:
            for reduction in REDUCTIONS:
                for cw in (None, _class_weights(w.shape[0])):
                    soft = t.is_floating_point()
                    leaves = [x, w] + ([b] if b is not None else []) + ([t] if soft else [])
                    fi = [v.clone().requires_grad_() for v in leaves]
                    si = [v.clone().requires_grad_() for v in leaves]

                    def call(f, ins, soft=soft, t=t, b=b, cw=cw, reduction=reduction, **extra):
                        return f(ins[0], ins[1], ins[-1] if soft else t,
                                 linear_bias=ins[2] if b is not None else None, weight=cw, reduction=reduction,
                                 **extra)

                    fused = call(fl.linear_cross_entropy, fi, chunk_size=2)
                    stock = call(F.linear_cross_entropy, si)
                    torch.testing.assert_close(fused, stock, equal_nan=True)
                    assert fused.stride() == stock.stride()
                    if x.numel():
                        fused.sum().backward()
                        stock.sum().backward()
                        for a, c in zip(fi, si, strict=True):
                            torch.testing.assert_close(a.grad, c.grad)


def test_leading_dims_are_flattened():
    """Beyond torch (which takes (N, H) or (H,)): (..., H) input with target (...) or (..., C)."""
    x, w, b = _problem(n_rows=24, bias=True)
    x3 = x.reshape(2, 12, 24)
    t = _targets(24, 101).reshape(2, 12)
    q = _probabilities(24, 101).reshape(2, 12, 101)
    for reduction in REDUCTIONS:
        fused = fl.linear_cross_entropy(x3, w, t, linear_bias=b, reduction=reduction, chunk_size=5)
        stock = F.cross_entropy(F.linear(x3, w, b).flatten(0, 1), t.flatten(), reduction=reduction)
        torch.testing.assert_close(fused, stock.reshape(t.shape) if reduction == "none" else stock)
        fused = fl.linear_cross_entropy(x3, w, q, linear_bias=b, reduction=reduction, chunk_size=5)
        stock = F.cross_entropy(F.linear(x3, w, b).flatten(0, 1), q.flatten(0, 1), reduction=reduction)
        torch.testing.assert_close(fused, stock.reshape(t.shape) if reduction == "none" else stock)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_target_ignored_and_empty(backend):
    x, w, b = _problem(n_rows=6, bias=True)
    t = torch.full((6,), -100)
    with fl.use_backend(backend):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fl.linear_cross_entropy(xr, wr, t, linear_bias=b)
        assert loss.isnan()
        loss.backward()
        assert (xr.grad == 0).all() and (wr.grad == 0).all()
        assert fl.linear_cross_entropy(x, w, t, linear_bias=b, reduction="sum") == 0
        empty = fl.linear_cross_entropy(x[:0], w, t[:0], reduction="none")
        assert empty.shape == (0,)
        wr.grad = None
        fl.linear_cross_entropy(x[:0], wr, t[:0], reduction="sum").backward()
        assert (wr.grad == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_inputs_never_modified(backend):
    x, w, b = _problem(bias=True)
    q = _probabilities(37, 101)
    leaves = [v.clone().requires_grad_() for v in (x, w, b, q)]
    with fl.use_backend(backend):
        for target in (_targets(37, 101), leaves[3]):
            loss = fl.linear_cross_entropy(*leaves[:2], target, linear_bias=leaves[2], chunk_size=9,
                                           weight=_class_weights(101), label_smoothing=0.1)
            loss.backward()
    for v, orig in zip(leaves, (x, w, b, q), strict=True):
        assert torch.equal(v.detach(), orig)


def test_only_requested_gradients():
    x, w, b = _problem(bias=True)
    t = _targets(37, 101)
    for wanted in ((True, False, False), (False, True, False), (False, False, True), (True, True, False)):
        leaves = [v.clone().requires_grad_(r) for v, r in zip((x, w, b), wanted, strict=True)]
        loss = fl.linear_cross_entropy(*leaves[:2], t, linear_bias=leaves[2], label_smoothing=0.1, chunk_size=8)
        loss.backward()
        stock_leaves = [v.clone().requires_grad_(r) for v, r in zip((x, w, b), wanted, strict=True)]
        stock_loss(*stock_leaves[:2], t, stock_leaves[2], label_smoothing=0.1).backward()
        for v, s, r in zip(leaves, stock_leaves, wanted, strict=True):
            assert (v.grad is None) == (not r)
            if r:
                torch.testing.assert_close(v.grad, s.grad)
    with torch.no_grad():
        loss = fl.linear_cross_entropy(x, w, t, linear_bias=b)
    torch.testing.assert_close(loss, stock_loss(x, w, t, b))


# ----------------------------------------------------------------------------- accumulation, in-place backward


def _accumulators(x, w, t, **kw):
    """The (V, H) tensors the forward saves for backward (the grad_weight accumulator), the loss. (The hook keeps
    references to the saved tensors: backward through this loss cannot hand them over as .grad.)"""
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda v: saved.append(v) or v, lambda v: v):
        loss = fl.linear_cross_entropy(x, w, t, **kw)
    return [v for v in saved if v.shape == w.shape], saved, loss


@pytest.fixture
def scaled_in_place(monkeypatch):
    """The data pointers of the buffers the backward scales in place (and returns as the gradients)."""
    ptrs = []
    scale = lce_ops._scale_in_place
    monkeypatch.setattr(lce_ops, "_scale_in_place", lambda b, g: ptrs.append(b.data_ptr()) or scale(b, g))
    return ptrs


def test_grad_weight_accumulates_in_fp32_across_chunks_by_default():
    """bf16 with 64 chunks of 2 rows: grad_weight stays as close to the float64 value as the single stock
    matmul (which sums all rows in fp32); no logits are saved."""
    torch.manual_seed(3)
    x, w, _ = _problem(n_rows=128, hidden=32, n_classes=64, dtype=torch.bfloat16)
    t = torch.randint(0, 64, (128,))
    _check(x, w, t, chunk_size=2, reduction="sum")
    acc, saved, loss = _accumulators(x.clone().requires_grad_(), w.clone().requires_grad_(), t, chunk_size=2)
    assert [v.dtype for v in acc] == [torch.float32]
    assert all(v.shape[-1] != 64 or v.dim() < 2 for v in saved)  # no logits saved
    loss.backward()


def test_accumulation_dtype_opt_in(scaled_in_place):
    """accumulation_dtype= (ours) or options.acc_dtype (torch's) accumulates grad_weight in the weight's dtype: the
    accumulator is the gradient (the same tensor becomes .grad, no fp32 buffer, no final cast)."""
    x, w, _ = _problem(n_rows=40, hidden=16, n_classes=32, dtype=torch.bfloat16)
    t = _targets(40, 32)
    spellings = [dict(accumulation_dtype=torch.bfloat16)]
    if LCEO is not None:
        spellings += [dict(options=LCEO(acc_dtype=torch.bfloat16)), dict(options=LCEO(acc_policy="compact"))]
    for kw in spellings:
        wr = w.clone().requires_grad_()
        acc, _, _ = _accumulators(x, wr, t, chunk_size=8, **kw)
        assert [v.dtype for v in acc] == [torch.bfloat16], kw
        scaled_in_place.clear()
        fl.linear_cross_entropy(x, wr, t, chunk_size=8, **kw).backward()
        assert scaled_in_place == [wr.grad.data_ptr()]  # scaled in place and taken over as .grad
        wf = w.clone().requires_grad_()
        fl.linear_cross_entropy(x, wf, t, chunk_size=8).backward()
        torch.testing.assert_close(wr.grad, wf.grad, rtol=2e-2, atol=1e-3)
    if LCEO is not None:
        with pytest.raises(ValueError, match="accumulation_dtype"):
            fl.linear_cross_entropy(x, w, t, options=LCEO(acc_dtype=torch.float32), accumulation_dtype=torch.bfloat16)
        acc, _, _ = _accumulators(x, w.clone().requires_grad_(), t, options=LCEO(acc_dtype=torch.float32))
        assert [v.dtype for v in acc] == [torch.float32]


@pytest.mark.parametrize("backend", BACKENDS)
def test_grad_weight_accuracy_fp32_vs_weight_dtype_accumulation(backend):
    """The error of grad_weight against float64, with 128 chunks: the fp32 accumulator is as accurate as torch's
    single matmul; accumulating in bf16 (the opt-in) rounds once per chunk and is clearly less accurate (but
    still a bf16-accurate gradient, not garbage)."""
    dtype = torch.bfloat16 if backend == "reference" else torch.float16  # the interpreter mishandles bf16
    torch.manual_seed(7)
    n, h, v = 512, 32, 48
    x, w, _ = _problem(n_rows=n, hidden=h, n_classes=v, dtype=dtype)
    t = torch.randint(0, v, (n,))
    xr, wr = x.double(), w.double().requires_grad_()
    (g64,) = torch.autograd.grad(F.cross_entropy(F.linear(xr, wr), t, reduction="sum"), wr)
    ws = w.clone().requires_grad_()
    (g_stock,) = torch.autograd.grad(F.cross_entropy(F.linear(x, ws), t, reduction="sum"), ws)
    errors = {}
    with fl.use_backend(backend):
        for acc in (torch.float32, dtype):
            wf = w.clone().requires_grad_()
            loss = fl.linear_cross_entropy(x, wf, t, reduction="sum", chunk_size=4, accumulation_dtype=acc)
            (g,) = torch.autograd.grad(loss, wf)
            assert g.dtype == dtype
            errors[acc] = max_error(g, g64)
    stock = max_error(g_stock, g64)
    scale = g64.abs().max().item()
    print(f"grad_weight max error vs float64 ({backend}, {dtype}, {n // 4} chunks): fp32 accumulation "
          f"{errors[torch.float32]:.3e}, {dtype} accumulation {errors[dtype]:.3e}, torch {stock:.3e}, |g| {scale:.2e}")
    assert errors[torch.float32] <= 2 * stock + FLOOR[dtype] * scale
    assert errors[dtype] > 2 * errors[torch.float32]  # the rounding per chunk is visible
    assert errors[dtype] < 0.1 * scale  # but it is a gradient


def test_in_place_backward_and_retain_graph(scaled_in_place):
    """Precomputed gradients are scaled in place: .grad is the forward's buffer, and a second backward through the
    same graph raises, naming the option that allows it; with options(allow_retain_graph=True) it works."""
    x, w, b = _problem(bias=True)
    t = _targets(37, 101)
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    loss = fl.linear_cross_entropy(xr, wr, t, linear_bias=b, chunk_size=8)
    loss.backward(torch.tensor(0.5))
    assert scaled_in_place == [xr.grad.data_ptr(), wr.grad.data_ptr()]  # fp32: the buffers themselves
    stock = [v.clone().requires_grad_() for v in (x, w)]
    (0.5 * stock_loss(*stock, t, b)).backward()
    torch.testing.assert_close(xr.grad, stock[0].grad)
    torch.testing.assert_close(wr.grad, stock[1].grad)
    xr.grad = wr.grad = None
    loss = fl.linear_cross_entropy(xr, wr, t, linear_bias=b, chunk_size=8)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="allow_retain_graph"):
        loss.backward()
    if LCEO is not None:
        loss = fl.linear_cross_entropy(xr, wr, t, linear_bias=b, options=LCEO(allow_retain_graph=True))
        g1 = torch.autograd.grad(loss, (xr, wr), retain_graph=True)
        g2 = torch.autograd.grad(loss, (xr, wr))
        for a, c in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, c)
    for reduction in ("none",):  # recomputed in backward: retain_graph works as usual
        loss = fl.linear_cross_entropy(xr, wr, t, reduction=reduction).sum()
        g1 = torch.autograd.grad(loss, (xr, wr), retain_graph=True)
        g2 = torch.autograd.grad(loss, (xr, wr))
        torch.testing.assert_close(g1[1], g2[1])


def test_autocast_fp32_master_weights_gradient_is_the_accumulator(scaled_in_place):
    """Under autocast with fp32 weights the matmuls run in bf16 and grad_weight accumulates in fp32 -- into the
    tensor that becomes weight.grad: no extra fp32 (V, H) copy, no bf16 gradient cast back up."""
    x, w, b = _problem(bias=True)
    t = _targets(37, 101)
    wr, br = w.clone().requires_grad_(), b.clone().requires_grad_()
    xr = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        acc, _, _ = _accumulators(xr, wr, t, linear_bias=br, chunk_size=8)
        fused = fl.linear_cross_entropy(xr, wr, t, linear_bias=br, chunk_size=8)
        ws, bs, xs = (v.clone().requires_grad_() for v in (w, b, x))
        stock = F.cross_entropy(F.linear(xs, ws, bs), t)
    assert [v.dtype for v in acc] == [torch.float32] and fused.dtype == stock.dtype == torch.float32
    fused.backward()
    stock.backward()
    assert wr.grad.dtype == torch.float32 and wr.grad.data_ptr() in scaled_in_place
    for a, c in ((xr, xs), (wr, ws), (br, bs)):
        assert a.grad.dtype == c.grad.dtype == torch.float32
        torch.testing.assert_close(a.grad, c.grad, rtol=3e-2, atol=3e-3)


@pytest.mark.skipif(LCEO is None, reason="torch < 2.13 has no LinearCrossEntropyOptions")
def test_options_chunking(monkeypatch):
    """options' batch_chunk_size / chunking_method are honoured ("auto" leaves the chunk to us)."""
    x, w, _ = _problem(n_rows=40)
    t = _targets(40, 101)
    seen = []
    loop = lce_ops.chunked_linear_cross_entropy
    monkeypatch.setattr(lce_ops, "chunked_linear_cross_entropy",
                        lambda *a, **k: seen.append(a[8]) or loop(*a, **k))
    expected = [(LCEO(batch_chunk_size=3), 3), (LCEO(batch_chunk_size=100), 40),
                (LCEO(chunking_method=None), 40), (LCEO(chunking_method="aspect_ratio"), 8),  # torch's formula
                (LCEO(chunking_method="aspect_ratio:4"), 2), (LCEO(), lce_ops.default_chunk_size(40, 101, x.dtype,
                                                                                                   x.device))]
    for options, rows in expected:
        seen.clear()
        fl.linear_cross_entropy(x, w, t, options=options)
        assert seen == [rows], options
    with pytest.raises(ValueError, match="chunk_size"):
        fl.linear_cross_entropy(x, w, t, options=LCEO(batch_chunk_size=3), chunk_size=4)
    with pytest.raises(ValueError, match="options"):
        fl.linear_cross_entropy(x, w, t, options=LCEO(batch_chunk_size=3, chunking_method="aspect_ratio"))


def test_default_chunk_size(monkeypatch):
    cpu = torch.device("cpu")
    budget = lce_ops.CPU_CHUNK_BYTES
    assert lce_ops.default_chunk_size(100, 1000, torch.float32, cpu) == 100  # fits: one chunk
    rows = lce_ops.default_chunk_size(100_000, 50257, torch.bfloat16, cpu)
    rows_fit = budget // (50257 * 2)
    assert rows % 64 == 0 and rows_fit - 64 < rows <= rows_fit  # nearly all of the budget, no more
    assert lce_ops.default_chunk_size(1000, 50257, torch.bfloat16, cpu) == 512  # 2 even chunks
    assert lce_ops.default_chunk_size(5, 10**9, torch.float32, cpu) == 1
    # CUDA: a fraction of the free memory, capped
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (2**30, 80 * 2**30))
    rows = lce_ops.default_chunk_size(8192, 128256, torch.bfloat16, torch.device("cuda"))
    assert rows * 128256 * 2 <= 2**30 // lce_ops.FREE_MEMORY_FRACTION and rows >= 64
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * 2**30, 80 * 2**30))
    rows = lce_ops.default_chunk_size(8192, 128256, torch.bfloat16, torch.device("cuda"))
    assert rows * 128256 * 2 <= lce_ops.MAX_CHUNK_BYTES and 8192 % rows == 0
    # accumulating in the weight's dtype (the accumulator is the gradient): the buffer at most the gradient's size
    grad_bytes = 128256 * 2048 * 2
    rows = lce_ops.default_chunk_size(8192, 128256, torch.bfloat16, torch.device("cuda"), grad_bytes)
    assert rows == 2048
    # a small weight's cap is raised to MIN_CAP_BYTES (each chunk is one more pass over the accumulator): llama-small's
    # LM head (V=50304, H=768) gets 2560-row chunks, not the 768 its 77 MB weight copy would allow
    rows = lce_ops.default_chunk_size(32768, 50304, torch.bfloat16, torch.device("cuda"), 50304 * 768 * 2)
    assert rows == 2560 and rows * 50304 * 2 <= lce_ops.MIN_CAP_BYTES


def test_chunk_cap_when_the_accumulator_is_the_gradient(monkeypatch):
    """The logits buffer is capped at the weight's size in the compute dtype exactly when grad_weight accumulates in
    the weight's own dtype: bf16 weights with bf16 accumulation, and fp32 master weights under bf16 autocast (the
    compute-dtype copy's size, half the fp32 gradient's); no cap for the fp32 accumulator of bf16 weights."""
    caps = []
    monkeypatch.setattr(lce_ops, "default_chunk_size", lambda *args: caps.append(args[-1]) or 1)
    monkeypatch.setattr(lce_ops, "matmul_dtype", lambda dtype, device: dtype)  # as on CUDA
    x = torch.empty(8, 16, device="meta")
    for weight_dtype, compute, acc in ((torch.bfloat16, torch.bfloat16, torch.bfloat16),
                                       (torch.float32, torch.bfloat16, torch.float32),
                                       (torch.bfloat16, torch.bfloat16, torch.float32)):
        lce_ops._chunk_for(0, x, torch.empty(100, 16, dtype=weight_dtype, device="meta"), compute, acc)
    assert caps == [100 * 16 * 2, 100 * 16 * 2, None]


# ----------------------------------------------------------------------------- Triton kernels (interpreter on CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_triton_path(dtype, reduction):
    x, w, b = _problem(n_rows=21, hidden=16, n_classes=77, dtype=dtype, bias=True)
    with fl.use_backend("triton"):
        _check(x, w, _targets(21, 77), b, chunk_size=8, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)


def test_triton_scale_kernels():
    from fusedlayers.kernels import linear_cross_entropy as kernels

    src = torch.randn(37, 129)
    for g, dtype in ((torch.tensor(0.37), torch.float16), (torch.tensor(2.0, dtype=torch.bfloat16), torch.float32)):
        out = kernels.scale_cast(src, g, dtype)
        torch.testing.assert_close(out, (src * g.float()).to(dtype))
    assert kernels.scale_cast(src[:, ::2], torch.tensor(1.0), torch.float32).is_contiguous()
    buf = src.half()
    expected = (buf.float() * 0.37).half()
    assert kernels.scale_(buf, torch.tensor(0.37)) is buf
    torch.testing.assert_close(buf, expected, rtol=0, atol=0)
    # a factor of exactly 1 in place leaves every bit as it was (NaN, inf, -0); scale_cast still casts
    special = torch.tensor([float("nan"), float("inf"), -0.0, 1e-8])
    buf = torch.cat([src.flatten(), special]).half()
    before = buf.clone()
    assert kernels.scale_(buf, torch.tensor(1.0)) is buf
    assert torch.equal(buf.view(torch.int16), before.view(torch.int16))
    cast = kernels.scale_cast(buf, torch.tensor(1.0), torch.float32)
    torch.testing.assert_close(cast, before.float(), equal_nan=True)
    kernels.scale_(buf, torch.tensor(1.0 + 2**-10))  # the smallest step above 1 in fp16 still scales
    torch.testing.assert_close(buf, (before.float() * (1.0 + 2**-10)).half(), rtol=0, atol=0, equal_nan=True)


# ----------------------------------------------------------------------------- autograd machinery


@pytest.mark.skipif(LCEO is None, reason="gradcheck backs up through the graph again: needs allow_retain_graph")
def test_gradcheck():
    x, w, b = (v.double().requires_grad_() for v in _problem(n_rows=7, hidden=5, n_classes=9, bias=True))
    t = torch.tensor([0, 8, -100, 3, 3, -100, 5])
    q = _probabilities(7, 9).double().requires_grad_()
    cw = _class_weights(9).double()
    retain = LCEO(allow_retain_graph=True)
    for reduction in REDUCTIONS:
        for smoothing, z, weight in ((0.0, 0.0, None), (0.3, 0.05, cw)):
            f = lambda a, c, d, r=reduction, s=smoothing, zz=z, ww=weight: fl.linear_cross_entropy(  # noqa: E731
                a, c, t, linear_bias=d, weight=ww, reduction=r, label_smoothing=s, z_loss=zz, chunk_size=3,
                options=retain)
            assert torch.autograd.gradcheck(f, (x, w, b))
            g = lambda a, c, d, p, r=reduction, s=smoothing, zz=z, ww=weight: fl.linear_cross_entropy(  # noqa: E731
                a, c, p, linear_bias=d, weight=ww, reduction=r, label_smoothing=s, z_loss=zz, chunk_size=3,
                options=retain)
            assert torch.autograd.gradcheck(g, (x, w, b, q))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    ops = torch.ops.fusedlayers
    x, w, b = (v.requires_grad_() for v in _problem(n_rows=9, hidden=8, n_classes=13, bias=True))
    t = _targets(9, 13, ignore_every=3)
    q = _probabilities(9, 13).requires_grad_()
    cw = _class_weights(13)
    f32 = torch.float32
    with fl.use_backend(backend):
        for reduction in REDUCTIONS:
            for flags in ((True, True, True, True), (False, True, False, False)):
                for target, weight in ((t, None), (q, cw)):
                    opcheck(ops.linear_cross_entropy.default,
                            (x, w, target, b, weight, -100, reduction, 0.1, 1e-2, 0.5, 3.0, 4, f32, f32, f32, True,
                             *flags))
        opcheck(ops.linear_cross_entropy.default, (x, w, t, None, None, -100, "mean", 0.0, 0.0, 1.0, None, 0, f32, f32,
                                                   f32, True, True, True, False, False))
        opcheck(ops.linear_cross_entropy.default,  # autocast's shape: fp32 tensors, bf16 matmuls, bf16 accumulator
                (x, w, t, b, None, -100, "mean", 0.0, 0.0, 1.0, None, 4, torch.bfloat16, torch.bfloat16, f32, True,
                 True, True, True, False))
        opcheck(ops.linear_cross_entropy_scale_grad.default, (torch.randn(4, 5), torch.tensor(2.0), torch.float16))
        for target, weight in ((t, None), (q.detach(), cw)):
            _, lse, aux, *_ = ops.linear_cross_entropy(x.detach(), w.detach(), target, b.detach(), weight, -100, "none",
                                                       0.1, 1e-2, 1.0, None, 4, f32, f32, f32, True, False, False,
                                                       False, False)
            opcheck(ops.linear_cross_entropy_backward.default,
                    (torch.rand(9), x.detach(), w.detach(), target, b.detach(), weight, lse, aux, -100, "none", 0.1,
                     1e-2, 1.0, None, 4, f32, f32, True, True, True, True))


def test_compile_fullgraph_equals_eager_with_ignore_index():
    torch._dynamo.reset()
    cw = _class_weights(101)

    def f(x, w, b, t, q):
        return (fl.linear_cross_entropy(x, w, t, linear_bias=b, label_smoothing=0.1, chunk_size=8)
                + fl.linear_cross_entropy(x * 2, w, t, reduction="none", z_loss=1e-3).sum() / 50
                + fl.linear_cross_entropy(x, w, q, weight=cw, chunk_size=16))

    x, w, b = (v.requires_grad_() for v in _problem(bias=True))
    t = _targets(37, 101, ignore_every=3)
    q = _probabilities(37, 101).requires_grad_()
    loss = torch.compile(f, fullgraph=True)(x, w, b, t, q)
    grads = torch.autograd.grad(loss, (x, w, b, q))
    loss2 = f(x, w, b, t, q)
    grads2 = torch.autograd.grad(loss2, (x, w, b, q))
    torch.testing.assert_close(loss, loss2)
    for g1, g2 in zip(grads, grads2, strict=True):
        torch.testing.assert_close(g1, g2)
    stock = (stock_loss(x, w, t, b, label_smoothing=0.1)
             + stock_loss(x * 2, w, t, reduction="none", z_loss=1e-3).sum() / 50 + stock_loss(x, w, q, weight=cw))
    torch.testing.assert_close(loss, stock)


def test_autocast_cpu_bf16():
    x, w, b = (v.requires_grad_() for v in _problem(bias=True))
    t = _targets(37, 101)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = fl.linear_cross_entropy(x, w, t, linear_bias=b, chunk_size=8)
        stock = F.cross_entropy(F.linear(x, w, b), t)
    assert fused.dtype == stock.dtype == torch.float32
    torch.testing.assert_close(fused, stock, rtol=2e-2, atol=2e-2)  # both from bf16 logits
    gf = torch.autograd.grad(fused, (x, w, b))
    gs = torch.autograd.grad(stock, (x, w, b))
    for a, c in zip(gf, gs, strict=True):
        assert a.dtype == c.dtype == torch.float32
        torch.testing.assert_close(a, c, rtol=3e-2, atol=3e-3)


# ----------------------------------------------------------------------------- signature, errors, the module


@needs_torch_lce
def test_signature_is_torchs():
    """torch 2.13's parameters, order, kinds and defaults; our extras keyword-only after them."""
    ours = inspect.signature(fl.linear_cross_entropy).parameters
    theirs = inspect.signature(F.linear_cross_entropy).parameters
    assert list(ours)[: len(theirs)] == list(theirs)
    extras = ["z_loss", "chunk_size", "accumulation_dtype", "logit_scale", "softcap"]
    assert list(ours)[len(theirs):] == extras
    for name, p in theirs.items():
        assert ours[name].default == p.default and ours[name].kind == p.kind, name
    assert all(ours[n].kind == inspect.Parameter.KEYWORD_ONLY for n in extras)
    mod_ours = inspect.signature(fl.LinearCrossEntropyLoss.__init__).parameters
    mod_theirs = inspect.signature(torch.nn.LinearCrossEntropyLoss.__init__).parameters
    assert list(mod_ours)[: len(mod_theirs)] == list(mod_theirs)
    for name, p in mod_theirs.items():
        assert mod_ours[name].default == p.default and mod_ours[name].kind == p.kind, name
    assert list(inspect.signature(fl.LinearCrossEntropyLoss.forward).parameters) == ["self", "input", "target"]


def _lce(*args, **kw):
    return lambda: fl.linear_cross_entropy(*args, **kw)


L4 = torch.zeros(4, dtype=torch.long)


@pytest.mark.parametrize(
    "call, error, name",
    [
        (_lce(torch.randn(4, 3), torch.randn(5, 2), L4), ValueError, "input"),
        (_lce(torch.randn(4, 3), torch.randn(5), L4), ValueError, "linear_weight"),
        (_lce(torch.randn(3), torch.randn(5, 2, 3), torch.tensor(0)), ValueError, "batched"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(3, dtype=torch.long)), ValueError, "target"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4)), TypeError, "target"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, 4)), ValueError, "target"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, 5, dtype=torch.long)), TypeError, "target"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3).double(), L4), TypeError, "linear_weight"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), L4, linear_bias=torch.randn(4)), ValueError, "linear_bias"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), L4, weight=torch.randn(4)), ValueError, "weight"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), torch.rand(4, 5), ignore_index=-100), ValueError, "ignore_index"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), torch.tensor([0, 1, 5, 2])), ValueError, "target"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), L4, chunk_size=0), ValueError, "chunk_size"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), L4, reduction="mean "), ValueError, "reduction"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), L4, label_smoothing=-0.1), ValueError, "label_smoothing"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), L4, accumulation_dtype=torch.int32), TypeError,
         "accumulation_dtype"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), L4, options={"batch_chunk_size": 2}), TypeError, "options"),
        (lambda: fl.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), L4, None), TypeError, "positional"),
        (lambda: fl.LinearCrossEntropyLoss(3, 5, weight=torch.ones(4)), ValueError, "weight"),
        (lambda: fl.LinearCrossEntropyLoss(3, 5, label_smoothing=2.0), ValueError, "label_smoothing"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), L4, logit_scale=0.0), ValueError, "logit_scale"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), L4, logit_scale="2"), TypeError, "logit_scale"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), L4, softcap=0.0), ValueError, "softcap"),
        (_lce(torch.randn(4, 3), torch.randn(5, 3), L4, softcap=float("inf")), ValueError, "softcap"),
        (lambda: fl.LinearCrossEntropyLoss(3, 5, softcap=-1.0), ValueError, "softcap"),
    ],
)
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


@needs_torch_lce
def test_module_is_a_drop_in():
    """Same constructor, parameters, buffers and forward as torch 2.13's nn.LinearCrossEntropyLoss."""
    x = torch.randn(37, 24)
    t = _targets(37, 101, ignore_index=3)
    for kw in ({}, {"bias": True, "reduction": "sum", "ignore_index": 3},
               {"reduction": "none", "label_smoothing": 0.3, "weight": _class_weights(101)}):
        torch.manual_seed(0)
        stock = torch.nn.LinearCrossEntropyLoss(24, 101, **kw)
        fused = fl.LinearCrossEntropyLoss(24, 101, **kw, chunk_size=16)
        assert fused.state_dict().keys() == stock.state_dict().keys()
        fused.load_state_dict(stock.state_dict())
        stock.load_state_dict(fused.state_dict())
        torch.testing.assert_close(fused(x, t), stock(x, t))
        fused(x, t).sum().backward()
        stock(x, t).sum().backward()
        for (n, a), (_, c) in zip(fused.named_parameters(), stock.named_parameters(), strict=True):
            torch.testing.assert_close(a.grad, c.grad, msg=n)
    kdim = fl.LinearCrossEntropyLoss(5, 10, out_features=(4, 3), bias=True)
    stock = torch.nn.LinearCrossEntropyLoss(5, 10, out_features=(4, 3), bias=True)
    stock.load_state_dict(kdim.state_dict())
    xk, tk = torch.randn(2, 5), torch.randint(0, 10, (2, 4, 3))
    torch.testing.assert_close(kdim(xk, tk), stock(xk, tk))
    qk = torch.rand(2, 10, 4, 3).softmax(1)
    torch.testing.assert_close(kdim(xk, qk), stock(xk, qk))
    assert "chunk_size=16" in repr(fl.LinearCrossEntropyLoss(3, 4, chunk_size=16))


def test_module_without_torch_twin_fields():
    m = fl.LinearCrossEntropyLoss(24, 101, bias=True, dtype=torch.float64, z_loss=1e-3,
                                  accumulation_dtype=torch.float64, logit_scale=0.5, softcap=4.0)
    assert m.linear.weight.shape == (101, 24) and m.linear.weight.dtype == torch.float64
    assert "softcap=4.0" in repr(m)
    x = torch.randn(7, 24, dtype=torch.float64)
    t = _targets(7, 101)
    torch.testing.assert_close(m(x, t), stock_loss(x, m.linear.weight, t, m.linear.bias, z_loss=1e-3,
                                                   logit_scale=0.5, softcap=4.0))


# ----------------------------------------------------------------------------- GPU (the `cuda` tests)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_classes", [77, 32003, 50257])
def test_cuda_parity(dtype, n_classes):
    x, w, b = _problem(n_rows=300, hidden=64, n_classes=n_classes, dtype=dtype, bias=True, device="cuda")
    t = _targets(300, n_classes, device="cuda")
    for reduction in REDUCTIONS:
        _check(x, w, t, b, chunk_size=128, reduction=reduction, label_smoothing=0.1)
    _check(x, w, t, None, reduction="mean", z_loss=1e-3)  # default chunk size
    cw = _class_weights(n_classes, device="cuda")
    _check(x, w, t, b, weight=cw, chunk_size=128, reduction="mean", label_smoothing=0.1)
    q = _probabilities(300, n_classes, device="cuda").to(dtype)
    _check(x, w, q, b, weight=cw, chunk_size=128, reduction="sum", label_smoothing=0.1)
    _check(x, w, q, None, chunk_size=128, reduction="none")
    _check(x, w, t, b, chunk_size=128, reduction="mean", label_smoothing=0.1, logit_scale=0.25, softcap=3.0)
    _check(x, w, t, None, reduction="sum", softcap=1.5)


def _peak_extra(fn) -> int:
    fn()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


@pytest.mark.cuda
def test_cuda_logits_never_materialised():
    n, h, v = 4096, 256, 32000
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    t = _targets(n, v, device="cuda")

    def step(**kw):
        x.grad = w.grad = None
        return lambda: torch.autograd.grad(fl.linear_cross_entropy(x, w, t, chunk_size=512, **kw), (x, w))

    chunk_bytes = 512 * v * 2
    # fp32 accumulator: forward chunk + accumulator + grad_x; backward accumulator + the bf16 grad_W cast
    extra = _peak_extra(step())
    bound = max(chunk_bytes + w.numel() * 4 + x.numel() * 2, w.numel() * (4 + 2) + x.numel() * 2)
    assert extra <= bound + 8 * 2**20 < n * v * 2, (extra, bound)
    # bf16 accumulator (the opt-in): it is the gradient; chunk + grad_W + grad_x, nothing else
    extra = _peak_extra(step(accumulation_dtype=torch.bfloat16))
    bound = chunk_bytes + w.numel() * 2 + x.numel() * 2
    assert extra <= bound + 8 * 2**20, (extra, bound)


@pytest.mark.cuda
def test_cuda_autocast_fp32_master_weights_no_extra_copy():
    """fp32 weights under bf16 autocast: the fp32 accumulator is the gradient (no second fp32 (V, H) tensor)."""
    n, h, v = 2048, 256, 32000
    x = torch.randn(n, h, device="cuda", requires_grad=True)
    w = (torch.randn(v, h, device="cuda") / 16).requires_grad_()
    t = _targets(n, v, device="cuda")

    def step():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = fl.linear_cross_entropy(x, w, t, chunk_size=512)
        return torch.autograd.grad(loss, (x, w))

    extra = _peak_extra(step)
    # bf16 copy of W (forward only) + fp32 accumulator (= grad_W) + chunk + grad_x (fp32) and its bf16 chunk
    bound = w.numel() * (2 + 4) + 512 * v * 2 + x.numel() * 4 + 512 * h * 2
    assert extra <= bound + 8 * 2**20, (extra, bound)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = fl.linear_cross_entropy(x, w, t, chunk_size=512)
        stock = F.cross_entropy(F.linear(x, w), t)
    torch.testing.assert_close(fused, stock, rtol=1e-2, atol=1e-2)


@pytest.mark.cuda
def test_cuda_compile_autocast_and_opcheck():
    torch._dynamo.reset()
    x, w, b = (v.requires_grad_() for v in _problem(n_rows=256, hidden=64, n_classes=5000, bias=True,
                                                    device="cuda"))
    t = _targets(256, 5000, device="cuda")
    f = lambda a, c, d: fl.linear_cross_entropy(a, c, t, linear_bias=d, label_smoothing=0.1, z_loss=1e-4,  # noqa: E731
                                                softcap=3.0)
    loss_c = torch.compile(f, fullgraph=True)(x, w, b)
    g1 = torch.autograd.grad(loss_c, (x, w, b))
    loss_e = f(x, w, b)
    g2 = torch.autograd.grad(loss_e, (x, w, b))
    torch.testing.assert_close(loss_c, loss_e)
    for a, c in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, c)
    from fusedlayers.kernels import linear_cross_entropy as lce_kernels

    lce_kernels._ADDMM_OUT_DTYPE.clear()  # the first call (and its probe) from inside an autocast region
    with torch.autocast("cuda", dtype=torch.bfloat16):
        fused = fl.linear_cross_entropy(x, w, t, linear_bias=b)
        stock = F.cross_entropy(F.linear(x, w, b), t)
    assert fused.dtype == stock.dtype == torch.float32
    torch.testing.assert_close(fused, stock, rtol=1e-2, atol=1e-2)
    # grad_weight accumulated by one bf16 x bf16 -> fp32 cuBLAS call per chunk, not an fp32 SIMT matmul on
    # upcast copies (autocast once broke the probe: 3x slower in the gpt-small profile)
    assert lce_kernels._ADDMM_OUT_DTYPE[x.device] is True
    bf16 = torch.bfloat16
    opcheck(torch.ops.fusedlayers.linear_cross_entropy.default,
            (x.bfloat16(), w.bfloat16(), t, b.bfloat16(), None, -100, "mean", 0.1, 0.0, 0.5, 3.0, 64, bf16,
             torch.float32, bf16, True, True, True, True, False))
