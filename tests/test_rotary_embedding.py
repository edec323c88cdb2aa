"""fl.rotary_embedding: parity with transformers' apply_rotary_pos_emb (outputs and the gradients of q and k, against
float64), the Triton kernel under the interpreter (fp32/fp16; bf16 runs in the cuda tests), layouts (GQA, cos/sin
(T, D) and (B, T, D), non-contiguous q/k), registration (opcheck, compile), gradcheck, errors."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import fusedlayers as fl
from tests.parity import FLOOR, assert_parity

apply_rotary_pos_emb = pytest.importorskip("transformers.models.llama.modeling_llama").apply_rotary_pos_emb

BACKENDS = ["reference", "triton"]


def _cos_sin(B, T, D, dtype, batched=True, device="cpu"):
    """cos/sin as transformers' rotary embedding makes them: angles t * inv_freq, duplicated over the two halves."""
    pos = torch.arange(T, dtype=torch.float64, device=device)[None].expand(B if batched else 1, T)
    pos = pos + torch.arange(B if batched else 1, device=device)[:, None] * 3  # a different offset per sequence
    inv_freq = 1.0 / (10000 ** (torch.arange(0, D, 2, dtype=torch.float64, device=device) / D))
    emb = torch.cat(((pos[..., None] * inv_freq),) * 2, dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    return (cos, sin) if batched else (cos[0], sin[0])


def _qk(B, H, HK, T, D, dtype, transposed=False, device="cpu"):
    if transposed:  # (B, T, H, D) projections viewed as (B, H, T, D)
        q = torch.randn(B, T, H, D, dtype=dtype, device=device).transpose(1, 2)
        k = torch.randn(B, T, HK, D, dtype=dtype, device=device).transpose(1, 2)
    else:
        q = torch.randn(B, H, T, D, dtype=dtype, device=device)
        k = torch.randn(B, HK, T, D, dtype=dtype, device=device)
    return q.requires_grad_(), k.requires_grad_()


def _stock(q, k, cos, sin):
    if cos.dim() == 2:  # (T, D): broadcast over batch and heads
        cos, sin = cos[None], sin[None]
    return apply_rotary_pos_emb(q, k, cos, sin)


def _run(fn, q, k, cos, sin, gq, gk, dtype=None):
    leaves = [t.detach().to(dtype or t.dtype).requires_grad_() for t in (q, k)]
    cs = [t.to(dtype or t.dtype) for t in (cos, sin)]
    oq, ok = fn(*leaves, *cs)
    dq, dk = torch.autograd.grad((oq, ok), leaves, (gq.to(oq.dtype), gk.to(ok.dtype)))
    return [oq, ok, dq, dk]


def check_parity(q, k, cos, sin):
    gq = torch.randn(q.shape, dtype=q.dtype, device=q.device)
    gk = torch.randn(k.shape, dtype=k.dtype, device=k.device)
    fused = _run(fl.rotary_embedding, q, k, cos, sin, gq, gk)
    stock = _run(_stock, q, k, cos, sin, gq, gk)
    ref = _run(_stock, q, k, cos, sin, gq, gk, torch.float64)
    for what, f, s, r in zip(["q_out", "k_out", "grad q", "grad k"], fused, stock, ref, strict=True):
        assert f.dtype == s.dtype, f"{what}: dtype {f.dtype} != stock {s.dtype}"
        assert f.shape == s.shape
        scale = max(1.0, r.abs().max().item()) if f.dtype == torch.float32 else 1.0
        assert_parity(f, s, r, what, floor=FLOOR[f.dtype] * scale)
    return fused


CASES = [  # B, H, HK, T, D, batched cos/sin, transposed q/k
    (2, 4, 2, 5, 64, True, False),
    (1, 3, 3, 7, 80, False, False),
    (2, 4, 1, 3, 128, True, True),
    (3, 2, 2, 1, 6, False, True),
    (2, 6, 2, 9, 2, True, False),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_reference_parity(case, dtype):
    B, H, HK, T, D, batched, transposed = case
    with fl.use_backend("reference"):
        check_parity(*_qk(B, H, HK, T, D, dtype, transposed), *_cos_sin(B, T, D, dtype, batched))


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_parity(case, dtype):
    B, H, HK, T, D, batched, transposed = case
    with fl.use_backend("triton"):
        check_parity(*_qk(B, H, HK, T, D, dtype, transposed), *_cos_sin(B, T, D, dtype, batched))


@pytest.mark.parametrize("backend", BACKENDS)
def test_layouts_and_broadcast(backend):
    """cos/sin of batch 1 (position_ids of batch 1), fp32 cos/sin with fp16 q/k (fp32 out, as transformers),
    q and k of different layouts, cos/sin non-contiguous, many heads (several head blocks)."""
    B, T, D = 2, 3, 16
    with fl.use_backend(backend):
        q, k = _qk(B, 40, 8, T, D, torch.float32)
        check_parity(q, k, *_cos_sin(1, T, D, torch.float32))
        q, _ = _qk(B, 4, 2, T, D, torch.float16)
        _, k = _qk(B, 4, 2, T, D, torch.float16, transposed=True)
        check_parity(q, k, *_cos_sin(B, T, D, torch.float32))
        cos, sin = (t.transpose(0, 1).contiguous().transpose(0, 1) for t in _cos_sin(B, T, D, torch.float32))
        assert not cos.is_contiguous()
        out = check_parity(*_qk(B, 4, 2, T, D, torch.float32), cos, sin)
        q, k = _qk(B, 2, 2, 4, D, torch.float32)  # every other element of the head dim
        q2 = torch.randn(B, 2, 4, 2 * D).requires_grad_()
        check_parity(q2[..., ::2], k, *_cos_sin(B, 4, D, torch.float32))
        assert out[0].dtype == torch.float32


@pytest.mark.parametrize("backend", BACKENDS)
def test_outputs_keep_the_input_layout(backend):
    q, k = _qk(2, 4, 2, 5, 8, torch.float32, transposed=True)
    with fl.use_backend(backend):
        oq, ok = fl.rotary_embedding(q, k, *_cos_sin(2, 5, 8, torch.float32))
    assert oq.stride() == q.stride() and ok.stride() == k.stride()


@pytest.mark.parametrize("backend", BACKENDS)
def test_leaves_inputs_unchanged(backend):
    q, k = _qk(2, 4, 2, 5, 8, torch.float32, transposed=True)
    cos, sin = _cos_sin(2, 5, 8, torch.float32)
    saved = [t.detach().clone() for t in (q, k, cos, sin)]
    with fl.use_backend(backend):
        oq, ok = fl.rotary_embedding(q, k, cos, sin)
        g = torch.randn_like(oq)
        g_saved = g.clone()
        torch.autograd.grad((oq, ok), (q, k), (g, torch.ones_like(ok)))
    for a, b in zip((q, k, cos, sin, g), (*saved, g_saved), strict=True):
        assert torch.equal(a, b)
    assert oq.data_ptr() != q.data_ptr() and ok.data_ptr() != k.data_ptr()


def test_one_launch_for_q_and_k(monkeypatch):
    from fusedlayers.kernels import rotary_embedding as kernels
    calls = []
    real = kernels.launch
    monkeypatch.setattr(kernels, "launch", lambda *a, **kw: (calls.append(kw["BACKWARD"]), real(*a, **kw)))
    q, k = _qk(2, 4, 2, 5, 8, torch.float32)
    with fl.use_backend("triton"):
        oq, ok = fl.rotary_embedding(q, k, *_cos_sin(2, 5, 8, torch.float32))
        torch.autograd.grad((oq.sum() + ok.sum()), (q, k))
    assert calls == [False, True]


def test_triton_several_head_blocks(monkeypatch):
    """Small head blocks: several of q and of k (sized apart), the last of each partly masked; programs with a q block
    and no k block, and the other way round."""
    from fusedlayers.kernels import rotary_embedding as kernels
    monkeypatch.setattr(kernels, "MAX_BLOCK_ELEMENTS", 16)  # D=16: 8 pairs -> at most 2 heads per program
    assert kernels._block_h(8, 5) == 2 and kernels._block_h(8, 1) == 1
    with fl.use_backend("triton"):
        check_parity(*_qk(2, 5, 3, 3, 16, torch.float32, transposed=True), *_cos_sin(2, 3, 16, torch.float32))
        check_parity(*_qk(1, 1, 4, 2, 16, torch.float16), *_cos_sin(1, 2, 16, torch.float16, batched=False))
    monkeypatch.setattr(kernels, "MAX_BLOCK_ELEMENTS", 64)  # 8 heads of q per program, k (3 heads) in blocks of 4
    with fl.use_backend("triton"):
        check_parity(*_qk(2, 12, 3, 3, 16, torch.float32, transposed=True), *_cos_sin(2, 3, 16, torch.float32))


def test_float64_and_empty_run_the_reference():
    with fl.use_backend("triton"):
        check_parity(*_qk(2, 3, 1, 4, 8, torch.float64), *_cos_sin(2, 4, 8, torch.float64))
        q, k = _qk(2, 3, 1, 0, 8, torch.float32)
        oq, ok = fl.rotary_embedding(q, k, *_cos_sin(2, 0, 8, torch.float32))
        assert oq.shape == q.shape and ok.shape == k.shape


def test_gradcheck():
    q, k = _qk(2, 3, 1, 4, 6, torch.float64, transposed=True)
    cos, sin = _cos_sin(2, 4, 6, torch.float64)
    assert torch.autograd.gradcheck(lambda a, b: fl.rotary_embedding(a, b, cos, sin), (q, k))
    assert torch.autograd.gradcheck(lambda a, b: fl.rotary_embedding(a, b, cos[0], sin[0]), (q, k))
    assert torch.autograd.gradgradcheck(lambda a, b: fl.rotary_embedding(a, b, cos, sin), (q, k))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    ops = torch.ops.fusedlayers
    q, k = _qk(2, 4, 2, 5, 8, torch.float32)
    qt, kt = _qk(2, 4, 2, 5, 8, torch.float16, transposed=True)
    cos, sin = _cos_sin(2, 5, 8, torch.float32)
    cos2, sin2 = _cos_sin(2, 5, 8, torch.float32, batched=False)
    g, gk = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8).transpose(2, 3).contiguous().transpose(2, 3)
    samples = [
        (ops.rotary_embedding.default, (q, k, cos, sin)),
        (ops.rotary_embedding.default, (qt, kt, cos2.half(), sin2.half())),
        (ops.rotary_embedding.default, (qt, kt, cos, sin)),
        (ops.rotary_embedding_backward.default, (g, gk, cos, sin, torch.float32, torch.float32)),
        (ops.rotary_embedding_backward.default, (g, gk, cos2, sin2, torch.float16, torch.float16)),
    ]
    with fl.use_backend(backend):
        for op, args in samples:
            opcheck(op, args)


@pytest.mark.parametrize("backend", BACKENDS)
def test_compile_fullgraph_forward_backward(backend):
    torch._dynamo.reset()

    def f(q, k, cos, sin):
        oq, ok = fl.rotary_embedding(q * 2.0, k, cos, sin)
        return (oq.sum(-1, keepdim=True) * oq).sum() + (ok * ok).sum()

    q, k = _qk(2, 4, 2, 5, 8, torch.float32, transposed=True)
    cos, sin = _cos_sin(2, 5, 8, torch.float32)
    with fl.use_backend(backend):
        loss = torch.compile(f, fullgraph=True)(q, k, cos, sin)
        grads = torch.autograd.grad(loss, (q, k))
        expected_loss = f(q, k, cos, sin)
        expected = torch.autograd.grad(expected_loss, (q, k))
    torch.testing.assert_close(loss, expected_loss)
    for a, b in zip(grads, expected, strict=True):
        torch.testing.assert_close(a, b)


def _bad(**over):
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    args = {"q": q, "k": k, "cos": cos, "sin": sin, **over}
    return lambda: fl.rotary_embedding(args["q"], args["k"], args["cos"], args["sin"])


@pytest.mark.parametrize(
    "call, error, match",
    [
        (_bad(q=torch.randn(2, 4, 5, 7), k=torch.randn(2, 2, 5, 7), cos=torch.randn(5, 7), sin=torch.randn(5, 7)),
         ValueError, "even"),
        (_bad(q=torch.randn(4, 5, 8)), ValueError, "4-D"),
        (_bad(k=torch.randn(2, 2, 6, 8)), ValueError, "k of shape"),
        (_bad(k=torch.randn(2, 2, 5, 8, dtype=torch.float64)), TypeError, "dtype"),
        (_bad(q=torch.ones(2, 4, 5, 8, dtype=torch.int64)), TypeError, "q"),
        (_bad(cos=torch.randn(5, 8)), ValueError, "same shape"),
        (_bad(cos=torch.randn(3, 5, 8), sin=torch.randn(3, 5, 8)), ValueError, "cos/sin must have shape"),
        (_bad(cos=torch.randn(5, 4), sin=torch.randn(5, 4)), ValueError, "cos/sin must have shape"),
        (_bad(cos=torch.randn(2, 5, 8, requires_grad=True)), ValueError, "require grad"),
        (_bad(cos=torch.randn(1, 2, 5, 8), sin=torch.randn(1, 2, 5, 8)), ValueError, "cos/sin must have shape"),
        (_bad(cos=torch.randn(8), sin=torch.randn(8)), ValueError, "cos/sin must have shape"),
        (_bad(k=torch.randn(2, 2, 5, 8, device="meta")), ValueError, "k is on"),
        (_bad(sin=torch.randn(2, 5, 8, device="meta")), ValueError, "sin is on"),
        (_bad(sin="sin"), TypeError, "sin"),
    ],
)
def test_bad_input_errors(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ----------------------------------------------------------------------------- GPU (the `cuda` tests)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", [(2, 32, 8, 257, 128, True, True), (1, 12, 12, 1000, 64, False, False),
                                  (4, 16, 2, 33, 80, True, False)])
