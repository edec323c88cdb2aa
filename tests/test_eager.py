"""The eager fast path (fusedlayers/ops/_eager.py): the F-style functions run the ops' bodies without the
dispatcher in plain eager code, and the registered ops wherever something could tell the difference."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.utils._python_dispatch import TorchDispatchMode

import fusedlayers as fl
from fusedlayers import kernels
from fusedlayers.ops import _eager
from tests.conftest import INTERPRETER


def _node(t: torch.Tensor) -> str:
    return type(t.grad_fn).__name__


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def test_plain_eager_takes_the_fast_path_and_modes_take_the_op():
    x = torch.randn(3, 5, requires_grad=True)
    assert _node(fl.softmax(x)) == "_EagerOpBackward"
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # attention's CPU autocast rule is a cast to bf16 (registered as such): the fast path casts as it does;
        # softmax has a CUDA rule only, so CPU autocast falls through to it and the fast path runs it
        y = fl.scaled_dot_product_attention(q, q, q)
        assert _node(y) == "_EagerOpBackward" and y.dtype == torch.bfloat16
        assert _node(fl.softmax(x)) == "_EagerOpBackward"
    with _PassThrough():  # e.g. FakeTensorMode, selective checkpointing, FlopCounterMode
        assert _node(fl.softmax(x)) != "_EagerOpBackward"
    with torch.device("cpu"):  # a function mode
        assert _node(fl.softmax(x)) != "_EagerOpBackward"
    _eager.enabled = False
    try:
        assert _node(fl.softmax(x)) != "_EagerOpBackward"
    finally:
        _eager.enabled = True


def test_autocast_rule_that_is_not_only_a_cast_takes_the_op(monkeypatch):
    q = torch.randn(1, 2, 4, 8, requires_grad=True)
    monkeypatch.setattr(_eager, "_AUTOCAST_CASTS", {})
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fl.scaled_dot_product_attention(q, q, q)
    assert _node(y) != "_EagerOpBackward" and y.dtype == torch.bfloat16


def test_autocast_fast_path_equals_the_registered_op_bitwise():
    """Attention under autocast (fp32 query and key, a bf16 value, an fp32 additive mask): the fast path's cast and
    body give the dispatcher's output and gradients bit for bit."""
    q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 2, 6, 8)
    v, mask = torch.randn(2, 2, 6, 8).bfloat16(), torch.randn(2, 1, 6, 6)

    def fn(q, k, v, mask):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return fl.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    fast, dispatched = _both_paths(fn, *(t.requires_grad_() for t in (q, k, v, mask)))
    assert len(fast) == len(dispatched) == 5
    with torch.autocast("cpu", dtype=torch.bfloat16):  # and torch's op accepts the same mixed dtypes there
        expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    assert fast[0].dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(fast[0], expected, rtol=2e-2, atol=2e-2)
    for a, b in zip(fast, dispatched, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_no_grad_calls_the_body_without_a_graph():
    x = torch.randn(3, 5, requires_grad=True)
    with torch.no_grad():
        y = fl.softmax(x)
    assert y.grad_fn is None and not y.requires_grad
    torch.testing.assert_close(y, torch.softmax(x, -1), rtol=0, atol=1e-6)


def test_non_differentiable_outputs_get_no_zero_filled_gradient(monkeypatch):
    """An output the op marks non-differentiable (attention's logsumexp) reaches its backward as None, not as a
    zero-filled tensor that costs an allocation and a launch; the gradients are the same."""
    from fusedlayers.ops import scaled_dot_product_attention as ops

    op = ops.scaled_dot_product_attention
    backward, setup_context = _eager._AUTOGRAD[op]
    seen = []

    def recording(ctx, grad_out, grad_lse):
        seen.append(grad_lse)
        return backward(ctx, grad_out, grad_lse)

    monkeypatch.setitem(_eager._AUTOGRAD, op, (recording, setup_context))
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    fl.scaled_dot_product_attention(q, q, q).sum().backward()
    assert seen == [None]
    expected = torch.autograd.grad(F.scaled_dot_product_attention(q, q, q).sum(), q)[0]
    torch.testing.assert_close(q.grad, expected)


def test_functorch_transforms_take_the_op():
    x = torch.randn(4, 3, 5)  # vmap runs the op through the dispatcher's batching fallback, per sample
    torch.testing.assert_close(torch.vmap(fl.softmax)(x), torch.softmax(x, -1), rtol=0, atol=1e-6)


def _both_paths(fn, *inputs):
    """fn's outputs and the gradients of every input that requires grad, with the fast path on and off."""
    results = []
    for enabled in (True, False):
        _eager.enabled = enabled
        try:
            torch.manual_seed(0)
            leaves = [t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t
                      for t in inputs]
            out = fn(*leaves)
            outs = out if isinstance(out, tuple) else (out,)
            loss = sum((o.float() * torch.linspace(-1, 2, o.numel(), device=o.device).reshape(o.shape)).sum()
                       for o in outs if o.is_floating_point())
            loss.backward()
            results.append([*outs, *(t.grad for t in leaves if isinstance(t, torch.Tensor) and t.requires_grad)])
        finally:
            _eager.enabled = True
    return results


CASES = {
    "softmax": (lambda x: fl.softmax(x, 1), (torch.randn(3, 7, 5),)),
    "scaled_masked_softmax": (lambda s, m: fl.scaled_masked_softmax(s, 0.5, m, is_causal=True),
                              (torch.randn(2, 6, 6), torch.randn(6, 6))),
    "attention": (lambda q, k, v: fl.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True),
                  (torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16), torch.randn(2, 3, 9, 16))),
    "cross_entropy": (lambda x, t: fl.cross_entropy(x, t, label_smoothing=0.1, z_loss=1e-3),
                      (torch.randn(10, 33), torch.randint(0, 33, (10,)))),
    "linear_cross_entropy": (lambda x, w, b, t: fl.linear_cross_entropy(x, w, t, linear_bias=b, reduction="sum"),
                             (torch.randn(10, 16), torch.randn(37, 16), torch.randn(37), torch.randint(0, 37, (10,)))),
    "fake_quantize": (lambda x: fl.fake_quantize(x, torch.rand(6, device=x.device) + 0.05,
                                                 torch.randint(-3, 3, (6,), device=x.device), -8, 7, 0),
                      (torch.randn(6, 10) * 3,)),
    "fake_quantize_lsq": (lambda x, s, z: fl.fake_quantize(x, s, z, -8, 7, 0, grad_factor=0.5),
                          (torch.randn(6, 10) * 3, torch.rand(6) + 0.05, torch.randn(6))),
    "fake_quantize_dynamic": (lambda x: fl.fake_quantize_dynamic(x, group_size=4, return_qparams=True),
                              (torch.randn(5, 12),)),
}
CASES.update({  # the norms, plain and with the fused residual add (both outputs get gradients)
    "rms_norm": (lambda x, w: fl.rms_norm(x, (5, 7), w), (torch.randn(3, 5, 7), torch.randn(5, 7))),
    "rms_norm_residual": (lambda x, w, r: fl.rms_norm(x, 7, w, residual=r),
                          (torch.randn(4, 7), torch.randn(7), torch.randn(4, 7))),
    "layer_norm": (lambda x, w, b: fl.layer_norm(x, 33, w, b), (torch.randn(6, 33), torch.randn(33), torch.randn(33))),
    "layer_norm_residual": (lambda x, w, b, r: fl.layer_norm(x, 33, w, b, residual=r),
                            (torch.randn(6, 33), torch.randn(33), torch.randn(33), torch.randn(6, 33))),
})


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
@pytest.mark.parametrize("name", CASES)
def test_fast_path_equals_the_registered_op_bitwise(name, device, autocast):
    """With and without autocast (bf16): under it the ops without a rule for the device take the fast path."""
    fn, inputs = CASES[name]
    inputs = tuple(t.to(device).requires_grad_() if t.is_floating_point() else t.to(device) for t in inputs)
    if autocast:
        inner = fn

        def fn(*args):
            with torch.autocast(device, dtype=torch.bfloat16):
                return inner(*args)
    fast, dispatched = _both_paths(fn, *inputs)
    assert len(fast) == len(dispatched) > 1
    for a, b in zip(fast, dispatched, strict=True):
        assert a is not None and b is not None
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_double_backward_through_the_fast_path():
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradgradcheck(lambda t: fl.softmax(t, -1), (x,))
    y = fl.softmax(x)
    (g,) = torch.autograd.grad((y * torch.randn_like(y)).sum(), x, create_graph=True)
    assert _node(g) == "_EagerOpBackward"  # the backward op ran through the fast path, differentiably


