"""fl.cross_entropy: parity with F.cross_entropy, every argument, gradients, registration, compile, errors.

The reference backend runs on CPU tensors by default; `triton` runs the kernels (under the interpreter on
CPU, compiled on GPU for the `cuda`-marked tests).
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fusedlayers as fl
from fusedlayers import _validate
from fusedlayers.kernels import cross_entropy as kernels
from tests.parity import FLOOR, assert_parity

REDUCTIONS = ["mean", "sum", "none"]


def _targets(n_rows: int, n_classes: int, ignore_every: int = 4, ignore_index: int = -100, device="cpu"):
    t = torch.randint(0, n_classes, (n_rows,), device=device)
    if ignore_every:
        t[::ignore_every] = ignore_index
    return t


def stock_loss(x, t, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0):
    """F.cross_entropy plus the z-loss written with torch ops (in x's dtype, or float64 for the reference)."""
    loss = F.cross_entropy(x, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)
    if z_loss:
        keep = t != ignore_index
        z = torch.where(keep, z_loss * torch.logsumexp(x, 1).square(), 0.0)
        if reduction == "none":
            loss = loss + z
        else:
            z = z.sum()
            loss = loss + (z / keep.sum() if reduction == "mean" else z)
    return loss


def _relative_floor(value, reference) -> float:
    """The per-dtype floor of tests/parity.py, scaled to the magnitude of a reduced loss (a sum of ~300 in
    fp32 is only known to ~3e-5: one rounding to the output dtype)."""
    scale = reference.detach().abs().max().item() if reference.numel() else 0.0
    return FLOOR[value.dtype] * max(1.0, scale if scale == scale else 1.0)


def _check(x, t, grad_seed: int = 1, **kw):
    """Loss and input gradient of fl.cross_entropy vs the stock ops vs the float64 reference."""
    fused_in = x.detach().clone().requires_grad_()
    stock_in = x.detach().clone().requires_grad_()
    ref_in = x.detach().double().requires_grad_()
    fused = fl.cross_entropy(fused_in, t, **kw)
    stock = stock_loss(stock_in, t, **kw)
    ref = stock_loss(ref_in, t, **kw)
    assert fused.shape == stock.shape and fused.dtype == stock.dtype
    assert_parity(fused, stock, ref, "loss", floor=_relative_floor(fused, ref))
    gen = torch.Generator().manual_seed(grad_seed)
    grad = torch.rand(stock.shape, generator=gen).to(device=x.device, dtype=stock.dtype) + 0.5
    fused.backward(grad)
    stock.backward(grad)
    ref.backward(grad.double())
    assert fused_in.grad.dtype == x.dtype
    assert_parity(fused_in.grad, stock_in.grad, ref_in.grad, "grad input")


# ----------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1, 1.0])
@pytest.mark.parametrize("ignore_index", [-100, 3])
def test_reference_every_combination(dtype, reduction, label_smoothing, ignore_index):
    x = (torch.randn(37, 101) * 3).to(dtype)
    t = _targets(37, 101, ignore_index=ignore_index)
    _check(x, t, ignore_index=ignore_index, reduction=reduction, label_smoothing=label_smoothing)


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


def test_z_loss_zero_is_exactly_f_cross_entropy():
    x = torch.randn(11, 30)
    t = _targets(11, 30)
    for reduction in REDUCTIONS:
        torch.testing.assert_close(fl.cross_entropy(x, t, reduction=reduction, z_loss=0.0),
                                   F.cross_entropy(x, t, reduction=reduction), rtol=1e-6, atol=1e-6)


def test_shapes_as_f_cross_entropy():
    """(C,) with a 0-d target, (N, C, d1, d2) with (N, d1, d2), empty batches."""
    for x, t in [
        (torch.randn(9), torch.tensor(4)),
        (torch.randn(2, 7, 3, 4), torch.randint(0, 7, (2, 3, 4))),
        (torch.randn(0, 5), torch.zeros(0, dtype=torch.long)),
    ]:
        for reduction in REDUCTIONS:
            xf = x.clone().requires_grad_()
            xs = x.clone().requires_grad_()
            fused = fl.cross_entropy(xf, t, reduction=reduction, label_smoothing=0.1)
            stock = F.cross_entropy(xs, t, reduction=reduction, label_smoothing=0.1)
            torch.testing.assert_close(fused, stock, equal_nan=True)
            if x.numel():
                fused.sum().backward()
                stock.sum().backward()
                torch.testing.assert_close(xf.grad, xs.grad)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_non_contiguous_logits_and_targets(backend):
    base = torch.randn(40, 46) * 3
    views = [base.t(), base[::2, 1:].t(), base[:, 3:], base[:, ::3]]  # transposed, strided, offset rows
    with fl.use_backend(backend):
        for x in views:
            assert not x.is_contiguous()
            _check(x, _targets(x.shape[0], x.shape[1]), reduction="none", label_smoothing=0.05)
        strided_t = _targets(92, 40)[::2]
        _check(base.t(), strided_t, reduction="mean")


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_every_target_ignored(backend):
    """torch: "mean" is NaN (0/0) with zero gradients, "sum" 0, "none" zeros."""
    x = torch.randn(5, 8, requires_grad=True)
    t = torch.full((5,), -100)
    with fl.use_backend(backend):
        for reduction, expected in (("mean", float("nan")), ("sum", 0.0)):
            loss = fl.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)
            torch.testing.assert_close(loss, torch.tensor(expected), equal_nan=True)
            torch.testing.assert_close(loss, F.cross_entropy(x, t, reduction=reduction, label_smoothing=0.1),
                                       equal_nan=True)
            (g,) = torch.autograd.grad(loss, x)
            assert (g == 0).all()
        none = fl.cross_entropy(x, t, reduction="none")
        assert (none == 0).all()


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_out_of_range_targets_raise_on_cpu(backend):
    x = torch.randn(4, 10)
    with fl.use_backend(backend):
        for bad in (10, -1, 1000):
            t = torch.tensor([1, bad, 2, -100])
            with pytest.raises(_validate.TargetOutOfRangeError, match="target"):
                fl.cross_entropy(x, t)
            with pytest.raises(IndexError):  # as torch raises
                fl.cross_entropy(x, t)
        fl.cross_entropy(x, torch.tensor([1, 9, 0, -100]))  # edges are fine


