"""fl.swiglu and fl.SwiGLUMLP: parity with ``F.silu(gate) * up`` (output and both gradients, against float64), the
Triton kernels under the interpreter, strided and empty input, registration (opcheck, compile, autocast), gradcheck,
the module against a hand-written Llama MLP, errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.library import opcheck

import fusedlayers as fl
from tests.test_rms_norm import check_parity, recorded_backward_calls

BACKENDS = ["reference", "triton"]
SHAPES = [(3, 4544), (7, 5), (2, 3, 37), (1,), (), (4, 1100), (2, 2, 2, 300)]


def _stock(gate, up):
    return F.silu(gate) * up


def _inputs(shape, dtype, gate_dtype=None, up_dtype=None):
    gate = (torch.randn(shape) * 3).to(gate_dtype or dtype).requires_grad_()
    up = torch.randn(shape).to(up_dtype or dtype).requires_grad_()
    return gate, up


def _check(gate, up):
    return check_parity(fl.swiglu, _stock, [gate, up], ["gate", "up"])


# ----------------------------------------------------------------------------- parity


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_parity(shape, dtype):
    with fl.use_backend("reference"):
        _check(*_inputs(shape, dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16 runs in the cuda tests (interpreter)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_parity(shape, dtype):
    with fl.use_backend("triton"):
        _check(*_inputs(shape, dtype))


def test_triton_several_blocks_per_row(monkeypatch):
    """Rows longer than a block, the last one partial, in the strided (rows, cols) layout."""
    from fusedlayers.kernels import swiglu as kernels

    monkeypatch.setattr(kernels, "BLOCK", 128)
    gate, up = (t.requires_grad_() for t in torch.randn(5, 2 * 300).chunk(2, -1))  # strided leaves
    with fl.use_backend("triton"):
        _check(gate, up)
        _check(*_inputs((5, 300), torch.float32))


@pytest.mark.filterwarnings("ignore:overflow encountered in exp", "ignore:invalid value encountered")
@pytest.mark.parametrize("backend", BACKENDS)
def test_extreme_values(backend):
    """sigmoid saturates without NaN: silu(-inf) = -0 * ... = 0, silu(+inf) = inf, large |gate| finite."""
    gate = torch.tensor([-1e4, -100.0, -20.0, 0.0, 20.0, 100.0, 1e4, float("-inf"), float("inf")])
    up = torch.full_like(gate, 1.5)
    with fl.use_backend(backend):
        torch.testing.assert_close(fl.swiglu(gate, up), _stock(gate, up), equal_nan=True)
        g, u = gate[:7].clone().requires_grad_(), up[:7].clone().requires_grad_()
        fl.swiglu(g, u).sum().backward()
        g2, u2 = gate[:7].clone().requires_grad_(), up[:7].clone().requires_grad_()
        _stock(g2, u2).sum().backward()
    torch.testing.assert_close(g.grad, g2.grad)
    torch.testing.assert_close(u.grad, u2.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous(backend):
    base = torch.randn(6, 40, 18)
    with fl.use_backend(backend):
        # the halves of one fused gate_up projection, as chunk(2, -1) gives them
        gate, up = (t.detach().requires_grad_() for t in base.chunk(2, -1))
        assert not gate.is_contiguous() and not up.is_contiguous()
        _check(gate, up)
        assert fl.swiglu(gate, up).is_contiguous()
        # transposed, sliced, and one strided next to one contiguous
        for gate, up in [(base.transpose(1, 2), base.transpose(1, 2) * 0.5), (base[:, ::4], base[:, 1::4]),
                         (base[..., 1:8], torch.randn(6, 40, 7)), (base.permute(2, 0, 1), base.permute(2, 0, 1) + 1)]:
            gate, up = gate.detach().requires_grad_(), up.detach().requires_grad_()
            _check(gate, up)
        # an expanded (stride 0) gradient, as from .sum()
        gate, up = _inputs((4, 16), torch.float32)
        fl.swiglu(gate, up).sum().backward()
        g2, u2 = gate.detach().requires_grad_(), up.detach().requires_grad_()
        _stock(g2, u2).sum().backward()
        torch.testing.assert_close(gate.grad, g2.grad)
        torch.testing.assert_close(up.grad, u2.grad)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_dtypes(backend):
    """The output in the promoted dtype (as torch's mul), each gradient in its input's dtype."""
    cases = [(torch.float16, torch.float32), (torch.float32, torch.float16)]
    if backend == "reference":
        cases += [(torch.bfloat16, torch.float32), (torch.bfloat16, torch.float16)]
    with fl.use_backend(backend):
        for gate_dtype, up_dtype in cases:
            gate, up = _inputs((5, 33), None, gate_dtype, up_dtype)
            out, dgate, dup = _check(gate, up)
            assert out.dtype == torch.promote_types(gate_dtype, up_dtype)
            assert (dgate.dtype, dup.dtype) == (gate_dtype, up_dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_runs_the_reference(backend):
    gate, up = _inputs((4, 10), torch.float64)
    with fl.use_backend(backend):
        out = fl.swiglu(gate, up)
    torch.testing.assert_close(out, _stock(gate, up), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty(backend):
    with fl.use_backend(backend):
        for shape in [(0, 5), (4, 0), (2, 0, 3), (0,)]:
            gate, up = _inputs(shape, torch.float32)
            out = fl.swiglu(gate, up)
            assert out.shape == shape
            out.sum().backward()
            assert gate.grad.shape == up.grad.shape == shape


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaves_inputs_unchanged_and_saves_only_them(backend):
    gate, up = _inputs((4, 50), torch.float32)
    before = [t.detach().clone() for t in (gate, up)]
    saved = []
    with fl.use_backend(backend):
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
            out = fl.swiglu(gate, up)
        out.sum().backward()
    assert all(torch.equal(t.detach(), b) for t, b in zip((gate, up), before, strict=True))
    assert [t.data_ptr() for t in saved] == [gate.data_ptr(), up.data_ptr()]


@pytest.mark.parametrize("backend", BACKENDS)
def test_skips_gradients_nobody_asked_for(backend):
    gate, up = _inputs((5, 12), torch.float32)
    for gi, ui, expected in [(gate, up.detach(), (True, False)), (gate.detach(), up, (False, True)),
                             (gate, up, (True, True))]:
        with fl.use_backend(backend), recorded_backward_calls() as mode:
            fl.swiglu(gi, ui).sum().backward()
        (args,) = mode.calls
        assert args[-2:] == expected
    with fl.use_backend(backend):
        out = fl.swiglu(gate.detach(), up.detach())
    assert not out.requires_grad


# ----------------------------------------------------------------------------- registration


def test_gradcheck():
    gate, up = _inputs((3, 2, 5), torch.float64)
    assert torch.autograd.gradcheck(fl.swiglu, (gate, up))
    assert torch.autograd.gradcheck(lambda g: fl.swiglu(g, up.detach()), (gate,))
    assert torch.autograd.gradcheck(lambda u: fl.swiglu(gate.detach(), u), (up,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    ops = torch.ops.fusedlayers
    gate, up = _inputs((3, 4, 17), torch.float32)
    g = torch.randn(3, 4, 17)
    gd, ud = gate.detach(), up.detach()
    halves = torch.randn(3, 34).chunk(2, -1)
    samples = [
        (ops.swiglu.default, (gate, up)),
        (ops.swiglu.default, (gate.detach().half().requires_grad_(), up)),
        (ops.swiglu.default, (halves[0].requires_grad_(), halves[1].requires_grad_())),
        (ops.swiglu.default, (torch.randn(0, 3, requires_grad=True), torch.randn(0, 3))),
        (ops.swiglu_backward.default, (g, gd, ud, True, True)),
        (ops.swiglu_backward.default, (g, gd, ud, False, True)),
        (ops.swiglu_backward.default, (g.half(), gd.half(), ud.half(), True, False)),
    ]
    with fl.use_backend(backend):
        for op, args in samples:
            opcheck(op, args)


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()

    def f(x, gate, up):
        h = fl.swiglu(x * gate, up)
        return (fl.swiglu(h, up.detach()) * x).sum()

    compiled = torch.compile(f, fullgraph=True)
    x, (gate, up) = torch.randn(2, 8, 16, requires_grad=True), _inputs((2, 8, 16), torch.float32)
    loss = compiled(x, gate, up)
    grads = torch.autograd.grad(loss, (x, gate, up))
    leaves = [t.detach().requires_grad_() for t in (x, gate, up)]
    expected = torch.autograd.grad(f(*leaves), leaves)
    torch.testing.assert_close(loss, f(*leaves))
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b)


def test_compile_dynamic_shapes():
    torch._dynamo.reset()
    f = lambda g, u: fl.swiglu(g, u).sum()
    compiled = torch.compile(f, dynamic=True, fullgraph=True)
    for n in (5, 7, 9):
        gate, up = _inputs((3, n), torch.float32)
        got = torch.autograd.grad(compiled(gate, up), (gate, up))
        for a, e in zip(got, torch.autograd.grad(f(gate, up), (gate, up)), strict=True):
            torch.testing.assert_close(a, e)


def test_inductor_code_calls_our_ops():
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    gate, up = _inputs((4, 16), torch.float32)
    f = torch.compile(lambda a, b: fl.swiglu(a, b).sum(), fullgraph=True)
    _, codes = run_and_get_code(lambda: torch.autograd.grad(f(gate, up), (gate, up)))
    code = "\n".join(codes)
    assert "torch.ops.fusedlayers.swiglu.default(" in code
    assert "torch.ops.fusedlayers.swiglu_backward.default(" in code


def test_autocast_as_torch():
    """torch's silu and mul have no autocast rule (on CUDA or CPU): they run in their inputs' dtypes; so does the op
    (no autocast kernel of its own: it falls through)."""
    for op in ("aten::silu", "aten::mul.Tensor", "fusedlayers::swiglu"):
        for key in ("AutocastCUDA", "AutocastCPU"):
            assert not torch._C._dispatch_has_kernel_for_dispatch_key(op, key), (op, key)
    a, b, c = torch.randn(4, 16), torch.randn(16, 32), torch.randn(16, 32)
    up32 = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        gate, up = a @ b, a @ c
        fused, stock = fl.swiglu(gate, up), _stock(gate, up)
        mixed, mixed_stock = fl.swiglu(gate, up32), _stock(gate, up32)
    assert fused.dtype == stock.dtype == torch.bfloat16
    assert mixed.dtype == mixed_stock.dtype == torch.float32
    torch.testing.assert_close(fused, stock)
    torch.testing.assert_close(mixed, mixed_stock, atol=2e-2, rtol=1e-2)  # stock rounds silu(gate) to bf16 first


# ----------------------------------------------------------------------------- module and errors


class LlamaMLP(nn.Module):
    """Llama's MLP as transformers writes it (LlamaMLP, hidden_act="silu")."""

    def __init__(self, dim, hidden_dim, bias=False, dtype=None):
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim, bias=bias, dtype=dtype)
        self.up_proj = nn.Linear(dim, hidden_dim, bias=bias, dtype=dtype)
        self.down_proj = nn.Linear(hidden_dim, dim, bias=bias, dtype=dtype)
        self.act_fn = nn.SiLU()

    def forward(self, x):
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [False, True])
def test_module_matches_llama_mlp(backend, bias):
    stock = LlamaMLP(16, 44, bias)
    fused = fl.SwiGLUMLP(16, 44, bias=bias)
    assert [(n, p.shape) for n, p in fused.named_parameters()] == [(n, p.shape) for n, p in stock.named_parameters()]
    assert all(isinstance(m, nn.Linear) for m in (fused.gate_proj, fused.up_proj, fused.down_proj))
    fused.load_state_dict(stock.state_dict())
    x = torch.randn(2, 3, 16, requires_grad=True)
    x2 = x.detach().requires_grad_()
    with fl.use_backend(backend):
        out = fused(x)
        out.square().sum().backward()
    expected = stock(x2)
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(x.grad, x2.grad)
    for (name, p), q in zip(fused.named_parameters(), stock.parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, msg=name)


