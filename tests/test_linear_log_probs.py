"""fl.linear_log_probs / linear_log_prob_statistics: parity with log_softmax(F.linear(...)).gather (temperature,
logit scale, soft-cap, bias, ignored rows, entropy), TRL's chunked log-prob function for the logged statistics,
chunking, gradients of either output alone, registration, compile, autocast, errors.

The reference backend runs on CPU tensors by default; `triton` runs the row kernels between the products (under the
interpreter on CPU, compiled on GPU for the `cuda`-marked tests).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.library import opcheck

import fusedlayers as fl
from tests.parity import assert_parity, loss_floor

BACKENDS = ["reference", "triton"]


def stock_log_probs(x, w, t, b=None, temperature=1.0, softcap=None, logit_scale=1.0, ignore_index=-100):
    """What a user writes: full logits (in the input's dtype, as F.linear gives them), then fp32 (fp64) math."""
    z = F.linear(x, w, b)
    z = z.to(torch.float64 if z.dtype == torch.float64 else torch.float32) * logit_scale
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    log_p = (z / temperature).log_softmax(-1)
    valid = t != ignore_index
    lp = log_p.gather(-1, t.where(valid, 0).unsqueeze(-1)).squeeze(-1)
    entropy = -(log_p.exp() * log_p).sum(-1)
    return lp.where(valid, 0), entropy.where(valid, 0)


def _problem(shape=(3, 13), hidden=24, vocab=101, dtype=torch.float32, bias=False, device="cpu", ignore_every=4):
    x = torch.randn(*shape, hidden, device=device).to(dtype)
    w = (torch.randn(vocab, hidden, device=device) / hidden**0.5 * 2).to(dtype)
    b = (torch.randn(vocab, device=device) * 0.5).to(dtype) if bias else None
    t = torch.randint(0, vocab, shape, device=device)
    if ignore_every:
        t.view(-1)[::ignore_every] = -100
    return x, w, b, t


def _check(x, w, b, t, chunk_size=None, **kw):
    """log-probs, entropy and the gradients of input, weight (and bias) for random upstream gradients of both
    outputs vs the stock ops vs the float64 reference."""
    leaves = [x, w] + ([b] if b is not None else [])
    fused_in = [v.detach().clone().requires_grad_() for v in leaves]
    stock_in = [v.detach().clone().requires_grad_() for v in leaves]
    ref_in = [v.detach().double().requires_grad_() for v in leaves]

    def bias(ins):
        return ins[2] if b is not None else None

    lp, ent = fl.linear_log_probs(fused_in[0], fused_in[1], t, linear_bias=bias(fused_in), return_entropy=True,
                                  chunk_size=chunk_size, **kw)
    stock = stock_log_probs(stock_in[0], stock_in[1], t, bias(stock_in), **kw)
    ref = stock_log_probs(ref_in[0], ref_in[1], t, bias(ref_in), **kw)
    for name, f, s, r in zip(("log_probs", "entropy"), (lp, ent), stock, ref, strict=True):
        assert f.shape == t.shape
        # each value is a difference of numbers as large as the logsumexp: known to a rounding of that size
        assert_parity(f, s, r, name, floor=loss_floor(f, r))
    g = [torch.randn(t.shape, generator=torch.Generator().manual_seed(i)).to(t.device) for i in (1, 2)]
    torch.autograd.backward((lp, ent), [v.to(lp.dtype) for v in g])
    torch.autograd.backward(stock, [v.to(stock[0].dtype) for v in g])
    torch.autograd.backward(ref, [v.double() for v in g])
    for name, f, s, r in zip(("input", "linear_weight", "linear_bias"), fused_in, stock_in, ref_in, strict=False):
        assert f.grad.dtype == f.dtype
        assert_parity(f.grad, s.grad, r.grad, f"grad {name}")


# ----------------------------------------------------------------------------- values and gradients


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("transform", [{}, {"temperature": 0.7}, {"temperature": 1.3, "logit_scale": 0.8},
                                       {"softcap": 2.5, "temperature": 0.9}])
def test_parity(backend, bias, transform):
    x, w, b, t = _problem(bias=bias)
    with fl.use_backend(backend):
        _check(x, w, b, t, chunk_size=8, **transform)


@pytest.mark.parametrize("backend", BACKENDS)
def test_float64_is_exact(backend):
    """fp64 runs the PyTorch rows on either backend; the math is the written-out formula's to rounding."""
    x, w, b, t = _problem(dtype=torch.float64, bias=True)
    with fl.use_backend(backend):
        lp, ent = fl.linear_log_probs(x, w, t, linear_bias=b, return_entropy=True, temperature=0.6, softcap=3.0)
    ref_lp, ref_ent = stock_log_probs(x, w, t, b, temperature=0.6, softcap=3.0)
    torch.testing.assert_close(lp, ref_lp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, ref_ent, rtol=0, atol=1e-12)


@pytest.mark.parametrize("backend", BACKENDS)
def test_large_logits_keep_fp32_precision(backend):
    """Logits near 1e4: the logsumexp is kept as (max, log sum), so log p keeps fp32's precision relative to
    itself, not to the logits."""
    x, w, _, t = _problem(vocab=64, ignore_every=0)
    w = w * 2000
    with fl.use_backend(backend):
        lp = fl.linear_log_probs(x, w, t)
    ref, _ = stock_log_probs(x.double(), w.double(), t)
    stock, _ = stock_log_probs(x, w, t)
    assert_parity(lp, stock, ref, "log_probs")


@pytest.mark.parametrize("backend", BACKENDS)
def test_chunk_size_does_not_change_the_result(backend):
    x, w, b, t = (v.requires_grad_() if v is not None and v.is_floating_point() else v
                  for v in _problem(bias=True))
    results = []
    with fl.use_backend(backend):
        for chunk in (1, 5, 39, None):
            lp, ent = fl.linear_log_probs(x, w, t, linear_bias=b, return_entropy=True, chunk_size=chunk)
            grads = torch.autograd.grad((lp * 1.5 + ent).sum(), (x, w, b))
            results.append((lp, ent, *grads))
    for other in results[1:]:
        for a, c in zip(results[0], other, strict=True):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_either_output_alone(backend):
    """Backward through one output equals backward through both with a zero gradient for the other, and an entropy
    that is only returned (never used) changes nothing."""
    x, w, _, t = (v.requires_grad_() if v is not None and v.is_floating_point() else v for v in _problem())
    with fl.use_backend(backend):
        lp, ent = fl.linear_log_probs(x, w, t, return_entropy=True)
        only_lp = torch.autograd.grad(lp.sum(), (x, w), retain_graph=True)
        only_ent = torch.autograd.grad(ent.sum(), (x, w), retain_graph=True)
        both = torch.autograd.grad((lp, ent), (x, w), (torch.ones_like(lp), torch.zeros_like(ent)))
        plain = torch.autograd.grad(fl.linear_log_probs(x, w, t).sum(), (x, w))
    ref_lp, ref_ent = stock_log_probs(x, w, t)
    expected_ent = torch.autograd.grad(ref_ent.sum(), (x, w))
    for a, c, d in zip(only_lp, both, plain, strict=True):
        torch.testing.assert_close(a, c)
        torch.testing.assert_close(a, d)
    for a, e in zip(only_ent, expected_ent, strict=True):
        torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_every_target_ignored_and_empty(backend):
    x, w, _, t = _problem()
    x.requires_grad_()
    t = torch.full_like(t, -7)
    with fl.use_backend(backend):
        lp, ent = fl.linear_log_probs(x, w, t, ignore_index=-7, return_entropy=True)
        assert not lp.any() and not ent.any()
        (gx,) = torch.autograd.grad((lp + ent).sum(), x)
        assert not gx.any()
        empty = fl.linear_log_probs(torch.randn(0, 24), w, torch.zeros(0, dtype=torch.long))
    assert empty.shape == (0,)


def test_statistics_equal_trls_chunked_log_prob_function():
    """The logged statistics follow TRL's definitions: its own chunked function (torch rows on CPU) is the
    reference."""
    kernels = pytest.importorskip("trl.kernels")
    x, w, b, t = _problem(shape=(40,), bias=True, ignore_every=0)
    t[::3] = w.mul(x[:, None, :]).sum(-1).argmax(-1)[::3]  # some targets are the argmax: is_top1 True there
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    theirs = kernels.ChunkedLogProbFunction.apply(x, w, b, t, 0.8, 32, 4.0, 1.2, outputs)
    for backend in BACKENDS:
        with fl.use_backend(backend):
            ours = fl.functional.linear_log_prob_statistics(x, w, t, linear_bias=b, temperature=0.8, softcap=4.0,
                                                            logit_scale=1.2, outputs=outputs)
        for name, a, c in zip(outputs, ours, theirs, strict=True):
            if name == "is_top1":
                assert a.dtype == torch.bool and torch.equal(a, c) and a.any(), name
            else:
                torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, msg=name)
    lp, *rest = fl.functional.linear_log_prob_statistics(x, w, t)
    assert rest == [None] * 4