def test_out_of_range_targets_in_the_kernels_give_nan_rows():
    """Called directly (no CPU check), the kernels never use a bad target as an address: NaN loss and a NaN
    gradient row for it, the other rows unaffected."""
    x = torch.randn(4, 10)
    t = torch.tensor([1, 10, -5, -100])
    loss, lse = kernels.cross_entropy_forward(x, t, -100, 0.0, 0.0)
    assert loss[1].isnan() and loss[2].isnan() and loss[3] == 0
    torch.testing.assert_close(loss[0], F.cross_entropy(x[:1], t[:1]))
    dx = kernels.cross_entropy_backward(torch.tensor(1.0), x, t, lse, -100, 0.0, 0.0, torch.empty_like(x))
    total, _ = kernels.cross_entropy_reduce(loss, t, -100, True, torch.float32)
    assert total.isnan()
    assert dx[1].isnan().all() and dx[2].isnan().all() and (dx[3] == 0).all()
    xr = x[:1].clone().requires_grad_()
    F.cross_entropy(xr, t[:1], reduction="sum").backward()
    torch.testing.assert_close(dx[0], xr.grad[0])


@pytest.mark.parametrize("backend", ["reference", "triton"])
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
    with fl.use_backend(backend):
        loss = fl.cross_entropy(x, t)
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
    assert sum(t.numel() for t in saved) <= x.numel() + 2 * 16 + 1
    loss.backward()


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
    """Rows longer than one column block: the online max/sum is rescaled across blocks."""
    x = (torch.randn(5, 3 * kernels.LONG_ROW + 17) * 3).to(dtype)
    x[1, -1] = 30.0  # the max arrives in the last block
    t = torch.tensor([0, x.shape[1] - 1, -100, 4000, 9000])
    with fl.use_backend("triton"):
        _check(x, t, reduction="none", label_smoothing=0.1, z_loss=1e-3)


