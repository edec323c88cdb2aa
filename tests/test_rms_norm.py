"""fl.rms_norm and fl.RMSNorm: parity with torch (values and every gradient, the fused residual add too), the Triton
kernels under the interpreter, registration (opcheck, compile, autocast), gradcheck, the module, errors.

The helpers here (``check_parity``, ``recorded_backward_calls``) serve tests/test_layer_norm.py too.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck
from torch.utils._python_dispatch import TorchDispatchMode

import fusedlayers as fl
from fusedlayers.kernels import _norm as kernels
from tests.parity import FLOOR, assert_parity

EPS32 = torch.finfo(torch.float32).eps
BACKENDS = ["reference", "triton"]


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """The kernels memoize their launch plans; tests here patch the constants the plans are made from."""
    kernels.forget_plans()
    yield
    kernels.forget_plans()


def _leaves(tensors, dtype=None):
    return [None if t is None else t.detach().to(dtype or t.dtype).requires_grad_(t.requires_grad) for t in tensors]


def _run(fn, tensors, grads, dtype=None):
    """fn's outputs (a tuple) and the gradients of the tensors that require grad, for upstream ``grads``."""
    leaves = _leaves(tensors, dtype)
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward(outs, [g.to(dtype or o.dtype) for o, g in zip(outs, grads, strict=True)])
    return outs, [t.grad for t in leaves if t is not None and t.requires_grad]


def _floor(reference: torch.Tensor, dtype: torch.dtype) -> float:
    """The parity floor, relative for fp32 (long fp32 sums: dw over rows) and absolute for 16-bit results."""
    scale = max(1.0, reference.abs().max().item()) if reference.numel() and dtype == torch.float32 else 1.0
    return FLOOR[dtype] * scale


def check_parity(fused_fn, stock_fn, tensors, names) -> list[torch.Tensor]:
    """Outputs and gradients of fused_fn vs stock_fn vs stock_fn in float64 on the same inputs (``tensors``: those
    that require grad get gradients, ``names`` their labels), for random upstream gradients. Returns the fused
    results (outputs, then gradients)."""
    probe = stock_fn(*_leaves(tensors))
    probe = probe if isinstance(probe, tuple) else (probe,)
    grads = [torch.randn(o.shape, dtype=o.dtype, device=o.device) for o in probe]
    fused, fused_grads = _run(fused_fn, tensors, grads)
    stock, stock_grads = _run(stock_fn, tensors, grads)
    ref, ref_grads = _run(stock_fn, tensors, grads, torch.float64)
    labels = [f"output {i}" for i in range(len(fused))] + [
        f"grad {n}" for n, t in zip(names, tensors, strict=True) if t is not None and t.requires_grad]
    results = [*fused, *fused_grads]
    for what, f, s, r in zip(labels, results, [*stock, *stock_grads], [*ref, *ref_grads], strict=True):
        assert f is not None, what
        assert f.dtype == s.dtype, f"{what}: dtype {f.dtype} != stock {s.dtype}"
        assert_parity(f, s, r, what, floor=_floor(r, f.dtype))
    return results


