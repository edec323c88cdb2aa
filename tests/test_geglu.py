"""fl.geglu and fl.GeGLUMLP: parity with ``F.gelu(gate, approximate=...) * up`` (output and both gradients, against
float64, exact GELU and its tanh form), the Triton kernels under the interpreter (the SwiGLU kernels with GELU's
activation), strided and empty input, registration (opcheck, compile), gradcheck, the module against Gemma's MLP,
errors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fusedlayers as fl
from tests.test_rms_norm import check_parity

BACKENDS = ["reference", "triton"]
APPROXIMATIONS = ["none", "tanh"]
SHAPES = [(3, 4544), (7, 5), (2, 3, 37), (1,), (), (2, 2, 2, 300)]


def _inputs(shape, dtype, device="cpu"):
    gate = (torch.randn(shape, device=device) * 3).to(dtype).requires_grad_()
    up = torch.randn(shape, device=device).to(dtype).requires_grad_()
    return gate, up


def _check(gate, up, approximate):
    return check_parity(lambda g, u: fl.geglu(g, u, approximate),
                        lambda g, u: F.gelu(g, approximate=approximate) * u, [gate, up], ["gate", "up"])


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_reference_parity(shape, dtype, approximate):
    with fl.use_backend("reference"):
        _check(*_inputs(shape, dtype), approximate)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # bf16 runs in the cuda tests (interpreter)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_triton_parity(shape, dtype, approximate):
    with fl.use_backend("triton"):
        _check(*_inputs(shape, dtype), approximate)


@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_saturated_gates_and_strided_halves(backend, approximate):
    """Gates of +-30 (the tanh form's slope there: no cancellation) and gate/up as the halves of a fused gate_up
    projection, read in place; float64 to 1e-12 on the reference."""
    gate, up = (t.requires_grad_() for t in torch.randn(6, 2 * 70).mul(4).chunk(2, -1))
    with torch.no_grad():
        gate[0, :6] = torch.tensor([-30.0, -8.0, -3.0, 3.0, 8.0, 30.0])
    with fl.use_backend(backend):
        _check(gate, up, approximate)
        g64, u64 = (t.detach().double().requires_grad_() for t in (gate, up))
        out = fl.geglu(g64, u64, approximate)
        grads = torch.autograd.grad(out.square().sum(), (g64, u64))
    g, u = (t.detach().double().requires_grad_() for t in (gate, up))
    expected = F.gelu(g, approximate=approximate) * u
    for a, b in zip((out, *grads), (expected, *torch.autograd.grad(expected.square().sum(), (g, u))), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_mixed_dtypes_and_requested_gradients(backend):
    with fl.use_backend(backend):
        assert fl.geglu(torch.randn(0, 3), torch.randn(0, 3)).shape == (0, 3)
        gate, up = torch.randn(4, 9, dtype=torch.float16, requires_grad=True), torch.randn(4, 9)
        out = fl.geglu(gate, up, "tanh")
        assert out.dtype == torch.float32  # promoted, as F.gelu(gate) * up
        torch.testing.assert_close(out, F.gelu(gate.float(), approximate="tanh") * up, rtol=2e-3, atol=2e-3)
        (grad,) = torch.autograd.grad(out.sum(), gate)
        assert grad.dtype == torch.float16 and up.grad is None


def test_gradcheck():
    gate, up = (t.double().requires_grad_() for t in (torch.randn(3, 7) * 2, torch.randn(3, 7)))
    for approximate in APPROXIMATIONS:
        assert torch.autograd.gradcheck(lambda g, u, a=approximate: fl.geglu(g, u, a), (gate, up))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    ops = torch.ops.fusedlayers
    gate, up = _inputs((3, 4, 17), torch.float32)
    g, gd, ud = torch.randn(3, 4, 17), gate.detach(), up.detach()
    halves = torch.randn(3, 34).chunk(2, -1)
    samples = [
        (ops.geglu.default, (gate, up, "tanh")),
        (ops.geglu.default, (gate.detach().half().requires_grad_(), up, "none")),
        (ops.geglu.default, (halves[0].requires_grad_(), halves[1].requires_grad_(), "tanh")),
        (ops.geglu_backward.default, (g, gd, ud, "none", True, True)),
        (ops.geglu_backward.default, (g.half(), gd.half(), ud.half(), "tanh", True, False)),
    ]
    with fl.use_backend(backend):
        for op, args in samples:
            opcheck(op, args)


def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()

    def f(x, gate, up):
        return (fl.geglu(x * gate, up, "tanh") * x).sum() + fl.geglu(gate, up).sum()

    x, (gate, up) = torch.randn(2, 8, 16, requires_grad=True), _inputs((2, 8, 16), torch.float32)
    compiled = torch.compile(f, fullgraph=True)(x, gate, up)
    eager = f(x, gate, up)
    torch.testing.assert_close(compiled, eager)
    for a, b in zip(torch.autograd.grad(compiled, (x, gate, up)), torch.autograd.grad(eager, (x, gate, up)),
                    strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_matches_gemma_mlp(backend):
    transformers = pytest.importorskip("transformers")
    from transformers.models.gemma.modeling_gemma import GemmaMLP

    config = transformers.GemmaConfig(hidden_size=16, intermediate_size=44, hidden_activation="gelu_pytorch_tanh")
    torch.manual_seed(0)
    stock = GemmaMLP(config)
    fused = fl.GeGLUMLP(16, 44)
    assert [(n, p.shape) for n, p in fused.named_parameters()] == [(n, p.shape) for n, p in stock.named_parameters()]
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
    assert "approximate='tanh'" in repr(fused)


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda: fl.geglu([1.0], torch.randn(1)), TypeError, "gate"),
        (lambda: fl.geglu(torch.randn(2), torch.randn(3)), ValueError, "same shape"),
        (lambda: fl.geglu(torch.randn(2), torch.zeros(2, dtype=torch.long)), TypeError, "up"),
        (lambda: fl.geglu(torch.randn(2), torch.randn(2), "exact"), ValueError, "approximate"),
        (lambda: fl.GeGLUMLP(4, 8, approximate="fast"), ValueError, "approximate"),
    ],
)
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


# ----------------------------------------------------------------------------- GPU (the `cuda` tests)


@pytest.mark.cuda
@pytest.mark.parametrize("approximate", APPROXIMATIONS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape", [(4096, 8192), (3, 1000, 777)], ids=str)
def test_cuda_parity(shape, dtype, approximate):
    _check(*_inputs(shape, dtype, "cuda"), approximate)
    gate, up = (t.requires_grad_() for t in torch.randn(512, 2 * 2048, device="cuda").to(dtype).chunk(2, -1))
    _check(gate, up, approximate)