def test_triton_backward_in_place_and_reduce_kernels():
    """The backward kernel written over its own input (as linear_cross_entropy does on its chunks) equals the
    out-of-place result; the reduction kernel gives torch's sum / mean and the count."""
    x = torch.randn(9, 300) * 2
    t = _targets(9, 300)
    t[1] = 299
    for smoothing, z in ((0.0, 0.0), (0.2, 1e-2)):
        loss, lse = kernels.cross_entropy_forward(x, t, -100, smoothing, z)
        for g in (torch.tensor(0.25), torch.rand(9) + 0.5):
            dx = kernels.cross_entropy_backward(g, x, t, lse, -100, smoothing, z, torch.empty_like(x))
            buf = x.clone()
            kernels.cross_entropy_backward(g, buf, t, lse, -100, smoothing, z, out=buf)
            assert torch.equal(buf, dx)
            xr = x.double().requires_grad_()
            rows = stock_loss(xr, t, reduction="none", label_smoothing=smoothing, z_loss=z)
            rows.backward(g.double().expand(9) if g.dim() == 0 else g.double())
            torch.testing.assert_close(dx, xr.grad.float(), atol=1e-6, rtol=1e-5)
        for mean in (True, False):
            total, count = kernels.cross_entropy_reduce(loss, t, -100, mean, torch.float16)
            keep = t != -100
            assert count.dtype == torch.int64 and count.item() == keep.sum().item()
            expected = loss.sum() / keep.sum() if mean else loss.sum()
            assert total.dtype == torch.float16
            torch.testing.assert_close(total, expected.half())
    long_loss = torch.rand(5000)
    long_t = _targets(5000, 7)
    total, count = kernels.cross_entropy_reduce(long_loss, long_t, -100, True, torch.float32)
    torch.testing.assert_close(total, long_loss.sum() / (long_t != -100).sum())
    _, count = kernels.cross_entropy_reduce(long_loss, torch.full((5000,), -100), -100, True, torch.float32)
    assert count.item() == 0


# ----------------------------------------------------------------------------- autograd machinery


def test_gradcheck_and_gradgradcheck():
    x = torch.randn(7, 9, dtype=torch.float64, requires_grad=True)
    t = torch.tensor([0, 8, -100, 3, 3, -100, 5])
    for reduction in REDUCTIONS:
        for smoothing, z in ((0.0, 0.0), (0.3, 0.05)):
            f = lambda v, r=reduction, s=smoothing, zz=z: fl.cross_entropy(  # noqa: E731
                v, t, reduction=r, label_smoothing=s, z_loss=zz)
            assert torch.autograd.gradcheck(f, (x,))
            assert torch.autograd.gradgradcheck(f, (x,))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_opcheck(backend):
    ops = torch.ops.fusedlayers
    x = torch.randn(9, 13, requires_grad=True)
    t = _targets(9, 13, ignore_every=3)
    with fl.use_backend(backend):
        for reduction in REDUCTIONS:
            opcheck(ops.cross_entropy.default, (x, t, -100, reduction, 0.1, 1e-2, torch.float32))
            loss, lse, count = ops.cross_entropy(x.detach(), t, -100, reduction, 0.1, 1e-2, torch.float32)
            grad = torch.rand_like(loss).requires_grad_()
            opcheck(ops.cross_entropy_backward.default, (grad, x, t, lse, count, -100, reduction, 0.1, 1e-2))
        t5 = _targets(9, 13, ignore_every=3, ignore_index=5)
        opcheck(ops.cross_entropy.default, (x.detach().half().requires_grad_(), t5, 5, "mean", 0.0, 0.0,
                                            torch.float32))


def test_compile_fullgraph_equals_eager_with_ignore_index():
    """A known failure elsewhere: the compiled loss must equal eager when targets are ignored."""
    torch._dynamo.reset()

    def f(x, t):
        return fl.cross_entropy(x * 1.5, t, label_smoothing=0.1, z_loss=1e-3) + fl.cross_entropy(
            x, t, reduction="sum") / 100

    x = torch.randn(12, 40, requires_grad=True)
    t = _targets(12, 40, ignore_every=3)
    compiled = torch.compile(f, fullgraph=True)
    loss = compiled(x, t)
    (grad,) = torch.autograd.grad(loss, x)
    loss2 = f(x, t)
    (grad2,) = torch.autograd.grad(loss2, x)
    torch.testing.assert_close(loss, loss2)
    torch.testing.assert_close(grad, grad2)
    stock = stock_loss(x * 1.5, t, label_smoothing=0.1, z_loss=1e-3) + F.cross_entropy(x, t, reduction="sum") / 100
    torch.testing.assert_close(loss, stock)  # the ignore-aware value, not a mean over all rows