class recorded_backward_calls(TorchDispatchMode):
    """Records the arguments of every fusedlayers backward op that runs inside it."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "fusedlayers" and "backward" in func.__name__:
            self.calls.append(args)
        return func(*args, **(kwargs or {}))


def _stock(shape, eps):
    def f(x, w=None, r=None):
        h = x + r if r is not None else x
        y = F.rms_norm(h, shape, w, eps)
        return (y, h) if r is not None else y

    return f


def _fused(shape, eps):
    def f(x, w=None, r=None):
        return fl.rms_norm(x, shape, w, eps, residual=r)

    return f


def _check_rms(x, shape, w=None, r=None, eps=1e-6):
    """fl.rms_norm vs F.rms_norm (of input + residual) vs the same in float64."""
    check_parity(_fused(shape, eps), _stock(shape, eps), [x, w, r], ["input", "weight", "residual"])


SHAPES = [((5, 6), (6,)), ((3, 1), (1,)), ((4, 3), (3,)), ((2, 3, 37), (37,)), ((3, 130), (130,)),
          ((2, 5, 7), (5, 7)), ((3, 2, 2, 9), (2, 2, 9)), ((7,), (7,)), ((2, 1100), (1100,))]


def _check_case(shape, inputs):
    x, w, r = inputs
    _check_rms(x, shape, w, r)


def _inputs(x_shape, norm_shape, dtype, weight=True, residual=False, scale=2.0):
    x = (torch.randn(x_shape, dtype=dtype) * scale + 0.5).requires_grad_()
    w = (torch.randn(norm_shape, dtype=dtype) * 0.5 + 1).requires_grad_() if weight else None
    r = torch.randn(x_shape, dtype=dtype).requires_grad_() if residual else None
    return x, w, r


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", SHAPES, ids=str)
def test_reference_parity(case, dtype):
    x_shape, norm_shape = case
    with fl.use_backend("reference"):
        for weight in (True, False):
            for residual in (False, True):
                _check_case(norm_shape, _inputs(x_shape, norm_shape, dtype, weight, residual))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("case", SHAPES, ids=str)
def test_triton_parity(case, dtype):
    x_shape, norm_shape = case
    with fl.use_backend("triton"):
        for weight, residual in ((True, False), (False, False), (True, True)):
            _check_case(norm_shape, _inputs(x_shape, norm_shape, dtype, weight, residual))


def _long_rows(monkeypatch, max_cols: int, block: int) -> None:
    """Rows over ``max_cols`` columns take the looped kernels, in blocks of ``block`` (16-bit) columns."""
    monkeypatch.setattr(kernels, "MAX_ONE_PASS_COLS", max_cols)
    monkeypatch.setattr(kernels, "LOOP_BLOCK_N", block)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n_cols", [33, 64, 100])
def test_triton_long_row_kernels(monkeypatch, n_cols, dtype):
    """The looped forward, the row-sums kernel and the column-chunked backward, several blocks per row."""
    _long_rows(monkeypatch, 16, 32)
    with fl.use_backend("triton"):
        for weight, residual in ((True, False), (False, True), (True, True)):
            _check_case((n_cols,), _inputs((11, n_cols), (n_cols,), dtype, weight, residual))


@pytest.mark.slow
def test_triton_rows_past_64k():
    """The shipped long-row plans on a real long row (65536 + 7 columns)."""
    x, w, r = _inputs((2, 65543), (65543,), torch.float32, True, True)
    with fl.use_backend("triton"):
        _check_rms(x, (65543,), w, r)


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_programs_own_row_ranges(monkeypatch, backend):
    """Many rows over few programs (each a range of rows, several tiles each), a last program with fewer rows, and
    more partials than one tile of the reduction kernel."""
    monkeypatch.setattr(kernels, "BWD_MAX_PROGRAMS_PER_SM", 1)  # 4 programs (the interpreter's 4 SMs) ...
    monkeypatch.setattr(kernels, "BWD_TILE_ELEMENTS", 64)  # ... of 26 steps of 2 rows (the last of 24 steps)
    monkeypatch.setattr(kernels, "SUM_BLOCK_P", 2)
    with fl.use_backend(backend):
        _check_case((24,), _inputs((203, 24), (24,), torch.float32, True, True))
        # one program per BWD_MIN_ROWS rows
        monkeypatch.setattr(kernels, "BWD_CONFIGS", {("rms", 32): kernels.BwdConfig(1, 4, 50, 2)})
        kernels.forget_plans()
        _check_case((24,), _inputs((203, 24), (24,), torch.float32))


def strided_param(shape) -> torch.Tensor:
    """A parameter of ``shape`` that is not contiguous: every other element of a longer vector, or a transpose."""
    if len(shape) == 1:
        return torch.randn(2 * shape[0])[::2].requires_grad_()
    return torch.randn(shape[::-1]).permute(*range(len(shape) - 1, -1, -1)).requires_grad_()


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous(backend):
    base = torch.randn(6, 40, 9)
    views = [(base.transpose(1, 2), (40,)), (base[:, ::3], (9,)), (base[..., 1:8], (7,)),
             (base.permute(2, 0, 1), (6, 40)), (base.transpose(0, 2)[:, :, 2:], (4,))]
    with fl.use_backend(backend):
        for x, shape in views:
            assert not x.is_contiguous()
            w = torch.randn(shape).requires_grad_()
            r = torch.randn(x.shape[::-1]).permute(*range(x.dim() - 1, -1, -1)).requires_grad_()  # strided too
            _check_rms(x.requires_grad_(), shape, w)
            _check_rms(x, shape, w, r)
            _check_rms(x, shape, strided_param(shape))  # a weight that is a strided view (the kernels copy it)
        # an expanded (stride 0) gradient, as from .sum()
        x = torch.randn(4, 16, requires_grad=True)
        fl.rms_norm(x, (16,), eps=1e-6).sum().backward()
        x2 = x.detach().clone().requires_grad_()
        F.rms_norm(x2, (16,), eps=1e-6).sum().backward()
        torch.testing.assert_close(x.grad, x2.grad, atol=1e-6, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:Mismatch dtype")
@pytest.mark.parametrize("backend", BACKENDS)
def test_weight_and_residual_dtypes(backend):
    """Weight of another dtype (the output keeps the input's, as torch); residual of another dtype (h promotes)."""
    cases = [(torch.float32, torch.float16, None), (torch.float16, torch.float32, None),
             (torch.bfloat16, torch.float32, None), (torch.float16, torch.float16, torch.float32),
             (torch.float32, torch.float32, torch.float16)]
    if backend == "triton":  # the interpreter mishandles some bf16 arithmetic: bf16 runs in the cuda tests
        cases = [c for c in cases if torch.bfloat16 not in c]
    with fl.use_backend(backend):
        for x_dtype, w_dtype, r_dtype in cases:
            x = torch.randn(6, 33, dtype=x_dtype, requires_grad=True)
            w = torch.randn(33, dtype=w_dtype, requires_grad=True)
            r = torch.randn(6, 33, dtype=r_dtype, requires_grad=True) if r_dtype else None
            _check_rms(x, (33,), w, r)
            y = fl.rms_norm(x, 33, w, residual=r)
            y = y[0] if r is not None else y
            assert y.dtype == (x_dtype if r is None else torch.promote_types(x_dtype, r_dtype))


def check_out_dtype(norm, backend: str, cuda: bool = False) -> None:
    """``norm(x, residual=r, out_dtype=...)`` (norm: a function of x and keywords) is ``norm(x, residual=r)`` rounded
    to out_dtype, bitwise, and its gradients are those of that rounding (the same kernels read the same values); h keeps
    its dtype. (Shared with tests/test_layer_norm.py.)"""
    dtypes = [torch.float16, torch.float32] + ([torch.bfloat16] if backend == "reference" or cuda else [])
    device = "cuda" if cuda else "cpu"
    with fl.use_backend(backend):
        for out_dtype in dtypes:
            x = torch.randn(5, 40, device=device, requires_grad=True)
            r = torch.randn(5, 40, device=device, dtype=torch.float16 if cuda else torch.float32, requires_grad=True)
            gy, gh = torch.randn(5, 40, device=device).to(out_dtype), torch.randn(5, 40, device=device)
            y, h = norm(x, residual=r, out_dtype=out_dtype)
            assert y.dtype == out_dtype and h.dtype == torch.float32
            dx, dr = torch.autograd.grad((y, h), (x, r), (gy, gh))
            y2, h2 = norm(x, residual=r)
            dx2, dr2 = torch.autograd.grad((y2.to(out_dtype), h2), (x, r), (gy, gh))
            for got, want in ((y, y2.to(out_dtype)), (h, h2), (dx, dx2), (dr, dr2)):
                assert torch.equal(got, want)


def check_input_gradient_in_its_dtype(norm, backend: str, device: str = "cpu") -> None:
    """A 16-bit input added to an fp32 residual: the backward writes the input's gradient in its dtype from the same
    kernel as the residual's, bitwise the residual's gradient rounded. (Shared with tests/test_layer_norm.py.)"""
    bf16 = backend == "reference" or device == "cuda"  # the interpreter mishandles some bf16 arithmetic
    with fl.use_backend(backend):
        for dtype in (torch.float16, torch.bfloat16) if bf16 else (torch.float16,):
            x = torch.randn(6, 40, dtype=dtype, device=device, requires_grad=True)
            r = torch.randn(6, 40, device=device, requires_grad=True)
            y, h = norm(x, residual=r)
            dx, dr = torch.autograd.grad((y, h), (x, r), (torch.randn_like(y), torch.randn_like(h)))
            assert dx.dtype == dtype and dr.dtype == torch.float32 and torch.equal(dx, dr.to(dtype))


@pytest.mark.parametrize("backend", BACKENDS)
def test_input_gradient_in_its_dtype(backend):
    w = torch.randn(40, requires_grad=True)
    check_input_gradient_in_its_dtype(lambda x, **kw: fl.rms_norm(x, 40, w, 1e-5, **kw), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_dtype_is_the_rounded_output(backend):
    w = torch.randn(40, requires_grad=True)
    check_out_dtype(lambda x, **kw: fl.rms_norm(x, 40, w, 1e-5, **kw), backend)
    module = fl.RMSNorm(40, eps=1e-5)
    check_out_dtype(lambda x, **kw: module(x, kw.pop("residual"), **kw), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_default_eps_is_torchs(backend):
    """eps=None: the machine epsilon of fp32 for fp16/bf16/fp32 input (torch's compute dtype), fp64's for fp64; here
    on rows small enough for eps to matter."""
    for dtype in (torch.float32, torch.float16, torch.float64) + ((torch.bfloat16,) if backend == "reference" else ()):
        x = torch.full((3, 8), 1e-4, dtype=dtype) * torch.arange(1, 4, dtype=dtype)[:, None]
        with fl.use_backend(backend):
            torch.testing.assert_close(fl.rms_norm(x, (8,)), F.rms_norm(x, (8,)))
            torch.testing.assert_close(fl.RMSNorm(8, dtype=dtype)(x), torch.nn.RMSNorm(8, dtype=dtype)(x))


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_runs_the_reference(backend):
    x, w, r = _inputs((4, 10), (10,), torch.float64, True, True)
    with fl.use_backend(backend):
        y, h = fl.rms_norm(x, (10,), w, residual=r)
    torch.testing.assert_close(y, F.rms_norm(x + r, (10,), w), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty(backend):
    with fl.use_backend(backend):
        for shape, norm in [((0, 5), (5,)), ((4, 0), (0,)), ((2, 0, 3), (3,)), ((0,), (0,))]:
            x = torch.randn(shape, requires_grad=True)
            w = torch.randn(norm, requires_grad=True)
            r = torch.randn(shape, requires_grad=True)
            y, h = fl.rms_norm(x, norm, w, residual=r)
            assert y.shape == h.shape == x.shape
            (y.sum() + h.sum()).backward()
            assert x.grad.shape == x.shape and r.grad.shape == x.shape
            assert torch.equal(w.grad, torch.zeros_like(w))


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaves_inputs_unchanged_and_saves_little(backend):
    """Inputs are never written; autograd holds the input (or h with a residual, the tensor returned), the weight
    and the fp32 rstd per row: not the output."""
    x, w, r = _inputs((4, 50), (50,), torch.float32, True, True)
    before = [t.detach().clone() for t in (x, w, r)]
    saved = []
    with fl.use_backend(backend):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y, h = fl.rms_norm(x, 50, w, residual=r)
        (y.sum() + h.sum()).backward()
    assert all(torch.equal(t.detach(), b) for t, b in zip((x, w, r), before, strict=True))
    assert len(saved) == 3 and [t.data_ptr() for t in saved[:2]] == [h.data_ptr(), w.data_ptr()]
    assert saved[2].shape == (4,) and saved[2].dtype == torch.float32
    saved.clear()
    with fl.use_backend(backend):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            y = fl.rms_norm(x, 50, w)
    assert len(saved) == 3 and [t.data_ptr() for t in saved[:2]] == [x.data_ptr(), w.data_ptr()]
    assert y.data_ptr() not in {t.data_ptr() for t in saved}


@pytest.mark.parametrize("backend", BACKENDS)
def test_skips_gradients_nobody_asked_for(backend):
    x, w, r = _inputs((5, 12), (12,), torch.float32, True, True)
    cases = [((x.detach(), w, None), (False, True)), ((x, w.detach(), None), (True, False)),
             ((x.detach(), w.detach(), r), (True, False))]
    for (xi, wi, ri), (need_dx, need_dw) in cases:
        with fl.use_backend(backend), recorded_backward_calls() as mode:
            out = fl.rms_norm(xi, 12, wi, residual=ri)
            (out[0] if ri is not None else out).sum().backward()
        (args,) = mode.calls
        assert args[-2:] == (need_dx, need_dw)


# ----------------------------------------------------------------------------- registration


def test_gradcheck():
    x, w, r = _inputs((3, 2, 5), (2, 5), torch.float64, True, True)
    assert torch.autograd.gradcheck(lambda a, b, c: fl.rms_norm(a, (2, 5), b, residual=c), (x, w, r))
    assert torch.autograd.gradcheck(lambda a, b: fl.rms_norm(a, 5, b, 1e-3), (x, w[0]))
    assert torch.autograd.gradcheck(lambda a: fl.rms_norm(a, 5), (x,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    ops = torch.ops.fusedlayers
    x, w, r = _inputs((3, 4, 17), (17,), torch.float32, True, True)
    y, h, rstd = ops.rms_norm(x.detach(), [17], w.detach(), 1e-6, r.detach(), None)
    g = torch.randn_like(y)
    wd = w.detach()  # the backward ops have no autograd of their own (no double backward)
    samples = [
        (ops.rms_norm.default, (x, [17], w, 1e-6, None, None)),
        (ops.rms_norm.default, (x, [4, 17], None, 1e-5, r, None)),
        (ops.rms_norm.default, (x.detach().half().requires_grad_(), [17], w, 1e-6, r, torch.float32)),
        (ops.rms_norm_backward.default, (g, h, [17], wd, rstd, g, torch.float32, True, True)),
        (ops.rms_norm_backward.default, (g, h, [17], wd, rstd, None, torch.float32, False, True)),
        (ops.rms_norm_backward.default, (g, h, [17], None, rstd, None, torch.float16, True, False)),
        (ops.rms_norm_backward.default, (g, h, [17], wd, rstd, g, torch.float32, True, True, torch.float16)),
    ]
    with fl.use_backend(backend):
        for op, args in samples:
            opcheck(op, args)


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()

    def f(x, w, r):
        y, h = fl.rms_norm(x * 2.0, (16,), w, residual=r)
        return (fl.rms_norm(y, 16, w) * h).sum()

    compiled = torch.compile(f, fullgraph=True)
    x, w, r = _inputs((2, 8, 16), (16,), torch.float32, True, True)
    loss = compiled(x, w, r)
    grads = torch.autograd.grad(loss, (x, w, r))
    leaves = _leaves([x, w, r])
    expected = torch.autograd.grad(f(*leaves), leaves)
    torch.testing.assert_close(loss, f(*leaves))
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_compile_dynamic_shapes():
    """normalized_shape taken from a symbolic shape (torch.compile(dynamic=True)): one graph for every row length."""
    torch._dynamo.reset()

    def f(x, w):
        return fl.rms_norm(x, x.shape[-1:], w, residual=x)[0].sum() + fl.layer_norm(x, x.shape[-1], w).sum()

    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    for n in (5, 7, 9):
        x, w, _ = _inputs((3, n), (n,), torch.float32)
        for a, e in zip(torch.autograd.grad(compiled(x, w), (x, w)), torch.autograd.grad(f(x, w), (x, w)),
                        strict=True):
            torch.testing.assert_close(a, e)


def test_inductor_code_calls_our_ops():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    x, w, _ = _inputs((4, 16), (16,), torch.float32)
    f = torch.compile(lambda a, b: fl.rms_norm(a, 16, b).sum(), fullgraph=True)
    _, codes = run_and_get_code(lambda: torch.autograd.grad(f(x, w), (x, w)))
    code = "\n".join(codes)
    assert "torch.ops.fusedlayers.rms_norm.default(" in code
    assert "torch.ops.fusedlayers.rms_norm_backward.default(" in code


def test_autocast_cpu_bf16_as_torch():
    """CPU autocast leaves rms_norm alone (as torch): the input's dtype in, the input's dtype out."""
    a, b = torch.randn(4, 16), torch.randn(16, 32)
    w = torch.randn(32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        h = a @ b
        fused, stock = fl.rms_norm(h, 32, w), F.rms_norm(h, (32,), w)
        assert fl.rms_norm(a, 16).dtype == F.rms_norm(a, (16,)).dtype == torch.float32
    assert fused.dtype == stock.dtype == torch.bfloat16
    torch.testing.assert_close(fused, stock)


# ----------------------------------------------------------------------------- module and errors


def test_module_is_a_drop_in():
    for args, kwargs in [((16,), {}), ((16,), dict(eps=1e-3)), (((4, 16),), dict(elementwise_affine=False)),
                         ((16,), dict(dtype=torch.float64))]:
        fused, stock = fl.RMSNorm(*args, **kwargs), torch.nn.RMSNorm(*args, **kwargs)
        assert isinstance(fused, torch.nn.RMSNorm)
        assert repr(fused) == repr(stock)
        assert [(n, p.shape, p.dtype) for n, p in fused.named_parameters()] == [
            (n, p.shape, p.dtype) for n, p in stock.named_parameters()]
        if stock.weight is not None:
            with torch.no_grad():
                stock.weight.normal_()
            fused.load_state_dict(stock.state_dict())
            stock.load_state_dict(fused.state_dict())
        x = torch.randn(3, 4, 16, dtype=kwargs.get("dtype", torch.float32))
        torch.testing.assert_close(fused(x), stock(x))
        r = torch.randn_like(x)
        y, h = fused(x, r)
        torch.testing.assert_close(h, x + r)
        torch.testing.assert_close(y, stock(x + r))
        torch.testing.assert_close(fused(x, residual=r)[0], y)


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda: fl.rms_norm([1.0, 2.0], 2), TypeError, "input"),
        (lambda: fl.rms_norm(torch.arange(6).reshape(2, 3), 3), TypeError, "input"),
        (lambda: fl.rms_norm(torch.randn(2, 3), 4), ValueError, "normalized_shape"),
        (lambda: fl.rms_norm(torch.randn(2, 3), (2, 3, 1)), ValueError, "normalized_shape"),
        (lambda: fl.rms_norm(torch.randn(2, 3), ()), ValueError, "normalized_shape"),
        (lambda: fl.rms_norm(torch.randn(2, 3), 3.0), TypeError, "normalized_shape"),
        (lambda: fl.rms_norm(torch.randn(2, 3), (3.0,)), TypeError, "normalized_shape"),
        (lambda: fl.rms_norm(torch.randn(2, 3), 3, torch.randn(4)), ValueError, "weight"),
        (lambda: fl.rms_norm(torch.randn(2, 3), 3, torch.ones(3, dtype=torch.int64)), TypeError, "weight"),
        (lambda: fl.rms_norm(torch.randn(2, 3), 3, torch.randn(3), eps="1e-6"), TypeError, "eps"),
        (lambda: fl.rms_norm(torch.randn(2, 3), 3, residual=torch.randn(3)), ValueError, "residual"),
        (lambda: fl.rms_norm(torch.randn(2, 3), 3, residual=torch.ones(2, 3, dtype=torch.int32)), TypeError,
         "residual"),
        (lambda: fl.rms_norm(torch.randn(2, 3), 3, torch.randn(3, device="meta")), ValueError, "weight"),
        (lambda: fl.rms_norm(torch.randn(2, 3), 3, out_dtype=torch.int32), TypeError, "out_dtype"),
        (lambda: fl.rms_norm(torch.randn(2, 3), 3, out_dtype="bfloat16"), TypeError, "out_dtype"),
    ],
)
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


# ----------------------------------------------------------------------------- GPU (the `cuda` tests)

CUDA_SIZES = [2048, 4096, 4544, 8192, 1, 3, 5120, 16384, 16385, 65536]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("n_cols", CUDA_SIZES)
def test_cuda_parity(dtype, n_cols):
    rows = 67 if n_cols <= 16384 else 5
    x, w, r = (t.cuda().detach().requires_grad_() if t is not None else None
               for t in _inputs((rows, n_cols), (n_cols,), dtype, True, True))
    _check_rms(x, (n_cols,), w)
    _check_rms(x, (n_cols,), w, r)
    _check_rms(x, (n_cols,), None)
    _check_rms(x[:, : max(1, n_cols // 2)].detach().requires_grad_(), (max(1, n_cols // 2),))  # strided rows


@pytest.mark.cuda
@pytest.mark.parametrize("n_cols", [2048, 4096, 8192])
def test_cuda_many_rows(n_cols):
    """Enough rows for every program of the backward grid to own a range of several tiles."""
    x, w, r = (t.cuda().detach().requires_grad_() for t in _inputs((3000, n_cols), (n_cols,), torch.bfloat16,
                                                                    True, True))
    _check_rms(x, (n_cols,), w, r)


@pytest.mark.cuda
def test_cuda_out_dtype():
    w = torch.randn(40, device="cuda", requires_grad=True)
    check_out_dtype(lambda x, **kw: fl.rms_norm(x, 40, w, 1e-5, **kw), "triton", cuda=True)
    check_input_gradient_in_its_dtype(lambda x, **kw: fl.rms_norm(x, 40, w, 1e-5, **kw), "triton", "cuda")


@pytest.mark.cuda
def test_cuda_autocast_compile_and_opcheck():
    x = torch.randn(8, 64, device="cuda", requires_grad=True)
    w = torch.randn(64, device="cuda", requires_grad=True)
    from fusedlayers.ops.rms_norm import TORCH_AUTOCASTS_RMS_NORM

    with torch.autocast("cuda", dtype=torch.bfloat16):  # fp32 from torch 2.12 (its fp32 list), bf16 before
        h = x @ torch.randn(64, 64, device="cuda")
        expected = F.rms_norm(h, (64,), w)
        assert expected.dtype == (torch.float32 if TORCH_AUTOCASTS_RMS_NORM else torch.bfloat16)
        torch.testing.assert_close(fl.rms_norm(h, 64, w), expected)
        y, h2 = fl.rms_norm(h, 64, w, residual=h)
        assert h2.dtype == torch.bfloat16
        torch.testing.assert_close(y, F.rms_norm(h + h, (64,), w))
    torch._dynamo.reset()
    xb = torch.randn(4, 64, 300, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    wb = torch.randn(300, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = lambda a, b: fl.rms_norm(a, 300, b, residual=a)[0].float().square().sum()  # noqa: E731
    g1 = torch.autograd.grad(torch.compile(f, fullgraph=True)(xb, wb), (xb, wb))
    g2 = torch.autograd.grad(f(xb, wb), (xb, wb))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)
    opcheck(torch.ops.fusedlayers.rms_norm.default, (xb, [300], wb, 1e-6, xb, None))


@pytest.mark.parametrize("backend", BACKENDS)
def test_output_can_be_modified_in_place(backend):
    """As nn.RMSNorm's: a model may scale the norm's output in place (the output is no view among the op's
    outputs), and the gradient is then that of the modified output."""
    x = torch.randn(2, 3, 8, requires_grad=True)
    weight = torch.rand(8) + 0.5
    with fl.use_backend(backend):
        y = fl.rms_norm(x, (8,), weight)
        y *= 3.0
        (gx,) = torch.autograd.grad(y.square().sum(), x)
    expected = F.rms_norm(x, (8,), weight) * 3.0
    torch.testing.assert_close(y, expected)
    torch.testing.assert_close(gx, torch.autograd.grad(expected.square().sum(), x)[0])
