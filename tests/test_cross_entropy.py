"""fl.cross_entropy: parity with F.cross_entropy (class indices and probabilities, class weights, label
smoothing, every reduction and shape), gradients, registration, compile, errors, the module.

The reference backend runs on CPU tensors by default; `triton` runs the kernels (under the interpreter on
CPU, compiled on GPU for the `cuda`-marked tests).
"""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fusedlayers as fl
from fusedlayers import _validate
from fusedlayers.kernels import cross_entropy as kernels
from tests.parity import assert_parity, loss_floor
from tests.parity import stock_cross_entropy as stock_loss

REDUCTIONS = ["mean", "sum", "none"]
BACKENDS = ["reference", "triton"]


def _targets(n_rows: int, n_classes: int, ignore_every: int = 4, ignore_index: int = -100, device="cpu"):
    t = torch.randint(0, n_classes, (n_rows,), device=device)
    if ignore_every:
        t[::ignore_every] = ignore_index
    return t


def _probabilities(shape, device="cpu", class_dim: int = 1):
    return torch.rand(shape, device=device).softmax(class_dim if len(shape) > 1 else 0)


def _class_weights(n_classes: int, device="cpu"):
    return torch.rand(n_classes, device=device) * 1.5 + 0.25


def _check(x, t, grad_seed: int = 1, weight=None, **kw):
    """Loss and gradients (input; probabilities too) of fl.cross_entropy vs the stock ops vs the float64
    reference. Class weights go to torch in the input's dtype (torch requires it for class indices)."""
    soft = t.is_floating_point()
    wanted = [x] + ([t] if soft else [])
    fused_in = [a.detach().clone().requires_grad_() for a in wanted]
    stock_in = [a.detach().clone().requires_grad_() for a in wanted]
    ref_in = [a.detach().double().requires_grad_() for a in wanted]
    w = weight.to(x.dtype) if weight is not None else None
    w64 = w.double() if w is not None else None

    def args(ins):
        return ins[0], ins[1] if soft else t

    fused = fl.cross_entropy(*args(fused_in), weight=w, **kw)
    stock = stock_loss(*args(stock_in), weight=w, **kw)
    ref = stock_loss(*args(ref_in), weight=w64, **kw)
    assert fused.shape == stock.shape and fused.dtype == stock.dtype
    assert_parity(fused, stock, ref, "loss", floor=loss_floor(fused, ref))
    gen = torch.Generator().manual_seed(grad_seed)
    grad = torch.rand(stock.shape, generator=gen).to(device=x.device, dtype=stock.dtype) + 0.5
    fused.backward(grad)
    stock.backward(grad)
    ref.backward(grad.double())
    for name, f, s, r in zip(("input", "target"), fused_in, stock_in, ref_in, strict=False):
        assert f.grad.dtype == s.grad.dtype
        assert_parity(f.grad, s.grad, r.grad, f"grad {name}")


# ----------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_reference_every_combination(dtype, reduction, label_smoothing, ignore_index):
    x = (torch.randn(37, 101) * 3).to(dtype)
    t = _targets(37, 101, ignore_index=ignore_index)
    _check(x, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_class_weights(backend, dtype, reduction, label_smoothing):
    """torch's weighted semantics: w[t] per row, "mean" over sum(w[t]) of the kept rows, the smoothing term
    weighted per class (LossNLL.cpp cross_entropy_loss_label_smoothing)."""
    if backend == "triton" and dtype == torch.bfloat16:
        pytest.skip("the interpreter mishandles bf16")
    x = (torch.randn(29, 45) * 3).to(dtype)
    with fl.use_backend(backend):
        _check(x, _targets(29, 45), weight=_class_weights(45), reduction=reduction, label_smoothing=label_smoothing)
        _check(x, _targets(29, 45, ignore_index=2), weight=_class_weights(45), ignore_index=2, reduction=reduction,
               label_smoothing=label_smoothing, z_loss=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.3])