def test_cuda_parity(case, dtype):
    B, H, HK, T, D, batched, transposed = case
    check_parity(*_qk(B, H, HK, T, D, dtype, transposed, "cuda"), *_cos_sin(B, T, D, dtype, batched, "cuda"))


@pytest.mark.cuda
def test_cuda_compile_and_opcheck():
    q, k = _qk(2, 8, 2, 64, 128, torch.bfloat16, True, "cuda")
    cos, sin = _cos_sin(1, 64, 128, torch.bfloat16, device="cuda")
    f = lambda a, b: sum(o.float().square().sum() for o in fl.rotary_embedding(a, b, cos, sin))
    g1 = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k), (q, k))
    g2 = torch.autograd.grad(f(q, k), (q, k))
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b)
    opcheck(torch.ops.fusedlayers.rotary_embedding.default, (q, k, cos, sin))


def test_module():
    q, k = _qk(2, 4, 2, 5, 8, torch.float32)
    cos, sin = _cos_sin(1, 5, 8, torch.float32)
    module = fl.ApplyRotaryEmbedding()
    assert not list(module.parameters())
    for a, b in zip(module(q, k, cos, sin), apply_rotary_pos_emb(q, k, cos, sin), strict=True):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("backend", BACKENDS)
def test_eager_fast_path_equals_the_registered_op(backend, monkeypatch):
    from fusedlayers.ops import _eager
    q, k = _qk(2, 4, 2, 5, 8, torch.float16, transposed=True)
    cos, sin = _cos_sin(1, 5, 8, torch.float32)
    results = []
    for enabled in (True, False):
        monkeypatch.setattr(_eager, "enabled", enabled)
        leaves = [t.detach().clone().requires_grad_() for t in (q, k)]
        with fl.use_backend(backend):
            oq, ok = fl.rotary_embedding(*leaves, cos, sin)
            assert (type(oq.grad_fn).__name__ == "_EagerOpBackward") == enabled
            (oq.sum() * 2 + (ok * ok).sum()).backward()
        results.append([oq, ok, *(t.grad for t in leaves)])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