@pytest.mark.parametrize("backend", BACKENDS)
def test_leading_dims_and_int32_targets(backend):
    x, w, _, t = _problem(shape=(2, 3, 5))
    with fl.use_backend(backend):
        lp = fl.linear_log_probs(x, w, t.int())
        flat = fl.linear_log_probs(x.reshape(30, -1), w, t.reshape(30))
    assert lp.shape == (2, 3, 5)
    torch.testing.assert_close(lp.reshape(30), flat)


def test_autocast_cpu_bf16():
    """Under autocast the products run in bf16 (as F.linear's), the rows in fp32."""
    x, w, _, t = _problem()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        lp = fl.linear_log_probs(x, w, t)
        stock = F.linear(x, w).float().log_softmax(-1).gather(-1, t.clamp(min=0)[..., None]).squeeze(-1)
    assert lp.dtype == torch.float32
    torch.testing.assert_close(lp, stock.where(t != -100, 0), rtol=2e-2, atol=2e-2)


# ----------------------------------------------------------------------------- registration


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    ops = torch.ops.fusedlayers
    x, w, b, t = _problem(shape=(9,), hidden=8, vocab=13, bias=True, ignore_every=3)
    x, w, b = (v.requires_grad_() for v in (x, w, b))
    f32 = torch.float32
    with fl.use_backend(backend):
        for softcap in (None, 3.0):
            for entropy, stats in ((True, True), (False, False), (True, False)):
                opcheck(ops.linear_log_probs.default, (x, w, t, b, -100, 1.1, softcap, 0.7, 4, f32, entropy, stats))
        opcheck(ops.linear_log_probs.default, (x, w, t, None, -100, 1.0, None, 1.0, 0, torch.bfloat16, True, False))
        _, ent, lse, _ = ops.linear_log_probs(x.detach(), w.detach(), t, b.detach(), -100, 1.0, None, 0.7, 4, f32,
                                              True, False)
        for g, h in ((torch.rand(9), torch.rand(9)), (torch.rand(9), None), (None, torch.rand(9))):
            opcheck(ops.linear_log_probs_backward.default,
                    (g, h, x.detach(), w.detach(), t, b.detach(), lse, ent, -100, 1.0, None, 0.7, 4, f32, True, True,
                     True))