@pytest.mark.parametrize("weighted", [False, True])
def test_probability_targets(backend, dtype, reduction, label_smoothing, weighted):
    """Class-probability targets (with their gradient), weights scale each class, "mean" over the rows."""
    if backend == "triton" and dtype == torch.bfloat16:
        pytest.skip("the interpreter mishandles bf16")
    x = (torch.randn(23, 37) * 3).to(dtype)
    q = _probabilities((23, 37)).to(dtype)
    with fl.use_backend(backend):
        _check(x, q, weight=_class_weights(37) if weighted else None, reduction=reduction,
               label_smoothing=label_smoothing)
        if dtype == torch.float32:  # unnormalised "probabilities" are fine too (torch does not check them)
            _check(x, torch.rand(23, 37) / 10, weight=_class_weights(37) if weighted else None, reduction=reduction,
                   label_smoothing=label_smoothing, z_loss=1e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_keep_their_precision(backend):
    """Smoothing and probability sums are taken relative to the running max: logits around 1e4 lose nothing
    against torch (whose log_softmax subtracts first)."""
    x = torch.randn(16, 300) * 3 + 1e4
    with fl.use_backend(backend):
        _check(x, _targets(16, 300), reduction="none", label_smoothing=0.2)
        _check(x, _targets(16, 300), weight=_class_weights(300), reduction="none", label_smoothing=0.2)
        _check(x, _probabilities((16, 300)), reduction="none", label_smoothing=0.1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_z_loss(dtype, reduction, label_smoothing):
    x = (torch.randn(29, 64) * 4).to(dtype)
    _check(x, _targets(29, 64), reduction=reduction, label_smoothing=label_smoothing, z_loss=1e-2)


@pytest.mark.parametrize("n_classes", [50257, 32003])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_large_vocab_not_a_power_of_two(n_classes, dtype):
    x = (torch.randn(6, n_classes) * 2).to(dtype)
    t = torch.tensor([0, n_classes - 1, -100, 17, n_classes // 2, 1])
    for reduction in REDUCTIONS:
        _check(x, t, reduction=reduction, label_smoothing=0.1)
    _check(x, t, weight=_class_weights(n_classes), reduction="mean", label_smoothing=0.1)


def test_z_loss_zero_is_exactly_f_cross_entropy():
    x = torch.randn(11, 30)
    t = _targets(11, 30)
    for reduction in REDUCTIONS:
        torch.testing.assert_close(fl.cross_entropy(x, t, reduction=reduction, z_loss=0.0),
                                   F.cross_entropy(x, t, reduction=reduction), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_shapes_as_f_cross_entropy(backend):
    """(C,) unbatched, (N, C, d1, d2), empty batches: class indices and probabilities, with and without weights,
    every reduction: torch's values, gradients, output shapes and strides."""
    w7 = _class_weights(7)
    cases = [
        (torch.randn(9), torch.tensor(4), None),
        (torch.randn(9), _probabilities((9,)), None),
        (torch.randn(9), torch.tensor(4), _class_weights(9)),
        (torch.randn(2, 7, 3, 4), torch.randint(0, 7, (2, 3, 4)), None),
        (torch.randn(2, 7, 3, 4), torch.randint(0, 7, (2, 3, 4)), w7),
        (torch.randn(2, 7, 3, 4), _probabilities((2, 7, 3, 4)), w7),
        (torch.randn(3, 7, 5), _probabilities((3, 7, 5)), None),
        (torch.randn(0, 5), torch.zeros(0, dtype=torch.long), None),
        (torch.randn(0, 5), torch.zeros(0, 5), None),
        (torch.randn(0, 5), torch.zeros(0, dtype=torch.long), _class_weights(5)),
    ]
    with fl.use_backend(backend):
        for x, t, w in cases:
            for reduction in REDUCTIONS:
                leaves = [x, t] if t.is_floating_point() else [x]
                fused_in = [a.clone().requires_grad_() for a in leaves]
                stock_in = [a.clone().requires_grad_() for a in leaves]
                tf = fused_in[1] if len(leaves) == 2 else t
                ts = stock_in[1] if len(leaves) == 2 else t
                fused = fl.cross_entropy(fused_in[0], tf, w, reduction=reduction, label_smoothing=0.1)
                stock = F.cross_entropy(stock_in[0], ts, w, reduction=reduction, label_smoothing=0.1)
                torch.testing.assert_close(fused, stock, equal_nan=True)
                assert fused.stride() == stock.stride()
                if x.numel():
                    fused.sum().backward()
                    stock.sum().backward()
                    for a, b in zip(fused_in, stock_in, strict=True):
                        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_logits_and_targets(backend):
    base = torch.randn(40, 46) * 3
    views = [base.t(), base[::2, 1:].t(), base[:, 3:], base[:, ::3]]  # transposed, strided, offset rows
    with fl.use_backend(backend):
        for x in views:
            assert not x.is_contiguous()
            _check(x, _targets(x.shape[0], x.shape[1]), reduction="none", label_smoothing=0.05)
        strided_t = _targets(92, 40)[::2]
        _check(base.t(), strided_t, reduction="mean")
        q = _probabilities((46, 80))[:, ::2]  # strided probability rows
        _check(base.t(), q, weight=_class_weights(40), reduction="none", label_smoothing=0.1)
        _check(base.t(), _probabilities((40, 46)).t(), reduction="mean")  # transposed probabilities


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_target_ignored(backend):
    """torch: "mean" is NaN (0/0) with zero gradients, "sum" 0, "none" zeros; with weights too."""
    x = torch.randn(5, 8, requires_grad=True)
    t = torch.full((5,), -100)
    with fl.use_backend(backend):
        for w in (None, _class_weights(8)):
            for reduction, expected in (("mean", float("nan")), ("sum", 0.0)):
                loss = fl.cross_entropy(x, t, w, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
                torch.testing.assert_close(loss, torch.tensor(expected), equal_nan=True)
                torch.testing.assert_close(loss, F.cross_entropy(x, t, w, reduction=reduction, label_smoothing=0.1),
                                           equal_nan=True)
                (g,) = torch.autograd.grad(loss, x)
                assert (g == 0).all()
            none = fl.cross_entropy(x, t, w, reduction="none")
            assert (none == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_range_targets_raise_on_cpu(backend):
    x = torch.randn(4, 10)
    with fl.use_backend(backend):
        for bad in (10, -1, 1000):
            t = torch.tensor([1, bad, 2, -100])
            with pytest.raises(_validate.TargetOutOfRangeError, match="target"):
                fl.cross_entropy(x, t)
            with pytest.raises(IndexError):  # as torch raises
                fl.cross_entropy(x, t, _class_weights(10))
        fl.cross_entropy(x, torch.tensor([1, 9, 0, -100]))  # edges are fine


def test_out_of_range_targets_in_the_kernels_give_nan_rows():
    """Called directly (no CPU check), the kernels never use a bad target as an address: NaN loss and a NaN
    gradient row for it, the other rows unaffected; with class weights too."""
    x = torch.randn(4, 10)
    t = torch.tensor([1, 10, -5, -100])
    for w in (None, _class_weights(10)):
        loss, lse, aux = kernels.cross_entropy_forward(x, t, -100, 0.1, 0.0, weight=w)
        assert loss[1].isnan() and loss[2].isnan() and loss[3] == 0
        torch.testing.assert_close(loss[0], F.cross_entropy(x[:1], t[:1], w, reduction="sum", label_smoothing=0.1))
        dx = kernels.cross_entropy_backward(torch.tensor(1.0), x, t, lse, -100, 0.1, 0.0, torch.empty_like(x),
                                            weight=w, aux=aux)
        total, _ = kernels.cross_entropy_reduce(loss, t, -100, True, torch.float32, weight=w)
        assert total.isnan()
        assert dx[1].isnan().all() and dx[2].isnan().all() and (dx[3] == 0).all()
        xr = x[:1].clone().requires_grad_()
        F.cross_entropy(xr, t[:1], w, reduction="sum", label_smoothing=0.1).backward()
        torch.testing.assert_close(dx[0], xr.grad[0])


@pytest.mark.parametrize("backend", BACKENDS)
def test_logits_never_modified_and_gradient_is_new(backend):
    x = torch.randn(8, 33, requires_grad=True)
    before = x.detach().clone()
    t = _targets(8, 33)
    with fl.use_backend(backend):
        loss = fl.cross_entropy(x, t, label_smoothing=0.1, z_loss=1e-3)
        assert torch.equal(x.detach(), before)
        loss.backward()
    assert torch.equal(x.detach(), before)
    assert x.grad.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    # a second backward through the same graph gives the same gradient (nothing was consumed)
    x.grad = None
    q = _probabilities((8, 33))
    with fl.use_backend(backend):
        for target in (t, q):
            loss = fl.cross_entropy(x, target, _class_weights(33), label_smoothing=0.1)
            g1 = torch.autograd.grad(loss, x, retain_graph=True)[0]
            g2 = torch.autograd.grad(loss, x)[0]
            torch.testing.assert_close(g1, g2)


def test_saves_logits_and_logsumexp_not_probabilities():
    saved = []

    def pack(t):
        saved.append(t)
        return t

    x = torch.randn(16, 50, requires_grad=True)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = fl.cross_entropy(x, _targets(16, 50))
    big = [t for t in saved if t.numel() >= x.numel()]
    assert len(big) == 1 and big[0].data_ptr() == x.data_ptr()  # the logits themselves, no copy
    assert sum(t.numel() for t in saved) <= x.numel() + 16 + 2 * 16 + 1  # + targets, logsumexp (hi, lo), denominator
    loss.backward()


def test_weights_that_require_grad():
    """torch differentiates the weights with probability targets (class indices: it refuses); we give the
    gradient in both cases, through plain PyTorch ops."""
    x = torch.randn(6, 5, requires_grad=True)
    q = _probabilities((6, 5)).requires_grad_()
    for reduction in REDUCTIONS:
        w = _class_weights(5).requires_grad_()
        ws = w.detach().clone().requires_grad_()
        fused = fl.cross_entropy(x, q, w, reduction=reduction, label_smoothing=0.1)
        stock = F.cross_entropy(x, q, ws, reduction=reduction, label_smoothing=0.1)
        torch.testing.assert_close(fused, stock)
        g1 = torch.autograd.grad(fused.sum(), (x, q, w))
        g2 = torch.autograd.grad(stock.sum(), (x, q, ws))
        for a, b in zip(g1, g2, strict=True):
            torch.testing.assert_close(a, b)
    t = _targets(6, 5, ignore_every=3)
    w = _class_weights(5).requires_grad_()
    loss = fl.cross_entropy(x, t, w, label_smoothing=0.2)
    (gw,) = torch.autograd.grad(loss, w)
    # torch's class-index loss with smoothing = its probability loss on smoothed one-hot rows ("sum"), divided by
    # the kept rows' weights; that one torch differentiates in the weights
    keep = t != -100
    w64 = w.detach().double().requires_grad_()
    onehot = F.one_hot(t[keep], 5).double()
    ref = F.cross_entropy(x.detach().double()[keep], onehot, w64, reduction="sum", label_smoothing=0.2)
    ref = ref / w64[t[keep]].sum()
    (gw_ref,) = torch.autograd.grad(ref, w64)
    torch.testing.assert_close(loss, ref.float())
    torch.testing.assert_close(gw, gw_ref.float())


# ----------------------------------------------------------------------------- Triton kernels (interpreter on CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing, z_loss", [(0.0, 0.0), (0.15, 0.0), (0.1, 1e-2)])
def test_triton_kernels(dtype, reduction, label_smoothing, z_loss):
    x = (torch.randn(21, 77) * 3).to(dtype)
    with fl.use_backend("triton"):
        _check(x, _targets(21, 77), reduction=reduction, label_smoothing=label_smoothing, z_loss=z_loss)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernels_long_rows_several_blocks(dtype):
    """Rows longer than one column block: the online max/sum (and the relative sums) are rescaled across blocks."""
    x = (torch.randn(5, 3 * kernels.LONG_ROW + 17) * 3).to(dtype)
    x[1, -1] = 30.0  # the max arrives in the last block
    t = torch.tensor([0, x.shape[1] - 1, -100, 4000, 9000])
    with fl.use_backend("triton"):
        _check(x, t, reduction="none", label_smoothing=0.1, z_loss=1e-3)
        _check(x, t, weight=_class_weights(x.shape[1]), reduction="none", label_smoothing=0.1)
        _check(x, _probabilities(x.shape).to(dtype), weight=_class_weights(x.shape[1]), reduction="none",
               label_smoothing=0.1)


def test_triton_backward_in_place_and_reduce_kernels():
    """The backward kernel written over its own input (as linear_cross_entropy does on its chunks) equals the
    out-of-place result; the reduction kernel gives torch's sum / mean and the denominator."""
    x = torch.randn(9, 300) * 2
    t = _targets(9, 300)
    t[1] = 299
    q = _probabilities((9, 300))
    for target, w in ((t, None), (t, _class_weights(300)), (q, None), (q, _class_weights(300))):
        soft = target.is_floating_point()
        for smoothing, z in ((0.0, 0.0), (0.2, 1e-2)):
            loss, lse, aux = kernels.cross_entropy_forward(x, target, -100, smoothing, z, weight=w)
            assert (aux is not None) == (soft or (w is not None and smoothing != 0))
            for g in (torch.tensor(0.25), torch.rand(9) + 0.5):
                gt = torch.empty_like(q) if soft else None
                dx = kernels.cross_entropy_backward(g, x, target, lse, -100, smoothing, z, torch.empty_like(x),
                                                    weight=w, aux=aux, grad_target=gt)
                buf = x.clone()
                kernels.cross_entropy_backward(g, buf, target, lse, -100, smoothing, z, out=buf, weight=w, aux=aux)
                assert torch.equal(buf, dx)
                xr = x.double().requires_grad_()
                tr = target.double().requires_grad_() if soft else target
                rows = stock_loss(xr, tr, w.double() if w is not None else None, reduction="none",
                                  label_smoothing=smoothing, z_loss=z)
                rows.backward(g.double().expand(9) if g.dim() == 0 else g.double())
                torch.testing.assert_close(dx, xr.grad.float(), atol=1e-6, rtol=1e-5)
                if soft:
                    torch.testing.assert_close(gt, tr.grad.float(), atol=1e-5, rtol=1e-5)
            for mean in (True, False):
                total, denom = kernels.cross_entropy_reduce(loss, target, -100, mean, torch.float16, weight=w)
                keep = t != -100
                expected_denom = (9.0 if soft else w[torch.where(keep, t, 0)][keep].sum() if w is not None
                                  else keep.sum().float())
                assert denom.dtype == torch.float32
                torch.testing.assert_close(denom, torch.as_tensor(expected_denom, dtype=torch.float32))
                expected = loss.sum() / expected_denom if mean else loss.sum()
                assert total.dtype == torch.float16
                torch.testing.assert_close(total, torch.as_tensor(expected).half())
    long_loss = torch.rand(5000)
    long_t = _targets(5000, 7)
    total, _ = kernels.cross_entropy_reduce(long_loss, long_t, -100, True, torch.float32)
    torch.testing.assert_close(total, long_loss.sum() / (long_t != -100).sum())
    _, denom = kernels.cross_entropy_reduce(long_loss, torch.full((5000,), -100), -100, True, torch.float32)
    assert denom.item() == 0


# ----------------------------------------------------------------------------- autograd machinery


def test_gradcheck_and_gradgradcheck():
    x = torch.randn(7, 9, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 8, -100, 3, 3, -100, 5])
    q = _probabilities((7, 9)).double().requires_grad_()
    w = _class_weights(9).double()
    for reduction in REDUCTIONS:
        for smoothing, z in ((0.0, 0.0), (0.3, 0.05)):
            for weight in (None, w):
                f = lambda v, r=reduction, s=smoothing, zz=z, ww=weight: fl.cross_entropy(  # noqa: E731
                    v, t, ww, reduction=r, label_smoothing=s, z_loss=zz)
                assert torch.autograd.gradcheck(f, (x,))
                assert torch.autograd.gradgradcheck(f, (x,))
                g = lambda v, p, r=reduction, s=smoothing, zz=z, ww=weight: fl.cross_entropy(  # noqa: E731
                    v, p, ww, reduction=r, label_smoothing=s, z_loss=zz)
                assert torch.autograd.gradcheck(g, (x, q))
                assert torch.autograd.gradgradcheck(g, (x, q))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    ops = torch.ops.fusedlayers
    x = torch.randn(9, 13, requires_grad=True)
    t = _targets(9, 13, ignore_every=3)
    q = _probabilities((9, 13)).requires_grad_()
    w = _class_weights(13)
    with fl.use_backend(backend):
        for reduction in REDUCTIONS:
            for target, weight in ((t, None), (t, w), (q, None), (q, w)):
                opcheck(ops.cross_entropy.default, (x, target, weight, -100, reduction, 0.1, 1e-2, torch.float32))
                loss, lse, aux, denom = ops.cross_entropy(x.detach(), target.detach(), weight, -100, reduction, 0.1,
                                                          1e-2, torch.float32)
                grad = torch.rand_like(loss).requires_grad_()
                opcheck(ops.cross_entropy_backward.default,
                        (grad, x, target, weight, lse, aux, denom, -100, reduction, 0.1, 1e-2, True))
        t5 = _targets(9, 13, ignore_every=3, ignore_index=5)
        opcheck(ops.cross_entropy.default, (x.detach().half().requires_grad_(), t5, None, 5, "mean", 0.0, 0.0,
                                            torch.float32))


def test_compile_fullgraph_equals_eager_with_ignore_index():
    """A known failure elsewhere: the compiled loss must equal eager when targets are ignored."""
    torch._dynamo.reset()
    w = _class_weights(40)

    def f(x, t, q):
        return (fl.cross_entropy(x * 1.5, t, label_smoothing=0.1, z_loss=1e-3)
                + fl.cross_entropy(x, t, reduction="sum") / 100 + fl.cross_entropy(x, t, w, label_smoothing=0.2)
                + fl.cross_entropy(x, q, w))

    x = torch.randn(12, 40, requires_grad=True)
    t = _targets(12, 40, ignore_every=3)
    q = _probabilities((12, 40)).requires_grad_()
    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(x, t, q)
    grads = torch.autograd.grad(loss, (x, q))
    loss2 = f(x, t, q)
    grads2 = torch.autograd.grad(loss2, (x, q))
    torch.testing.assert_close(loss, loss2)
    for a, b in zip(grads, grads2, strict=True):
        torch.testing.assert_close(a, b)
    stock = (stock_loss(x * 1.5, t, label_smoothing=0.1, z_loss=1e-3) + F.cross_entropy(x, t, reduction="sum") / 100
             + F.cross_entropy(x, t, w, label_smoothing=0.2) + F.cross_entropy(x, q, w))
    torch.testing.assert_close(loss, stock)  # the ignore-aware value, not a mean over all rows


def test_autocast_cpu_bf16():
    a = torch.randn(8, 16)
    w = torch.randn(40, 16)
    t = _targets(8, 40)
    q = _probabilities((8, 40))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = a @ w.T
        for target, weight in ((t, None), (t, _class_weights(40)), (q, _class_weights(40))):
            fused = fl.cross_entropy(logits, target, weight)
            stock = F.cross_entropy(logits, target, weight)
            assert fused.dtype == stock.dtype == torch.float32
            torch.testing.assert_close(fused, stock)
    assert logits.dtype == torch.bfloat16


# ----------------------------------------------------------------------------- signature, errors, the module


def test_signature_is_torchs():
    """torch's parameters in torch's order and defaults; our z_loss keyword-only after them."""
    ours = inspect.signature(fl.cross_entropy).parameters
    theirs = inspect.signature(F.cross_entropy).parameters
    assert list(ours)[: len(theirs)] == list(theirs) and list(ours)[len(theirs):] == ["z_loss"]
    for name, p in theirs.items():
        assert ours[name].default == p.default and ours[name].kind == p.kind, name
    assert ours["z_loss"].kind == inspect.Parameter.KEYWORD_ONLY
    x, t, w = torch.randn(6, 5), _targets(6, 5, ignore_every=0), _class_weights(5)
    # positional, as torch: weight, size_average, ignore_index, reduce, reduction, label_smoothing
    torch.testing.assert_close(fl.cross_entropy(x, t, w, None, 2, None, "sum", 0.1),
                               F.cross_entropy(x, t, w, None, 2, None, "sum", 0.1))


def test_legacy_size_average_and_reduce_map_as_torch():
    x, t = torch.randn(6, 5), _targets(6, 5, ignore_every=0)
    for size_average in (None, True, False):
        for reduce in (None, True, False):
            if size_average is None and reduce is None:
                continue
            with warnings.catch_warnings(record=True) as ours:
                warnings.simplefilter("always")
                fused = fl.cross_entropy(x, t, size_average=size_average, reduce=reduce, reduction="none")
            with warnings.catch_warnings(record=True) as theirs:
                warnings.simplefilter("always")
                stock = F.cross_entropy(x, t, size_average=size_average, reduce=reduce, reduction="none")
            torch.testing.assert_close(fused, stock)
            assert [str(w.message) for w in ours] == [str(w.message) for w in theirs]


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda: fl.cross_entropy(torch.arange(6).reshape(2, 3), torch.tensor([0, 1])), TypeError, "input"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0.0, 1.0])), ValueError, "target"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([True, False])), TypeError, "target"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), [0, 1]), TypeError, "target"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1, 2])), ValueError, "target"),
        (lambda: fl.cross_entropy(torch.randn(2, 3, 4), torch.tensor([0, 1])), ValueError, "target"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.rand(2, 4)), ValueError, "target"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.rand(2, 3), ignore_index=1), ValueError, "ignore_index"),
        (lambda: fl.cross_entropy(torch.randn(2, 0), torch.tensor([0, 1])), ValueError, "class"),
        (lambda: fl.cross_entropy(torch.tensor(1.0), torch.tensor(0)), ValueError, "input"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), reduction="avg"), ValueError,
         "reduction"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), label_smoothing=1.5), ValueError,
         "label_smoothing"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), z_loss=-1.0), ValueError, "z_loss"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), ignore_index=1.0), TypeError,
         "ignore_index"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0, 3])), ValueError, "target"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), torch.ones(4)), ValueError, "weight"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), torch.ones(3, dtype=torch.long)),
         TypeError, "weight"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), [1.0, 2.0, 3.0]), TypeError, "weight"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1]), None, None, -100, None, "mean", 0.0, 0.1),
         TypeError, "positional"),  # z_loss is keyword-only
        (lambda: fl.CrossEntropyLoss(weight=torch.ones(3, 1)), ValueError, "weight"),
        (lambda: fl.CrossEntropyLoss(weight=torch.ones(3, dtype=torch.long)), TypeError, "weight"),
    ],
)
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


