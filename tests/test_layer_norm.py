"""fl.layer_norm and fl.LayerNorm: parity with torch (values and every gradient, the fused residual add too), the
Triton kernels under the interpreter, registration (opcheck, compile, autocast), gradcheck, the module, errors.
(The kernels are RMSNorm's too: tests/test_rms_norm.py covers their launch plans in more shapes.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fusedlayers as fl
from fusedlayers.kernels import _norm as kernels
from tests.test_rms_norm import (
    BACKENDS,
    SHAPES,
    check_input_gradient_in_its_dtype,
    check_out_dtype,
    check_parity,
    recorded_backward_calls,
    strided_param,
)


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    kernels.forget_plans()
    yield
    kernels.forget_plans()


def _stock(shape, eps):
    def f(x, w=None, b=None, r=None):
        h = x + r if r is not None else x
        y = F.layer_norm(h, shape, w, b, eps)
        return (y, h) if r is not None else y

    return f


def _fused(shape, eps):
    def f(x, w=None, b=None, r=None):
        return fl.layer_norm(x, shape, w, b, eps, residual=r)

    return f


def _check_ln(x, shape, w=None, b=None, r=None, eps=1e-5):
    """fl.layer_norm vs F.layer_norm (of input + residual) vs the same in float64."""
    check_parity(_fused(shape, eps), _stock(shape, eps), [x, w, b, r], ["input", "weight", "bias", "residual"])


def _inputs(x_shape, norm_shape, dtype, weight=True, bias=True, residual=False, param_dtype=None):
    x = (torch.randn(x_shape, dtype=dtype) * 2 + 3).requires_grad_()  # a mean far from 0: centering matters
    pd = param_dtype or dtype
    w = (torch.randn(norm_shape, dtype=pd) * 0.5 + 1).requires_grad_() if weight else None
    b = torch.randn(norm_shape, dtype=pd).requires_grad_() if bias else None
    r = torch.randn(x_shape, dtype=dtype).requires_grad_() if residual else None
    return x, w, b, r


def _check_case(shape, inputs):
    x, w, b, r = inputs
    _check_ln(x, shape, w, b, r)


PARAMS = [(True, True, False), (False, False, False), (True, False, False), (False, True, False),
          (True, True, True)]


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", SHAPES, ids=str)
def test_reference_parity(case, dtype):
    x_shape, norm_shape = case
    with fl.use_backend("reference"):
        for weight, bias, residual in PARAMS:
            _check_case(norm_shape, _inputs(x_shape, norm_shape, dtype, weight, bias, residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", SHAPES, ids=str)
def test_triton_parity(case, dtype):
    x_shape, norm_shape = case
    with fl.use_backend("triton"):
        for weight, bias, residual in PARAMS:
            _check_case(norm_shape, _inputs(x_shape, norm_shape, dtype, weight, bias, residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_cols", [33, 64, 100])
def test_triton_long_row_kernels(monkeypatch, n_cols, dtype):
    """The looped forward (Chan's merge of per-block statistics), the row-sums kernel and the column-chunked
    backward, several blocks per row."""
    monkeypatch.setattr(kernels, "MAX_ONE_PASS_COLS", 16)
    monkeypatch.setattr(kernels, "LOOP_BLOCK_N", 32)
    with fl.use_backend("triton"):
        for weight, bias, residual in PARAMS:
            _check_case((n_cols,), _inputs((11, n_cols), (n_cols,), dtype, weight, bias, residual))


@pytest.mark.slow
def test_triton_rows_past_64k():
    with fl.use_backend("triton"):
        _check_case((65543,), _inputs((2, 65543), (65543,), torch.float32, True, True, True))


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous(backend):
    base = torch.randn(6, 40, 9) + 2
    views = [(base.transpose(1, 2), (40,)), (base[:, ::3], (9,)), (base.permute(2, 0, 1), (6, 40))]
    with fl.use_backend(backend):
        for x, shape in views:
            w, b = torch.randn(shape).requires_grad_(), torch.randn(shape).requires_grad_()
            r = torch.randn(x.shape[::-1]).permute(*range(x.dim() - 1, -1, -1)).requires_grad_()
            _check_ln(x.requires_grad_(), shape, w, b)
            _check_ln(x, shape, w, b, r)
            _check_ln(x, shape, strided_param(shape), strided_param(shape))  # strided views (the kernels copy them)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_parameter_dtypes(backend):
    """fp16/bf16 input with fp32 weight and bias (torch's mixed layer_norm): output in the input's dtype, parameter
    gradients in fp32."""
    dtypes = (torch.float16, torch.bfloat16) if backend == "reference" else (torch.float16,)
    with fl.use_backend(backend):
        for dtype in dtypes:
            x, w, b, r = _inputs((5, 40), (40,), dtype, True, True, True, param_dtype=torch.float32)
            _check_ln(x, (40,), w, b)
            _check_ln(x, (40,), w, b, r)
            assert fl.layer_norm(x, 40, w, b).dtype == dtype


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_and_float64(backend):
    with fl.use_backend(backend):
        for shape, norm in [((0, 5), (5,)), ((4, 0), (0,)), ((2, 0, 3), (3,))]:
            x, w, b = torch.randn(shape, requires_grad=True), torch.randn(norm, requires_grad=True), \
                torch.randn(norm, requires_grad=True)
            y = fl.layer_norm(x, norm, w, b)
            assert y.shape == x.shape
            y.sum().backward()
            assert x.grad.shape == x.shape
            assert torch.equal(w.grad, torch.zeros_like(w)) and torch.equal(b.grad, torch.zeros_like(b))
        x, w, b, r = _inputs((4, 10), (10,), torch.float64, True, True, True)
        y, h = fl.layer_norm(x, (10,), w, b, residual=r)
        torch.testing.assert_close(y, F.layer_norm(x + r, (10,), w, b), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_saves_input_weight_and_stats(backend):
    x, w, b, r = _inputs((4, 50), (50,), torch.float32, True, True, True)
    saved = []
    with fl.use_backend(backend):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y, h = fl.layer_norm(x, 50, w, b, residual=r)
    assert [t.data_ptr() for t in saved[:2]] == [h.data_ptr(), w.data_ptr()]
    assert saved[2].shape == (2, 4) and saved[2].dtype == torch.float32 and len(saved) == 3


@pytest.mark.parametrize("backend", BACKENDS)
def test_skips_gradients_nobody_asked_for(backend):
    x, w, b, r = _inputs((5, 12), (12,), torch.float32, True, True, True)
    cases = [((x.detach(), w, b.detach(), None), (False, True, False)),
             ((x, w.detach(), b, None), (True, False, True)),
             ((x.detach(), w.detach(), None, r), (True, False, False))]
    for (xi, wi, bi, ri), needs in cases:
        with fl.use_backend(backend), recorded_backward_calls() as mode:
            out = fl.layer_norm(xi, 12, wi, bi, residual=ri)
            (out[0] if ri is not None else out).sum().backward()
        (args,) = mode.calls
        assert args[-3:] == needs


# ----------------------------------------------------------------------------- registration


def test_gradcheck():
    x, w, b, r = _inputs((3, 2, 5), (2, 5), torch.float64, True, True, True)
    assert torch.autograd.gradcheck(lambda *t: fl.layer_norm(t[0], (2, 5), t[1], t[2], residual=t[3]), (x, w, b, r))
    assert torch.autograd.gradcheck(lambda a, c: fl.layer_norm(a, 5, None, c, 1e-3), (x, b[0]))
    assert torch.autograd.gradcheck(lambda a: fl.layer_norm(a, (2, 5)), (x,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    ops = torch.ops.fusedlayers
    x, w, b, r = _inputs((3, 4, 17), (17,), torch.float32, True, True, True)
    y, h, stats = ops.layer_norm(x.detach(), [17], w.detach(), b.detach(), 1e-5, r.detach(), None)
    g, wd = torch.randn_like(y), w.detach()  # the backward ops have no autograd of their own
    samples = [
        (ops.layer_norm.default, (x, [17], w, b, 1e-5, None, None)),
        (ops.layer_norm.default, (x, [4, 17], None, None, 1e-5, r, None)),
        (ops.layer_norm.default, (x.detach().half().requires_grad_(), [17], w, b, 1e-5, r, torch.float32)),
        (ops.layer_norm_backward.default, (g, h, [17], wd, stats, g, torch.float32, torch.float32, True, True, True)),
        (ops.layer_norm_backward.default, (g, h, [17], wd, stats, None, torch.float32, None, False, True, False)),
        (ops.layer_norm_backward.default, (g, h, [17], None, stats, None, torch.float16, torch.float32, True, False,
                                           True)),
        (ops.layer_norm_backward.default, (g, h, [17], wd, stats, g, torch.float32, torch.float32, True, True, True,
                                           torch.bfloat16)),
    ]
    with fl.use_backend(backend):
        for op, args in samples:
            opcheck(op, args)


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()

    def f(x, w, b, r):
        y, h = fl.layer_norm(x * 2.0, (16,), w, b, residual=r)
        return (fl.layer_norm(y, 16, w) * h).sum()

    compiled = torch.compile(f, fullgraph=True)
    inputs = _inputs((2, 8, 16), (16,), torch.float32, True, True, True)
    loss = compiled(*inputs)
    grads = torch.autograd.grad(loss, inputs)
    leaves = [t.detach().clone().requires_grad_() for t in inputs]
    expected = torch.autograd.grad(f(*leaves), leaves)
    torch.testing.assert_close(loss, f(*leaves))
    for a, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, e)


def test_autocast_cpu_bf16_as_torch():
    """CPU autocast leaves layer_norm alone (as torch): bf16 in, bf16 out, fp32 parameters allowed."""
    a, c = torch.randn(4, 16), torch.randn(16, 32)
    w, b = torch.randn(32), torch.randn(32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = a @ c
        fused, stock = fl.layer_norm(h, 32, w, b), F.layer_norm(h, (32,), w, b)
    assert fused.dtype == stock.dtype == torch.bfloat16
    torch.testing.assert_close(fused, stock)


# ----------------------------------------------------------------------------- module and errors


def test_module_is_a_drop_in():
    for args, kwargs in [((16,), {}), ((16,), dict(eps=1e-3, bias=False)), (((4, 16),), dict(elementwise_affine=False)),
                         ((16,), dict(dtype=torch.float64))]:
        fused, stock = fl.LayerNorm(*args, **kwargs), torch.nn.LayerNorm(*args, **kwargs)
        assert isinstance(fused, torch.nn.LayerNorm) and repr(fused) == repr(stock)
        assert [(n, p.shape, p.dtype) for n, p in fused.named_parameters()] == [
            (n, p.shape, p.dtype) for n, p in stock.named_parameters()]
        with torch.no_grad():
            for p in stock.parameters():
                p.normal_()
        fused.load_state_dict(stock.state_dict())
        stock.load_state_dict(fused.state_dict())
        x = torch.randn(3, 4, 16, dtype=kwargs.get("dtype", torch.float32))
        torch.testing.assert_close(fused(x), stock(x))
        r = torch.randn_like(x)
        y, h = fused(x, r)
        torch.testing.assert_close(h, x + r)
        torch.testing.assert_close(y, stock(x + r))


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_gradient_in_its_dtype(backend):
    w, b = torch.randn(40, requires_grad=True), torch.randn(40, requires_grad=True)
    check_input_gradient_in_its_dtype(lambda x, **kw: fl.layer_norm(x, 40, w, b, **kw), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_dtype_is_the_rounded_output(backend):
    w, b = torch.randn(40, requires_grad=True), torch.randn(40, requires_grad=True)
    check_out_dtype(lambda x, **kw: fl.layer_norm(x, 40, w, b, **kw), backend)
    module = fl.LayerNorm(40)
    check_out_dtype(lambda x, **kw: module(x, kw.pop("residual"), **kw), backend)


@pytest.mark.cuda
def test_cuda_out_dtype():
    w, b = torch.randn(40, device="cuda", requires_grad=True), torch.randn(40, device="cuda", requires_grad=True)
    check_out_dtype(lambda x, **kw: fl.layer_norm(x, 40, w, b, **kw), "triton", cuda=True)
    check_input_gradient_in_its_dtype(lambda x, **kw: fl.layer_norm(x, 40, w, b, **kw), "triton", "cuda")


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda: fl.layer_norm(torch.arange(6).reshape(2, 3), 3), TypeError, "input"),
        (lambda: fl.layer_norm(torch.randn(2, 3), 2), ValueError, "normalized_shape"),
        (lambda: fl.layer_norm(torch.randn(2, 3), [3, 3]), ValueError, "normalized_shape"),
        (lambda: fl.layer_norm(torch.randn(2, 3), "3"), TypeError, "normalized_shape"),
        (lambda: fl.layer_norm(torch.randn(2, 3), 3, torch.randn(2)), ValueError, "weight"),
        (lambda: fl.layer_norm(torch.randn(2, 3), 3, None, torch.randn(3, 1)), ValueError, "bias"),
        (lambda: fl.layer_norm(torch.randn(2, 3), 3, torch.randn(3).half()), TypeError, "weight"),
        (lambda: fl.layer_norm(torch.randn(2, 3).half(), 3, torch.randn(3), torch.randn(3).half()), TypeError,
         "bias"),
        (lambda: fl.layer_norm(torch.randn(2, 3).bfloat16(), 3, torch.randn(3).half()), TypeError, "weight"),
        (lambda: fl.layer_norm(torch.randn(2, 3), 3, eps=None), TypeError, "eps"),
        (lambda: fl.layer_norm(torch.randn(2, 3), 3, residual=torch.randn(2, 4)), ValueError, "residual"),
        (lambda: fl.layer_norm(torch.randn(2, 3), 3, out_dtype=torch.int64), TypeError, "out_dtype"),
    ],
)
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


# ----------------------------------------------------------------------------- GPU (the `cuda` tests)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n_cols", [2048, 4096, 4544, 8192, 1, 3, 5120, 16384, 16385, 65536])
def test_cuda_parity(dtype, n_cols):
    rows = 67 if n_cols <= 16384 else 5
    x, w, b, r = (t.cuda().detach().requires_grad_() for t in _inputs((rows, n_cols), (n_cols,), dtype, True, True,
                                                                       True))
    _check_ln(x, (n_cols,), w, b)
    _check_ln(x, (n_cols,), w, b, r)
    _check_ln(x, (n_cols,))
    half = max(1, n_cols // 2)
    _check_ln(x[:, :half].detach().requires_grad_(), (half,), w[:half].detach().requires_grad_())  # strided rows


@pytest.mark.cuda
@pytest.mark.parametrize("n_cols", [2048, 4096, 8192])
def test_cuda_many_rows(n_cols):
    inputs = (t.cuda().detach().requires_grad_() for t in _inputs((3000, n_cols), (n_cols,), torch.bfloat16, True,
                                                                   True, True))
    _check_case((n_cols,), inputs)


@pytest.mark.cuda
def test_cuda_autocast_compile_and_opcheck():
    x = torch.randn(8, 64, device="cuda")
    w, b = torch.randn(64, device="cuda", requires_grad=True), torch.randn(64, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        h = x @ torch.randn(64, 64, device="cuda")
        assert fl.layer_norm(h, 64, w, b).dtype == F.layer_norm(h, (64,), w, b).dtype == torch.float32
        torch.testing.assert_close(fl.layer_norm(h, 64, w.half(), b), F.layer_norm(h, (64,), w.half(), b))
    torch._dynamo.reset()
    xb = torch.randn(4, 64, 300, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wb = torch.randn(300, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = lambda a, c: fl.layer_norm(a, 300, c, c, residual=a)[0].float().square().sum()  # noqa: E731
    g1 = torch.autograd.grad(torch.compile(f, fullgraph=True)(xb, wb), (xb, wb))
    g2 = torch.autograd.grad(f(xb, wb), (xb, wb))
    for a, e in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, e)
    opcheck(torch.ops.fusedlayers.layer_norm.default, (xb, [300], wb, wb, 1e-5, xb, None))


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_can_be_modified_in_place(backend):
    """As nn.LayerNorm's (XLM scales it in place): the output is no view among the op's outputs."""
    x = torch.randn(2, 3, 8, requires_grad=True)
    weight, bias = torch.rand(8) + 0.5, torch.randn(8)
    with fl.use_backend(backend):
        y = fl.layer_norm(x, (8,), weight, bias)
        y *= 3.0
        (gx,) = torch.autograd.grad(y.square().sum(), x)
    expected = F.layer_norm(x, (8,), weight, bias) * 3.0
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(gx, torch.autograd.grad(expected.square().sum(), x)[0])
