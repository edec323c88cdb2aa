"""fl.linear_cross_entropy: parity with F.cross_entropy(F.linear(...)), chunking, fp32 grad_weight
accumulation, gradients, registration, compile, errors.

The reference backend runs on CPU tensors by default; `triton` runs the CE kernels between the matmuls
(under the interpreter on CPU, compiled on GPU for the `cuda`-marked tests).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fusedlayers as fl
from fusedlayers.ops import linear_cross_entropy as lce_ops
from tests.parity import FLOOR, assert_parity

REDUCTIONS = ["mean", "sum", "none"]


def _targets(n_rows, n_classes, ignore_every=4, ignore_index=-100, device="cpu"):
    t = torch.randint(0, n_classes, (n_rows,), device=device)
    if ignore_every:
        t[::ignore_every] = ignore_index
    return t


def stock_loss(x, w, t, b=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, z_loss=0.0):
    logits = F.linear(x, w, b)
    loss = F.cross_entropy(logits, t, ignore_index=ignore_index, reduction=reduction,
                           label_smoothing=label_smoothing)
    if z_loss:
        keep = t != ignore_index
        z = torch.where(keep, z_loss * torch.logsumexp(logits, -1).square(), 0.0)
        if reduction == "none":
            loss = loss + z
        else:
            loss = loss + (z.sum() / keep.sum() if reduction == "mean" else z.sum())
    return loss


def _relative_floor(value, reference) -> float:
    """tests/parity.py's per-dtype floor scaled to the magnitude of a reduced loss (one output rounding)."""
    scale = reference.detach().abs().max().item() if reference.numel() else 0.0
    return FLOOR[value.dtype] * max(1.0, scale if scale == scale else 1.0)


def _check(x, w, t, b=None, chunk_size=None, **kw):
    """Loss and the gradients of input, weight (and bias) vs the stock ops vs the float64 reference."""
    leaves = [x, w] + ([b] if b is not None else [])
    fused_in = [v.detach().clone().requires_grad_() for v in leaves]
    stock_in = [v.detach().clone().requires_grad_() for v in leaves]
    ref_in = [v.detach().double().requires_grad_() for v in leaves]

    def call(f, ins, **extra):
        return f(ins[0], ins[1], t, ins[2] if b is not None else None, **kw, **extra)

    fused = call(fl.linear_cross_entropy, fused_in, chunk_size=chunk_size)
    stock = call(stock_loss, stock_in)
    ref = call(stock_loss, ref_in)
    assert fused.shape == stock.shape and fused.dtype == stock.dtype
    assert_parity(fused, stock, ref, "loss", floor=_relative_floor(fused, ref))
    grad = torch.rand(stock.shape, generator=torch.Generator().manual_seed(1)).to(stock) + 0.5
    fused.backward(grad)
    stock.backward(grad)
    ref.backward(grad.double())
    for name, f, s, r in zip(("input", "weight", "bias"), fused_in, stock_in, ref_in, strict=False):
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
        loss = fl.linear_cross_entropy(*leaves[:2], t, leaves[2], label_smoothing=0.1, chunk_size=chunk_size)
        loss.backward()
        results.append([loss.detach()] + [v.grad for v in leaves])
    for other in results[1:]:
        for a, c in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


def test_grad_weight_accumulates_in_fp32_across_chunks():
    """bf16 with 64 chunks of 2 rows: grad_weight stays as close to the float64 value as the single stock
    matmul (which sums all rows in fp32); summing the chunks in bf16 would be ~10x further off."""
    torch.manual_seed(3)
    x, w, _ = _problem(n_rows=128, hidden=32, n_classes=64, dtype=torch.bfloat16)
    t = torch.randint(0, 64, (128,))
    _check(x, w, t, chunk_size=2, reduction="sum")
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda v: saved.append(v) or v, lambda v: v):
        loss = fl.linear_cross_entropy(x.clone().requires_grad_(), w.clone().requires_grad_(), t, chunk_size=2)
    assert [v.dtype for v in saved if v.shape == w.shape] == [torch.float32]  # the accumulator
    assert all(v.shape[-1] != 64 or v.dim() < 2 for v in saved)  # no logits saved
    loss.backward()


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