def test_module_is_a_drop_in():
    x = torch.randn(10, 7, requires_grad=True)
    t = _targets(10, 7, ignore_index=2)
    q = _probabilities((10, 7))
    w = _class_weights(7)
    for kw in ({}, {"reduction": "sum", "ignore_index": 2}, {"reduction": "none", "label_smoothing": 0.3},
               {"size_average": False}, {"weight": w}, {"weight": w, "label_smoothing": 0.2, "ignore_index": 2}):
        with warnings.catch_warnings():  # the legacy size_average argument warns, in both
            warnings.simplefilter("ignore", UserWarning)
            fused, stock = fl.CrossEntropyLoss(**kw), torch.nn.CrossEntropyLoss(**kw)
        torch.testing.assert_close(fused(x, t), stock(x, t))
        if "ignore_index" not in kw:
            torch.testing.assert_close(fused(x, q), stock(x, q))
        assert fused.state_dict().keys() == stock.state_dict().keys()
        assert fused.reduction == stock.reduction
        fused.load_state_dict(stock.state_dict())
    # positional arguments as torch's: weight, size_average, ignore_index, reduce, reduction, label_smoothing
    torch.testing.assert_close(fl.CrossEntropyLoss(w, None, 2, None, "sum", 0.1)(x, t),
                               torch.nn.CrossEntropyLoss(w, None, 2, None, "sum", 0.1)(x, t))
    z = fl.CrossEntropyLoss(z_loss=1e-2, ignore_index=2)
    torch.testing.assert_close(z(x, t), stock_loss(x, t, ignore_index=2, z_loss=1e-2))
    assert "z_loss=0.01" in repr(z)
    moved = fl.CrossEntropyLoss(weight=w).to(torch.float64)
    assert moved.weight.dtype == torch.float64  # a buffer, as torch's