def test_module_factory_kwargs():
    m = fl.SwiGLUMLP(8, 24, dtype=torch.float64, device="cpu")
    assert all(p.dtype == torch.float64 for p in m.parameters())
    assert m.gate_proj.bias is None and m.down_proj.weight.shape == (8, 24)
    assert m(torch.randn(3, 8, dtype=torch.float64)).shape == (3, 8)
    assert fl.SwiGLUMLP(8, 24, bias=True).up_proj.bias.shape == (24,)


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda: fl.swiglu([1.0, 2.0], torch.randn(2)), TypeError, "gate"),
        (lambda: fl.swiglu(torch.randn(2), [1.0, 2.0]), TypeError, "up"),
        (lambda: fl.swiglu(torch.arange(6), torch.randn(6)), TypeError, "gate"),
        (lambda: fl.swiglu(torch.randn(6), torch.ones(6, dtype=torch.int32)), TypeError, "up"),
        (lambda: fl.swiglu(torch.randn(6, dtype=torch.complex64), torch.randn(6)), TypeError, "gate"),
        (lambda: fl.swiglu(torch.randn(2, 3), torch.randn(3)), ValueError, "gate and up must have the same shape"),
        (lambda: fl.swiglu(torch.randn(2, 3), torch.randn(3, 2)), ValueError, "up of shape"),
        (lambda: fl.swiglu(torch.randn(2, 3), torch.randn(2, 3, device="meta")), ValueError, "up is on"),
    ],
)
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