def test_compile_fullgraph_equals_eager():
    torch._dynamo.reset()

    def f(x, w, b, t):
        lp, ent = fl.linear_log_probs(x, w, t, linear_bias=b, return_entropy=True, temperature=0.9, chunk_size=8)
        return (lp * 2).sum() + ent.mean()

    x, w, b, t = _problem(bias=True)
    x, w, b = (v.requires_grad_() for v in (x, w, b))
    loss = torch.compile(f, fullgraph=True)(x, w, b, t)
    grads = torch.autograd.grad(loss, (x, w, b))
    loss2 = f(x, w, b, t)
    grads2 = torch.autograd.grad(loss2, (x, w, b))
    torch.testing.assert_close(loss, loss2)
    for g1, g2 in zip(grads, grads2, strict=True):
        torch.testing.assert_close(g1, g2)


def test_public():
    assert "linear_log_probs" in fl.__all__ and fl.linear_log_probs is fl.functional.linear_log_probs


@pytest.mark.parametrize(
    "kwargs, error, name",
    [
        ({"target": torch.zeros(3, 13)}, TypeError, "target"),
        ({"target": torch.zeros(3, 12, dtype=torch.long)}, ValueError, "target"),
        ({"target": torch.full((3, 13), 101)}, IndexError, "target"),
        ({"linear_weight": torch.randn(101, 23)}, ValueError, "in_features"),
        ({"linear_weight": torch.randn(101)}, ValueError, "linear_weight"),
        ({"linear_bias": torch.randn(100)}, ValueError, "linear_bias"),
        ({"temperature": 0.0}, ValueError, "temperature"),
        ({"softcap": -1.0}, ValueError, "softcap"),
        ({"chunk_size": 0}, ValueError, "chunk_size"),
        ({"linear_weight": torch.randn(101, 24, dtype=torch.float64)}, TypeError, "linear_weight"),
        ({"input": torch.randint(0, 3, (3, 13, 24))}, TypeError, "input"),
    ],
)
def test_bad_input_names_the_argument(kwargs, error, name):
    x, w, _, t = _problem()
    args = {"input": x, "linear_weight": w, "target": t, **kwargs}
    with pytest.raises(error, match=name):
        fl.linear_log_probs(args.pop("input"), args.pop("linear_weight"), args.pop("target"), **args)