# ----------------------------------------------------------------------------- GPU (the `cuda` tests)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_classes", [1, 77, 4096, 32003, 50257, 128256])
def test_cuda_parity(dtype, n_classes):
    x = (torch.randn(67, n_classes, device="cuda") * 3).to(dtype)
    t = _targets(67, n_classes, device="cuda")
    t[1] = n_classes - 1
    for reduction in REDUCTIONS:
        _check(x, t, reduction=reduction, label_smoothing=0.1)
    _check(x, t, reduction="mean", z_loss=1e-3)
    w = _class_weights(n_classes, device="cuda")
    _check(x, t, weight=w, reduction="mean", label_smoothing=0.1, z_loss=1e-3)
    _check(x, t, weight=w, reduction="none")
    q = _probabilities((67, n_classes), device="cuda").to(dtype)
    _check(x, q, reduction="mean", label_smoothing=0.1)
    _check(x, q, weight=w, reduction="none", z_loss=1e-3)
    if n_classes > 2:
        _check(x[:, 1:], torch.where(t >= n_classes - 1, 0, t), reduction="none")  # strided rows


@pytest.mark.cuda
def test_cuda_out_of_range_targets_do_not_crash():
    x = torch.randn(6, 1000, device="cuda", requires_grad=True)
    t = torch.tensor([1, 1000, -7, 5, -100, 2**40], device="cuda")
    for w in (None, _class_weights(1000, device="cuda")):
        loss = fl.cross_entropy(x, t, w, reduction="none", label_smoothing=0.1)
        torch.cuda.synchronize()
        assert loss[1].isnan() and loss[2].isnan() and loss[5].isnan() and loss[4] == 0
        assert torch.isfinite(loss[[0, 3]]).all()
        (g,) = torch.autograd.grad(loss.sum(), x)
        torch.cuda.synchronize()
        assert g[1].isnan().all() and torch.isfinite(g[[0, 3, 4]]).all()