def test_leading_dims_are_flattened():
    x, w, b = _problem(n_rows=24, bias=True)
    x3 = x.reshape(2, 12, 24)
    t = _targets(24, 101).reshape(2, 12)
    for reduction in REDUCTIONS:
        fused = fl.linear_cross_entropy(x3, w, t, b, reduction=reduction, chunk_size=5)
        stock = F.cross_entropy(F.linear(x3, w, b).flatten(0, 1), t.flatten(), reduction=reduction)
        torch.testing.assert_close(fused, stock.reshape(t.shape) if reduction == "none" else stock)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_every_target_ignored_and_empty(backend):
    x, w, b = _problem(n_rows=6, bias=True)
    t = torch.full((6,), -100)
    with fl.use_backend(backend):
        xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
        loss = fl.linear_cross_entropy(xr, wr, t, b)
        assert loss.isnan()
        loss.backward()
        assert (xr.grad == 0).all() and (wr.grad == 0).all()
        assert fl.linear_cross_entropy(x, w, t, b, reduction="sum") == 0
        empty = fl.linear_cross_entropy(x[:0], w, t[:0], reduction="none")
        assert empty.shape == (0,)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_inputs_never_modified(backend):
    x, w, b = _problem(bias=True)
    leaves = [v.clone().requires_grad_() for v in (x, w, b)]
    with fl.use_backend(backend):
        loss = fl.linear_cross_entropy(*leaves[:2], _targets(37, 101), leaves[2], chunk_size=9)
        loss.backward()
    for v, orig in zip(leaves, (x, w, b), strict=True):
        assert torch.equal(v.detach(), orig)


def test_only_requested_gradients():
    x, w, b = _problem(bias=True)
    t = _targets(37, 101)
    for wanted in ((True, False, False), (False, True, False), (False, False, True), (True, True, False)):
        leaves = [v.clone().requires_grad_(r) for v, r in zip((x, w, b), wanted, strict=True)]
        loss = fl.linear_cross_entropy(*leaves[:2], t, leaves[2], label_smoothing=0.1, chunk_size=8)
        loss.backward()
        stock_leaves = [v.clone().requires_grad_(r) for v, r in zip((x, w, b), wanted, strict=True)]
        stock_loss(*stock_leaves[:2], t, stock_leaves[2], label_smoothing=0.1).backward()
        for v, s, r in zip(leaves, stock_leaves, wanted, strict=True):
            assert (v.grad is None) == (not r)
            if r:
                torch.testing.assert_close(v.grad, s.grad)
    with torch.no_grad():
        loss = fl.linear_cross_entropy(x, w, t, b)
    torch.testing.assert_close(loss, stock_loss(x, w, t, b))


# ----------------------------------------------------------------------------- Triton kernels (interpreter on CPU)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_triton_path(dtype, reduction):
    x, w, b = _problem(n_rows=21, hidden=16, n_classes=77, dtype=dtype, bias=True)
    with fl.use_backend("triton"):
        _check(x, w, _targets(21, 77), b, chunk_size=8, reduction=reduction, label_smoothing=0.1, z_loss=1e-3)


def test_triton_scale_cast_kernel():
    from fusedlayers.kernels import linear_cross_entropy as kernels

    src = torch.randn(37, 129)
    for g, dtype in ((torch.tensor(0.37), torch.float16), (torch.tensor(2.0, dtype=torch.bfloat16), torch.float32)):
        out = kernels.scale_cast(src, g, dtype)
        torch.testing.assert_close(out, (src * g.float()).to(dtype))
    assert kernels.scale_cast(src[:, ::2], torch.tensor(1.0), torch.float32).is_contiguous()


# ----------------------------------------------------------------------------- autograd machinery