# ----------------------------------------------------------------------------- GPU (the `cuda` tests)

CUDA_SHAPES = [(16384, 11008), (4096, 14336), (3, 4544), (7, 5), (1,), (2049, 8193)]


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", CUDA_SHAPES, ids=str)
def test_cuda_parity(dtype, shape):
    gate, up = (t.cuda().detach().requires_grad_() for t in _inputs(shape, dtype))
    _check(gate, up)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cuda_strided_and_mixed(dtype):
    gate_up = (torch.randn(1000, 2 * 5504, device="cuda") * 3).to(dtype)
    gate, up = (t.detach().requires_grad_() for t in gate_up.chunk(2, -1))
    _check(gate, up)
    t = torch.randn(5504, 1000, device="cuda", dtype=dtype).t()
    _check(t.detach().requires_grad_(), torch.randn(1000, 5504, device="cuda", dtype=dtype).requires_grad_())
    _check(*(x.cuda().detach().requires_grad_() for x in _inputs((300, 77), None, dtype, torch.float32)))


@pytest.mark.cuda
def test_cuda_autocast_compile_and_opcheck():
    x = torch.randn(8, 64, device="cuda")
    w1, w2 = torch.randn(64, 128, device="cuda", requires_grad=True), torch.randn(64, 128, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        gate, up = x @ w1, x @ w2
        fused, stock = fl.swiglu(gate, up), _stock(gate, up)
    assert fused.dtype == stock.dtype == torch.bfloat16
    torch.testing.assert_close(fused, stock)
    fused.float().sum().backward()
    assert w1.grad is not None
    gb, ub = _inputs((4, 64, 300), torch.bfloat16)
    gb, ub = gb.cuda().detach().requires_grad_(), ub.cuda().detach().requires_grad_()
    f = lambda a, b: fl.swiglu(a, b).float().square().sum()
    g1 = torch.autograd.grad(torch.compile(f, fullgraph=True)(gb, ub), (gb, ub))
    g2 = torch.autograd.grad(f(gb, ub), (gb, ub))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)
    opcheck(torch.ops.fusedlayers.swiglu.default, (gb, ub))
    opcheck(torch.ops.fusedlayers.swiglu_backward.default, (torch.randn_like(gb), gb.detach(), ub.detach(), True,
                                                            True))
    mlp = fl.SwiGLUMLP(64, 172, device="cuda", dtype=torch.bfloat16)
    ref = LlamaMLP(64, 172, dtype=torch.bfloat16).cuda()
    ref.load_state_dict(mlp.state_dict())
    xb = torch.randn(5, 64, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close(mlp(xb), ref(xb), atol=3e-2, rtol=2e-2)