# ----------------------------------------------------------------------------- GPU (the `cuda` tests)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("vocab", [77, 32003, 128256])
def test_cuda_parity(dtype, vocab):
    x, w, b, t = _problem(shape=(300,), hidden=64, vocab=vocab, dtype=dtype, bias=True, device="cuda")
    _check(x, w, b, t, chunk_size=128)
    _check(x, w, None, t, temperature=0.7, softcap=30.0, logit_scale=0.5)  # default chunk size


@pytest.mark.cuda
def test_cuda_statistics_equal_the_reference():
    x, w, b, t = _problem(shape=(257,), hidden=64, vocab=32003, bias=True, device="cuda", ignore_every=5)
    outputs = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")
    ours = fl.functional.linear_log_prob_statistics(x, w, t, linear_bias=b, softcap=20.0, outputs=outputs)
    with fl.use_backend("reference"):
        ref = fl.functional.linear_log_prob_statistics(x, w, t, linear_bias=b, softcap=20.0, outputs=outputs)
    for name, a, c in zip(outputs, ours, ref, strict=True):
        if name == "is_top1":
            assert torch.equal(a, c), name
        else:
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, msg=name)


@pytest.mark.cuda
def test_cuda_logits_never_materialised():
    n, h, v = 4096, 256, 32000
    x = torch.randn(n, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = (torch.randn(v, h, device="cuda") / 16).to(torch.bfloat16).requires_grad_()
    t = torch.randint(0, v, (n,), device="cuda")

    def step():
        lp, ent = fl.linear_log_probs(x, w, t, return_entropy=True, chunk_size=512)
        return torch.autograd.grad((lp.sum() + ent.sum()), (x, w))

    step()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    step()
    extra = torch.cuda.max_memory_allocated() - base
    # the chunk + the fp32 grad_W accumulator and its bf16 cast + grad_x (+ N-sized vectors)
    bound = 512 * v * 2 + w.numel() * (4 + 2) + x.numel() * 2
    assert extra <= bound + 8 * 2**20 < n * v * 2, (extra, bound)