def test_gradcheck():
    x, w, b = (v.double().requires_grad_() for v in _problem(n_rows=7, hidden=5, n_classes=9, bias=True))
    t = torch.tensor([0, 8, -100, 3, 3, -100, 5])
    for reduction in REDUCTIONS:
        for smoothing, z in ((0.0, 0.0), (0.3, 0.05)):
            f = lambda a, c, d, r=reduction, s=smoothing, zz=z: fl.linear_cross_entropy(  # noqa: E731
                a, c, t, d, reduction=r, label_smoothing=s, z_loss=zz, chunk_size=3)
            assert torch.autograd.gradcheck(f, (x, w, b))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_opcheck(backend):
    ops = torch.ops.fusedlayers
    x, w, b = (v.requires_grad_() for v in _problem(n_rows=9, hidden=8, n_classes=13, bias=True))
    t = _targets(9, 13, ignore_every=3)
    with fl.use_backend(backend):
        for reduction in REDUCTIONS:
            for flags in ((True, True, True), (False, True, False)):
                opcheck(ops.linear_cross_entropy.default,
                        (x, w, t, b, -100, reduction, 0.1, 1e-2, 4, torch.float32, *flags))
        opcheck(ops.linear_cross_entropy.default, (x, w, t, None, -100, "mean", 0.0, 0.0, 0, torch.float32,
                                                   True, True, False))
        opcheck(ops.linear_cross_entropy_scale_grad.default, (torch.randn(4, 5), torch.tensor(2.0), torch.float16))
        _, lse, *_ = ops.linear_cross_entropy(x.detach(), w.detach(), t, b.detach(), -100, "none", 0.1, 1e-2, 4,
                                              torch.float32, False, False, False)
        opcheck(ops.linear_cross_entropy_backward.default,
                (torch.rand(9), x.detach(), w.detach(), t, b.detach(), lse, -100, "none", 0.1, 1e-2, 4,
                 True, True, True))


def test_compile_fullgraph_equals_eager_with_ignore_index():
    torch._dynamo.reset()

    def f(x, w, b, t):
        return (fl.linear_cross_entropy(x, w, t, b, label_smoothing=0.1, chunk_size=8)
                + fl.linear_cross_entropy(x * 2, w, t, reduction="none", z_loss=1e-3).sum() / 50)

    x, w, b = (v.requires_grad_() for v in _problem(bias=True))
    t = _targets(37, 101, ignore_every=3)
    loss = torch.compile(f, fullgraph=True)(x, w, b, t)
    grads = torch.autograd.grad(loss, (x, w, b))
    loss2 = f(x, w, b, t)
    grads2 = torch.autograd.grad(loss2, (x, w, b))
    torch.testing.assert_close(loss, loss2)
    for g1, g2 in zip(grads, grads2, strict=True):
        torch.testing.assert_close(g1, g2)
    stock = stock_loss(x, w, t, b, label_smoothing=0.1) + stock_loss(x * 2, w, t, reduction="none",
                                                                     z_loss=1e-3).sum() / 50
    torch.testing.assert_close(loss, stock)


def test_autocast_cpu_bf16():
    x, w, b = (v.requires_grad_() for v in _problem(bias=True))
    t = _targets(37, 101)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        fused = fl.linear_cross_entropy(x, w, t, b, chunk_size=8)
        stock = F.cross_entropy(F.linear(x, w, b), t)
    assert fused.dtype == stock.dtype == torch.float32
    torch.testing.assert_close(fused, stock, rtol=2e-2, atol=2e-2)  # both from bf16 logits
    gf = torch.autograd.grad(fused, (x, w, b))
    gs = torch.autograd.grad(stock, (x, w, b))
    for a, c in zip(gf, gs, strict=True):
        assert a.dtype == c.dtype == torch.float32
        torch.testing.assert_close(a, c, rtol=3e-2, atol=3e-3)


# ----------------------------------------------------------------------------- errors and the module


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda: fl.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 2), torch.zeros(4, dtype=torch.long)),
         ValueError, "input"),
        (lambda: fl.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3, 1), torch.zeros(4, dtype=torch.long)),
         ValueError, "weight"),
        (lambda: fl.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(3, dtype=torch.long)),
         ValueError, "target"),
        (lambda: fl.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4)), TypeError, "target"),
        (lambda: fl.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3).double(),
                                         torch.zeros(4, dtype=torch.long)), TypeError, "weight"),
        (lambda: fl.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long),
                                         torch.randn(4)), ValueError, "bias"),
        (lambda: fl.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), torch.tensor([0, 1, 5, 2])),
         ValueError, "target"),
        (lambda: fl.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long),
                                         chunk_size=0), ValueError, "chunk_size"),
        (lambda: fl.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long),
                                         reduction="mean "), ValueError, "reduction"),
        (lambda: fl.linear_cross_entropy(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long),
                                         label_smoothing=-0.1), ValueError, "label_smoothing"),
    ],
)
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