def test_autocast_cpu_bf16():
    a = torch.randn(8, 16)
    w = torch.randn(40, 16)
    t = _targets(8, 40)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = a @ w.T
        fused = fl.cross_entropy(logits, t)
        stock = F.cross_entropy(logits, t)
    assert logits.dtype == torch.bfloat16
    assert fused.dtype == stock.dtype == torch.float32
    torch.testing.assert_close(fused, stock)


# ----------------------------------------------------------------------------- errors and the module


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda: fl.cross_entropy(torch.arange(6).reshape(2, 3), torch.tensor([0, 1])), TypeError, "input"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0.0, 1.0])), TypeError, "target"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), [0, 1]), TypeError, "target"),
        (lambda: fl.cross_entropy(torch.randn(2, 3), torch.tensor([0, 1, 2])), ValueError, "target"),
        (lambda: fl.cross_entropy(torch.randn(2, 3, 4), torch.tensor([0, 1])), ValueError, "target"),
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
        (lambda: fl.CrossEntropyLoss(weight=torch.ones(3)), ValueError, "weight"),
    ],
)
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


def test_module_is_a_drop_in():
    x = torch.randn(10, 7, requires_grad=True)
    t = _targets(10, 7, ignore_index=2)
    for kw in ({}, {"reduction": "sum", "ignore_index": 2}, {"reduction": "none", "label_smoothing": 0.3},
               {"size_average": False}):
        with warnings.catch_warnings():  # the legacy size_average argument warns, in both
            warnings.simplefilter("ignore", UserWarning)
            fused, stock = fl.CrossEntropyLoss(**kw), torch.nn.CrossEntropyLoss(**kw)
        torch.testing.assert_close(fused(x, t), stock(x, t))
        assert fused.state_dict().keys() == stock.state_dict().keys()
        assert fused.reduction == stock.reduction
    z = fl.CrossEntropyLoss(z_loss=1e-2, ignore_index=2)
    torch.testing.assert_close(z(x, t), stock_loss(x, t, ignore_index=2, z_loss=1e-2))
    assert "z_loss=0.01" in repr(z)


# ----------------------------------------------------------------------------- GPU (run on the lent GPU)


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
    if n_classes > 2:
        _check(x[:, 1:], torch.where(t >= n_classes - 1, 0, t), reduction="none")  # strided rows


@pytest.mark.cuda
def test_cuda_out_of_range_targets_do_not_crash():
    x = torch.randn(6, 1000, device="cuda", requires_grad=True)
    t = torch.tensor([1, 1000, -7, 5, -100, 2**40], device="cuda")
    loss = fl.cross_entropy(x, t, reduction="none")
    torch.cuda.synchronize()
    assert loss[1].isnan() and loss[2].isnan() and loss[5].isnan() and loss[4] == 0
    assert torch.isfinite(loss[[0, 3]]).all()
    loss.sum().backward()
    torch.cuda.synchronize()
    assert x.grad[1].isnan().all() and torch.isfinite(x.grad[[0, 3, 4]]).all()


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
    f = lambda v: fl.cross_entropy(v.float() * 0.5, t, label_smoothing=0.1, z_loss=1e-4)  # noqa: E731
    loss_c = torch.compile(f, fullgraph=True)(x)
    (g1,) = torch.autograd.grad(loss_c, x)
    loss_e = f(x)
    (g2,) = torch.autograd.grad(loss_e, x)
    torch.testing.assert_close(loss_c, loss_e)
    torch.testing.assert_close(g1, g2)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert fl.cross_entropy(x, t).dtype == F.cross_entropy(x, t).dtype == torch.float32
    opcheck(torch.ops.fusedlayers.cross_entropy.default, (x, t, -100, "mean", 0.1, 1e-3, torch.bfloat16))