def test_fast_path_matches_torch():
    x = torch.randn(8, 50, requires_grad=True)
    t = torch.randint(0, 50, (8,))
    fl.cross_entropy(x, t).backward()
    expected = torch.autograd.grad(F.cross_entropy(x, t), x)[0]
    torch.testing.assert_close(x.grad, expected, rtol=1e-5, atol=1e-6)


def test_backward_op_without_autograd_keeps_the_dispatchers_error():
    """Double backward through attention (its backward op has no autograd) fails loudly on both paths."""
    q = torch.randn(1, 2, 8, 16, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(fl.scaled_dot_product_attention(q, q, q).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="no autograd formula was registered"):
        g.sum().backward()


# ----------------------------------------------------------------------------- direct kernel launches


@triton.jit
def _scale_kernel(x_ptr, y_ptr, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(y_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) * factor, mask=offs < n)


def test_launch_keys_cover_tritons_specialization():
    """Whatever Triton specializes a compiled kernel on must change the key of the direct launch."""
    def key(a):
        return kernels._args_key((a,))

    x = torch.zeros(8)
    assert key(x) != key(x[1:])  # 16-byte alignment
    assert key(x) != key(x.half())
    assert key(x) == key(torch.ones(3))  # shape and values are not specialized on
    for a, b in [(1, 2), (16, 17), (32, 49), (2**31 - 16, 2**31), (2**63 - 16, 2**63), (1, True),
                 (0, False), (1, 1.0)]:
        assert key(a) != key(b), (a, b)
    assert key(0.5) == key(2.0)  # floats are passed as fp32 whatever their value


@pytest.mark.skipif(not INTERPRETER, reason="the interpreter is off")
def test_launch_goes_through_triton_under_the_interpreter():
    x = torch.randn(100)
    y = torch.empty_like(x)
    kernels.launch(_scale_kernel, (2,), x, y, 100, 2.5, BLOCK=64)
    assert kernels._direct_launchers[id(_scale_kernel)] is False
    torch.testing.assert_close(y, x * 2.5, rtol=0, atol=0)


@pytest.mark.cuda
def test_direct_launch_equals_tritons():
    """The second launch with the same argument properties calls the compiled kernel without Triton's launcher
    (Triton's run is disabled to prove it); misaligned views, n of 1 and of a multiple of 16 compile anew."""
    x = torch.randn(1024, device="cuda")
    out = torch.empty(1024, device="cuda")
    for offset, n in [(0, 1000), (1, 999), (0, 16), (0, 1), (3, 32)]:
        src, dst = x[offset:offset + n], out[offset:offset + n]
        dst.zero_()
        kernels.launch(_scale_kernel, (kernels.cdiv(n, 128),), src, dst, n, 2.5, BLOCK=128)
        torch.testing.assert_close(dst, src * 2.5, rtol=0, atol=0)
        dst.zero_()
        _scale_kernel.run = _fail
        try:
            kernels.launch(_scale_kernel, (kernels.cdiv(n, 128),), src, dst, n, 2.5, BLOCK=128)
        finally:
            del _scale_kernel.run
        torch.testing.assert_close(dst, src * 2.5, rtol=0, atol=0)
    assert len(kernels._direct_launchers[id(_scale_kernel)].compiled) == 5


@pytest.mark.cuda
def test_launch_hooks_send_launches_through_triton():
    from triton import knobs

    x = torch.randn(64, device="cuda")
    y = torch.empty_like(x)
    seen = []
    hook = knobs.runtime.launch_enter_hook
    knobs.runtime.launch_enter_hook = lambda metadata: seen.append(metadata)
    try:
        for _ in range(2):
            kernels.launch(_scale_kernel, (1,), x, y, 64, 2.0, BLOCK=64)
    finally:
        knobs.runtime.launch_enter_hook = hook
    assert len(seen) == 2
    torch.testing.assert_close(y, x * 2.0, rtol=0, atol=0)


def _fail(*args, **kwargs):
    raise AssertionError("Triton's launcher ran")


def test_inductor_fallbacks_registered_up_front():
    """Every op has inductor's fallback lowering before a graph meets it (at import on torch < 2.13, where inductor's
    own first-meeting path printed each argument's whole IR history: exponential in a deep model's depth), the layout
    constraint inductor would give it, and a compiled chain of ops still gives the eager result."""
    from torch._inductor.lowering import lowerings, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    _eager.register_inductor_fallbacks()
    assert all(op._opoverload in lowerings for op in _eager._BODIES)
    tag = get_layout_constraint_tag(torch.ops.fusedlayers.rms_norm.default, with_default=True)
    assert tag_to_layout_constraint(tag) is not None  # custom ops keep eager strides (needs_fixed_stride_order)

    def chain(x, r):
        for _ in range(6):  # each norm's residual output feeds the next, as in a model's residual stream
            x, r = fl.rms_norm(x, 8, residual=r)
        return x + r

    x, r = torch.randn(4, 8), torch.randn(4, 8)
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(chain, fullgraph=True)(x, r), chain(x, r))