def test_module():
    x, w, b = _problem(bias=True)
    t = _targets(37, 101, ignore_index=3)
    head = torch.nn.Linear(24, 101)
    with torch.no_grad():
        head.weight.copy_(w)
        head.bias.copy_(b)
    for kw in ({}, {"reduction": "sum", "ignore_index": 3}, {"reduction": "none", "label_smoothing": 0.3}):
        fused = fl.LinearCrossEntropyLoss(**kw, chunk_size=16)
        stock = torch.nn.CrossEntropyLoss(**kw)
        torch.testing.assert_close(fused(x, head.weight, t, head.bias), stock(head(x), t))
    assert len(list(fl.LinearCrossEntropyLoss().parameters())) == 0
    assert "chunk_size=16" in repr(fl.LinearCrossEntropyLoss(chunk_size=16))


# ----------------------------------------------------------------------------- GPU (run on the lent GPU)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n_classes", [77, 32003, 50257])
def test_cuda_parity(dtype, n_classes):
    x, w, b = _problem(n_rows=300, hidden=64, n_classes=n_classes, dtype=dtype, bias=True, device="cuda")
    t = _targets(300, n_classes, device="cuda")
    for reduction in REDUCTIONS:
        _check(x, w, t, b, chunk_size=128, reduction=reduction, label_smoothing=0.1)
    _check(x, w, t, None, reduction="mean", z_loss=1e-3)  # default chunk size


@pytest.mark.cuda
def test_cuda_logits_never_materialised():
    n, h, v = 4096, 256, 32000
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    t = _targets(n, v, device="cuda")
    fl.linear_cross_entropy(x, w, t, chunk_size=512).backward()
    x.grad = w.grad = None
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fl.linear_cross_entropy(x, w, t, chunk_size=512).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    logits_bytes = n * v * 2
    chunk_bytes = 512 * v * 2
    # forward: chunk buffer + fp32 grad_W accumulator + grad_x; backward: accumulator + bf16 grad_W + 2 grad_x.
    # A zero-filled (V, H) fp32 "gradient" of the accumulator output (autograd's default) would not fit.
    forward = chunk_bytes + w.numel() * 4 + x.numel() * 2
    backward = w.numel() * (4 + 2) + 2 * x.numel() * 2
    assert extra <= max(forward, backward) + 8 * 2**20 < logits_bytes, (extra, forward, backward)


@pytest.mark.cuda
def test_cuda_compile_autocast_and_opcheck():
    torch._dynamo.reset()
    x, w, b = (v.requires_grad_() for v in _problem(n_rows=256, hidden=64, n_classes=5000, bias=True,
                                                    device="cuda"))
    t = _targets(256, 5000, device="cuda")
    f = lambda a, c, d: fl.linear_cross_entropy(a, c, t, d, label_smoothing=0.1, z_loss=1e-4)  # noqa: E731
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
        fused = fl.linear_cross_entropy(x, w, t, b)
        stock = F.cross_entropy(F.linear(x, w, b), t)
    assert fused.dtype == stock.dtype == torch.float32
    torch.testing.assert_close(fused, stock, rtol=1e-2, atol=1e-2)
    # grad_weight accumulated by one bf16 x bf16 -> fp32 cuBLAS call per chunk, not an fp32 SIMT matmul on
    # upcast copies (autocast once broke the probe: 3x slower in the gpt-small profile)
    assert lce_kernels._ADDMM_OUT_DTYPE[x.device] is True
    opcheck(torch.ops.fusedlayers.linear_cross_entropy.default,
            (x.bfloat16(), w.bfloat16(), t, b.bfloat16(), -100, "mean", 0.1, 0.0, 64, torch.bfloat16, True, True,
             True))