@pytest.mark.cuda
def test_cuda_peak_memory_one_logits_buffer():
    x = torch.randn(4096, 32768, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = _targets(4096, 32768, device="cuda")
    logits_bytes = x.numel() * x.element_size()
    fl.cross_entropy(x, t).backward()  # warm up (autotuning)
    x.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fl.cross_entropy(x, t).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra <= logits_bytes + 8 * 2**20, extra / logits_bytes


@pytest.mark.cuda
def test_cuda_compile_autocast_and_opcheck():
    torch._dynamo.reset()
    x = torch.randn(64, 5000, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    t = _targets(64, 5000, device="cuda")
    w = _class_weights(5000, device="cuda")
    f = lambda v: fl.cross_entropy(v.float() * 0.5, t, w, label_smoothing=0.1, z_loss=1e-4)  # noqa: E731
    loss_c = torch.compile(f, fullgraph=True)(x)
    (g1,) = torch.autograd.grad(loss_c, x)
    loss_e = f(x)
    (g2,) = torch.autograd.grad(loss_e, x)
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(g1, g2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert fl.cross_entropy(x, t).dtype == F.cross_entropy(x, t).dtype == torch.float32
    opcheck(torch.ops.fusedlayers.cross_entropy.default, (x, t, None, -100, "mean", 0.1, 1e-3, torch.bfloat16))
    q = _probabilities((64, 5000), device="cuda").to(torch.bfloat16).requires_grad_()
    opcheck(torch.ops.fusedlayers.cross_entropy.default, (x, q, w, -100, "mean", 0.1, 1e-3, torch.bfloat16))
