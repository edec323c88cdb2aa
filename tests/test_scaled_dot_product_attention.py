"""fl.scaled_dot_product_attention against F.scaled_dot_product_attention (parity with a float64 reference),
its ops (opcheck, fake, autograd, torch.compile), dropout, the Triton kernels under the interpreter, and
(cuda-marked) the compiled kernels on a GPU."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import fusedlayers as fl
from fusedlayers.ops import scaled_dot_product_attention as attn_ops
from tests.conftest import HAS_CUDA, INTERPRETER
from tests.parity import assert_parity

OPS = torch.ops.fusedlayers


# ----------------------------------------------------------------------------- helpers


def make_inputs(B, H, H_kv, L, S, D, DV, dtype, device="cpu", mask=None, fully_masked_rows=(), mask_grad=False):
    """Random q, k, v (values in a range where fp16/bf16 behave) and a mask of kind ``mask``:
    None, "bool" (L, S), "bool4" (B, 1, L, S), "float" (B, H, L, S), "float_bcast" (1, H, 1, S)."""
    q = torch.randn(B, H, L, D, dtype=dtype, device=device)
    k = torch.randn(B, H_kv, S, D, dtype=dtype, device=device)
    v = torch.randn(B, H_kv, S, DV, dtype=dtype, device=device)
    m = None
    if mask in ("bool", "bool4"):
        shape = (L, S) if mask == "bool" else (B, 1, L, S)
        m = torch.rand(shape, device=device) > 0.3
        for i in fully_masked_rows:
            m[..., i, :] = False
    elif mask in ("float", "float_bcast"):
        shape = (B, H, L, S) if mask == "float" else (1, H, 1, S)
        m = torch.randn(shape, dtype=dtype, device=device)
        m = m.masked_fill(torch.rand(shape, device=device) < 0.2, float("-inf"))
        for i in fully_masked_rows:
            if mask == "float":
                m[..., i, :] = float("-inf")
        m.requires_grad_(mask_grad)
    return q, k, v, m


def stock_sdpa(q, k, v, mask, is_causal, scale=None, enable_gqa=False, dropout_p=0.0):
    """F.scaled_dot_product_attention; a causal mask and attn_mask together become one mask (torch
    refuses both)."""
    if is_causal and mask is not None:
        keep = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
        mask = mask & keep if mask.dtype == torch.bool else mask.masked_fill(~keep, float("-inf"))
        is_causal = False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


def run_with_grads(fn, q, k, v, mask, grad, backend="auto"):
    """fn(q, k, v, mask) and the gradients of <out, grad> for q, k, v (and a float mask that requires grad),
    forward and backward on ``backend``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    m = mask
    if mask is not None and mask.requires_grad:
        m = mask.detach().clone().requires_grad_()
    with fl.use_backend(backend):
        out = fn(*leaves, m)
        out.backward(grad)
    grads = [t.grad for t in leaves]
    if m is not None and m.requires_grad:
        grads.append(m.grad)
    return out.detach(), grads


def check_parity(q, k, v, mask, is_causal, scale=None, backend="auto", floor=None, grad_floor=None):
    """Output and every gradient of fl vs stock, both against float64 stock on the same inputs."""
    gqa = q.shape[1] != k.shape[1]
    grad = torch.randn(*q.shape[:-1], v.shape[-1], dtype=q.dtype, device=q.device)

    def fused(q_, k_, v_, m_):
        return fl.scaled_dot_product_attention(q_, k_, v_, attn_mask=m_, is_causal=is_causal, scale=scale,
                                               enable_gqa=gqa)

    def stock(q_, k_, v_, m_):
        return stock_sdpa(q_, k_, v_, m_, is_causal, scale=scale, enable_gqa=gqa)

    def up(t):
        if t is None or t.dtype == torch.bool:
            return t
        return t.detach().double().requires_grad_(t.requires_grad)

    out_f, grads_f = run_with_grads(fused, q, k, v, mask, grad, backend)
    out_s, grads_s = run_with_grads(stock, q, k, v, mask, grad)
    out_r, grads_r = run_with_grads(stock, up(q), up(k), up(v), up(mask), grad.double())
    assert not out_f.isnan().any()
    assert_parity(out_f, out_s, out_r, "output", floor=floor)
    assert len(grads_f) == len(grads_s) == len(grads_r)
    for name, gf, gs, gr in zip(("dq", "dk", "dv", "dmask")[:len(grads_f)], grads_f, grads_s, grads_r, strict=True):
        assert gf is not None, name
        assert not gf.isnan().any(), name
        assert_parity(gf, gs, gr, name, floor=grad_floor if grad_floor is not None else floor)
    return out_f, grads_f


# (B, H, H_kv, L, S, D, DV, causal, mask, fully-masked rows)
CASES = [
    (2, 4, 4, 64, 64, 64, 64, False, None, ()),
    (2, 4, 4, 37, 53, 32, 32, True, None, ()),  # odd lengths, L < S
    (1, 3, 3, 61, 29, 16, 16, True, None, ()),  # L > S: late rows see every key
    (2, 6, 2, 45, 70, 64, 64, False, None, ()),  # GQA 3:1
    (1, 8, 1, 33, 33, 32, 48, True, None, ()),  # multi-query, Dv != D
    (2, 2, 2, 50, 77, 80, 80, False, "bool", (0, 7)),  # bool (L, S) mask with fully-masked rows
    (2, 4, 2, 41, 39, 96, 96, True, "bool4", (3,)),  # bool (B, 1, L, S) + causal + GQA
    (1, 2, 2, 47, 58, 128, 128, False, "float", (5,)),  # float mask with -inf rows
    (2, 4, 4, 30, 66, 32, 32, True, "float_bcast", ()),  # float mask broadcast (1, H, 1, S) + causal
    (1, 2, 2, 20, 24, 256, 256, False, None, ()),
]


def case_id(c):
    B, H, H_kv, L, S, D, DV, causal, mask, rows = c
    return f"B{B}H{H}kv{H_kv}L{L}S{S}D{D}Dv{DV}{'-causal' if causal else ''}{'-' + mask if mask else ''}"


# ----------------------------------------------------------------------------- parity (reference path)


@pytest.mark.parametrize("case", CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_parity_reference(case, dtype):
    B, H, H_kv, L, S, D, DV, causal, mask, rows = case
    q, k, v, m = make_inputs(B, H, H_kv, L, S, D, DV, dtype, mask=mask, fully_masked_rows=rows)
    out, grads = check_parity(q, k, v, m, causal, backend="reference")
    for i in rows:  # fully-masked rows: zeros, and zero gradient for their query
        assert out[..., i, :].eq(0).all() and grads[0][..., i, :].eq(0).all()


def test_parity_fp16_and_custom_scale():
    q, k, v, m = make_inputs(2, 4, 2, 33, 47, 64, 64, torch.float16, mask="bool", fully_masked_rows=(2,))
    check_parity(q, k, v, m, True, scale=0.3, backend="reference")
    q, k, v, m = make_inputs(1, 2, 2, 19, 23, 32, 32, torch.float32)
    check_parity(q, k, v, m, False, scale=-1.7, backend="reference")  # a negative scale flips the max


def test_float_mask_gradient():
    for kind in ("float", "float_bcast"):
        q, k, v, m = make_inputs(2, 4, 2, 21, 34, 32, 32, torch.float32, mask=kind, mask_grad=True)
        _, grads = check_parity(q, k, v, m, kind == "float_bcast")
        assert grads[3].shape == m.shape


def test_non_contiguous_3d_and_5d_inputs():
    # (B, L, H, D) storage seen as (B, H, L, D)
    q = torch.randn(2, 40, 4, 32).transpose(1, 2)
    k = torch.randn(2, 52, 2, 32).transpose(1, 2)
    v = torch.randn(2, 32, 52, 2).permute(0, 3, 2, 1)
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    check_parity(q, k, v, None, True)
    q3, k3, v3 = torch.randn(3, 17, 16), torch.randn(3, 25, 16), torch.randn(3, 25, 16)
    torch.testing.assert_close(fl.scaled_dot_product_attention(q3, k3, v3, is_causal=True),
                               F.scaled_dot_product_attention(q3, k3, v3, is_causal=True))
    q5, k5, v5 = torch.randn(2, 3, 2, 9, 16), torch.randn(2, 3, 2, 11, 16), torch.randn(2, 3, 2, 11, 16)
    mask = torch.rand(2, 3, 1, 9, 11) > 0.4
    torch.testing.assert_close(fl.scaled_dot_product_attention(q5, k5, v5, attn_mask=mask),
                               F.scaled_dot_product_attention(q5, k5, v5, attn_mask=mask))


def test_empty_sizes():
    q, k, v = torch.randn(2, 2, 0, 16), torch.randn(2, 2, 5, 16), torch.randn(2, 2, 5, 16)
    assert fl.scaled_dot_product_attention(q, k, v).shape == (2, 2, 0, 16)
    q, k, v = (torch.randn(1, 2, 4, 16, requires_grad=True), torch.randn(1, 2, 0, 16, requires_grad=True),
               torch.randn(1, 2, 0, 16, requires_grad=True))
    out = fl.scaled_dot_product_attention(q, k, v)  # no keys: every row fully masked -> zeros
    assert out.shape == (1, 2, 4, 16) and out.eq(0).all()
    out.sum().backward()
    assert q.grad.eq(0).all()


# ----------------------------------------------------------------------------- the algorithm itself


def test_reference_is_blockwise_and_saves_only_lse():
    """The reference walks S in blocks (its result does not depend on the block size) and the forward
    op returns the per-row logsumexp, which is what the backward consumes."""
    q, k, v, m = make_inputs(2, 4, 2, 50, 70, 32, 32, torch.float64, mask="bool", fully_masked_rows=(1,))
    out_a, lse_a = attn_ops.attention_forward_reference(q, k, v, m.expand(2, 4, 50, 70), None, 0.0, True, 0.2,
                                                        block_n=16)
    out_b, lse_b = attn_ops.attention_forward_reference(q, k, v, m.expand(2, 4, 50, 70), None, 0.0, True, 0.2,
                                                        block_n=128)
    torch.testing.assert_close(out_a, out_b)
    torch.testing.assert_close(lse_a, lse_b)
    # lse is the natural-log logsumexp of the scaled masked scores; +inf on the fully-masked row
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) * 0.2
    keep = m & torch.ones(50, 70, dtype=torch.bool).tril()
    s = s.masked_fill(~keep, float("-inf"))
    expected = torch.logsumexp(s, -1)
    expected[:, :, 1] = float("inf")
    torch.testing.assert_close(lse_a, expected)
    _, lse_op = OPS.scaled_dot_product_attention(q, k, v, m, None, 0.0, True, 0.2)
    torch.testing.assert_close(lse_op, expected)


def test_only_needed_gradients():
    q, k, v, _ = make_inputs(1, 4, 2, 20, 30, 32, 32, torch.float32)
    out, lse = OPS.scaled_dot_product_attention(q, k, v, None, None, 0.0, True, 0.25)
    grad = torch.randn_like(out)
    full = OPS.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, None, None, 0.0, True, 0.25,
                                                     True, True, True, False)
    only_dk = OPS.scaled_dot_product_attention_backward(grad, q, k, v, out, lse, None, None, 0.0, True, 0.25,
                                                        False, True, False, False)
    assert only_dk[0].numel() == 0 and only_dk[2].numel() == 0 and only_dk[3].numel() == 0
    torch.testing.assert_close(only_dk[1], full[1])
    # through autograd: a leaf that does not require grad gets none
    qq, kk = q.clone().requires_grad_(), k.clone().requires_grad_()
    fl.scaled_dot_product_attention(qq, kk, v, is_causal=True, enable_gqa=True).sum().backward()
    assert qq.grad is not None and kk.grad is not None and v.grad is None


def test_backward_deterministic():
    q, k, v, m = make_inputs(2, 4, 2, 40, 50, 32, 32, torch.float32, mask="float")
    grad = torch.randn(2, 4, 40, 32)
    f = lambda q_, k_, v_, m_: fl.scaled_dot_product_attention(q_, k_, v_, attn_mask=m_, enable_gqa=True)
    _, g1 = run_with_grads(f, q, k, v, m, grad)
    _, g2 = run_with_grads(f, q, k, v, m, grad)
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- dropout


def test_philox_matches_known_answer():
    """Philox-4x32 (7 rounds here): check the first word against an independent pure-Python Philox."""

    def philox_py(c, key, rounds):
        c, key = list(c), list(key)
        for _ in range(rounds):
            p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
            c = [(p1 >> 32) ^ c[1] ^ key[0], p1 & 0xFFFFFFFF, (p0 >> 32) ^ c[3] ^ key[1], p0 & 0xFFFFFFFF]
            key = [(key[0] + 0x9E3779B9) & 0xFFFFFFFF, (key[1] + 0xBB67AE85) & 0xFFFFFFFF]
        return c

    rows = torch.tensor([0, 5, 2**20, 3]).view(-1, 1)
    cols = torch.tensor([0, 1, 77, 2**31 - 1]).view(1, -1)
    bh = torch.tensor([[9]])
    got = attn_ops.philox_keep(123456789, 987654321, rows, cols, bh, 0)  # threshold 0: all kept
    assert got.all()
    for i, r in enumerate(rows.flatten().tolist()):
        for j, c in enumerate(cols.flatten().tolist()):
            word = philox_py([c, r, 9, 0], [123456789, 987654321], 7)[0]
            kept = attn_ops.philox_keep(123456789, 987654321, torch.tensor([[r]]), torch.tensor([[c]]), bh,
                                        word >> 1)
            dropped = attn_ops.philox_keep(123456789, 987654321, torch.tensor([[r]]), torch.tensor([[c]]), bh,
                                           (word >> 1) + 1)
            assert kept.item() and not dropped.item(), (i, j)


def _dropout_probe(p, backend="auto", B=2, H=2, L=64, S=128, device="cpu"):
    """Uniform attention (q = 0) over one-hot values: out[i, j] * S * (1 - p) is the keep bit of (i, j)."""
    q = torch.zeros(B, H, L, 16, device=device)
    k = torch.randn(B, H, S, 16, device=device)
    v = torch.eye(S, device=device).expand(B, H, S, S)
    with fl.use_backend(backend):
        out = fl.scaled_dot_product_attention(q, k, v, dropout_p=p)
    return out * S * (1 - p)


@pytest.mark.parametrize("p", [0.1, 0.5])
def test_dropout_statistics(p):
    keep = _dropout_probe(p)
    torch.testing.assert_close(keep, keep.round(), atol=1e-4, rtol=0)  # each entry 0 or 1
    n = keep.numel()
    rate = keep.mean().item()
    assert abs(rate - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n), rate  # keep rate within 5 sigma
    # mean preserved: each row of probabilities still sums to 1 in expectation
    row_sums = keep.sum(-1) / (keep.shape[-1] * (1 - p))
    assert abs(row_sums.mean().item() - 1.0) < 5 * math.sqrt(p / (1 - p) / n)
    # the mask is not constant along rows, columns or heads
    assert keep[0, 0].std(0).mean() > 0.1 and keep[0, 0].std(1).mean() > 0.1
    assert not torch.equal(keep[0, 0], keep[0, 1]) and not torch.equal(keep[0, 0], keep[1, 0])


def test_dropout_seeded_and_regenerated_in_backward():
    q, k, v, _ = make_inputs(2, 4, 2, 30, 45, 32, 32, torch.float64)
    m = torch.randn(2, 4, 30, 45, dtype=torch.float64, requires_grad=True)
    p = 0.25

    def fused(q_, k_, v_, m_, seed=7):
        torch.manual_seed(seed)
        return fl.scaled_dot_product_attention(q_, k_, v_, attn_mask=m_, dropout_p=p, is_causal=True,
                                               enable_gqa=True)

    grad = torch.randn(2, 4, 30, 32, dtype=torch.float64)
    out1, g1 = run_with_grads(fused, q, k, v, m, grad)
    out2, g2 = run_with_grads(fused, q, k, v, m, grad)
    assert torch.equal(out1, out2) and all(torch.equal(a, b) for a, b in zip(g1, g2, strict=True))
    out3 = fused(q, k, v, m.detach(), seed=8)
    assert not torch.equal(out1, out3)
    # the same math written out with the op's keep mask: output and all four gradients agree
    torch.manual_seed(7)
    seed = torch.randint(0, 2**31, (2,), dtype=torch.int64)
    s0, s1 = seed.tolist()
    rows = torch.arange(30).view(1, 1, 30, 1)
    cols = torch.arange(45).view(1, 1, 1, 45)
    bh = (torch.arange(2).view(2, 1, 1, 1) * 4 + torch.arange(4).view(1, 4, 1, 1))
    keep = attn_ops.philox_keep(s0, s1, rows, cols, bh, int(p * 2**31))

    def explicit(q_, k_, v_, m_):
        kk, vv = k_.repeat_interleave(2, 1), v_.repeat_interleave(2, 1)
        s = (q_ @ kk.transpose(-1, -2)) / math.sqrt(32) + m_
        s = s.masked_fill(~torch.ones(30, 45, dtype=torch.bool).tril(), float("-inf"))
        probs = torch.softmax(s, -1).nan_to_num(0.0)
        return (probs * keep / (1 - p)) @ vv

    out_e, g_e = run_with_grads(explicit, q, k, v, m, grad)
    torch.testing.assert_close(out1, out_e)
    for a, b in zip(g1, g_e, strict=True):
        torch.testing.assert_close(a, b)


def test_dropout_one_gives_zeros():
    q, k, v, _ = make_inputs(1, 2, 2, 10, 12, 16, 16, torch.float32)
    q.requires_grad_()
    out = fl.scaled_dot_product_attention(q, k, v, dropout_p=1.0)
    assert out.eq(0).all()
    out.sum().backward()
    assert q.grad.eq(0).all()


def test_gradcheck_float64():
    q, k, v, _ = make_inputs(1, 2, 1, 4, 5, 16, 16, torch.float64)
    m = torch.randn(1, 2, 4, 5, dtype=torch.float64)
    m[0, 1, 2] = float("-inf")  # a fully-masked row
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v, m)]
    f = lambda q_, k_, v_, m_: fl.scaled_dot_product_attention(q_, k_, v_, attn_mask=m_, is_causal=True,
                                                                enable_gqa=True)
    assert torch.autograd.gradcheck(f, inputs)

    def f_drop(q_, k_, v_):
        torch.manual_seed(3)  # the same dropout mask at every evaluation
        return fl.scaled_dot_product_attention(q_, k_, v_, dropout_p=0.3, enable_gqa=True)

    assert torch.autograd.gradcheck(f_drop, inputs[:3])


# ----------------------------------------------------------------------------- registration


def test_opcheck():
    q, k, v, m = make_inputs(2, 4, 2, 13, 21, 16, 32, torch.float32, mask="float")
    seed = torch.tensor([11, 22], dtype=torch.int64)
    for args in ((q, k, v, None, None, 0.0, False, 0.25), (q, k, v, m, seed, 0.2, True, 0.25),
                 (q, k, v, m > 0, None, 0.0, True, 0.5)):
        leaves = [t.detach().clone().requires_grad_() if i < 3 else t for i, t in enumerate(args)]
        torch.library.opcheck(OPS.scaled_dot_product_attention.default, tuple(leaves))
    out, lse = OPS.scaled_dot_product_attention(q, k, v, m, seed, 0.2, True, 0.25)
    grad = torch.randn_like(out)
    for needs in ((True, True, True, True), (True, False, False, False), (False, True, True, False)):
        torch.library.opcheck(OPS.scaled_dot_product_attention_backward.default,
                              (grad, q, k, v, out, lse, m, seed, 0.2, True, 0.25, *needs))


@pytest.mark.parametrize("dropout_p", [0.0, 0.2])
def test_torch_compile_fullgraph(dropout_p):
    """fullgraph=True: Dynamo traces the function with no graph break; AOTAutograd traces the forward op
    and the backward op into the joint graph."""
    q, k, v, m = make_inputs(2, 4, 2, 24, 40, 32, 32, torch.float32, mask="bool")

    def f(q_, k_, v_, m_):
        out = fl.scaled_dot_product_attention(q_, k_, v_, attn_mask=m_, is_causal=True, enable_gqa=True,
                                              dropout_p=dropout_p)
        return out.square().sum()

    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves_e = [t.clone().requires_grad_() for t in (q, k, v)]
    leaves_c = [t.clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(5)
    loss_c = compiled(*leaves_c, m)
    loss_c.backward()
    torch.manual_seed(5)
    loss_e = f(*leaves_e, m)
    loss_e.backward()
    torch.testing.assert_close(loss_c, loss_e)
    for a, b in zip(leaves_c, leaves_e, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.slow
def test_torch_compile_inductor_fullgraph():
    q, k, v, _ = make_inputs(1, 2, 2, 16, 16, 16, 16, torch.float32)

    def f(q_, k_, v_):
        return fl.scaled_dot_product_attention(q_, k_, v_, is_causal=True) * 2.0

    compiled = torch.compile(f, fullgraph=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = compiled(*leaves)
    out.sum().backward()
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    f(*ref).sum().backward()
    torch.testing.assert_close(out, f(q, k, v))
    for a, b in zip(leaves, ref, strict=True):
        torch.testing.assert_close(a.grad, b.grad)


def test_autocast_cpu_bf16():
    q, k, v, m = make_inputs(2, 2, 2, 20, 30, 32, 32, torch.float32, mask="float")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = fl.scaled_dot_product_attention(*leaves, attn_mask=m)
        stock = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert out.dtype == stock.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=m.double())
    assert_parity(out, stock, ref)
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.float32 for t in leaves)


# ----------------------------------------------------------------------------- input validation


def test_errors_name_the_argument():
    q, k, v = torch.randn(1, 4, 8, 32), torch.randn(1, 2, 8, 32), torch.randn(1, 2, 8, 32)
    sdpa = fl.scaled_dot_product_attention
    with pytest.raises(ValueError, match="enable_gqa"):
        sdpa(q, k, v)
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        sdpa(q, torch.randn(1, 3, 8, 32), torch.randn(1, 3, 8, 32), enable_gqa=True)
    q2 = torch.randn(1, 2, 8, 32)
    with pytest.raises(ValueError, match="query has head dim 20"):
        sdpa(torch.randn(1, 2, 8, 20), torch.randn(1, 2, 8, 20), v)
    with pytest.raises(ValueError, match="query has head dim 512"):
        sdpa(torch.randn(1, 2, 8, 512), torch.randn(1, 2, 8, 512), v)
    with pytest.raises(ValueError, match="value has head dim 8"):
        sdpa(q2, k, torch.randn(1, 2, 8, 8))
    with pytest.raises(ValueError, match="key head dim"):
        sdpa(q2, torch.randn(1, 2, 8, 16), v)
    with pytest.raises(TypeError, match="same dtype"):
        sdpa(q2, k.half(), v)
    with pytest.raises(TypeError, match="query must be"):
        sdpa(q2.long(), k, v)
    with pytest.raises(ValueError, match="attn_mask of shape"):
        sdpa(q2, k, v, attn_mask=torch.ones(8, 9, dtype=torch.bool))
    with pytest.raises(TypeError, match="attn_mask must be bool"):
        sdpa(q2, k, v, attn_mask=torch.ones(8, 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="dropout_p"):
        sdpa(q2, k, v, dropout_p=1.5)
    with pytest.raises(TypeError, match="is_causal"):
        sdpa(q2, k, v, is_causal=1)
    with pytest.raises(TypeError, match="scale"):
        sdpa(q2, k, v, scale="big")
    with pytest.raises(ValueError, match="value"):
        sdpa(q2, k, torch.randn(1, 2, 9, 32))
    with pytest.raises(ValueError, match="at least 3"):
        sdpa(torch.randn(8, 32), torch.randn(8, 32), torch.randn(8, 32))


# ----------------------------------------------------------------------------- Triton kernels (interpreter)

# Small shapes; the interpreter config uses 16/32-row tiles so these cross several blocks in L and S.
KERNEL_CASES = [
    (1, 2, 2, 37, 53, 32, 32, False, None, ()),
    (1, 2, 2, 53, 37, 16, 16, True, None, ()),
    (1, 4, 2, 40, 33, 32, 48, True, "bool", (0, 9)),  # GQA, Dv != D, fully-masked rows
    (1, 2, 1, 29, 45, 80, 80, False, "float", (4,)),  # D = 80 padded to 128, float mask with an -inf row
    (2, 2, 2, 33, 31, 16, 16, True, "float_bcast", ()),
]


@pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (CPU runs)")
@pytest.mark.parametrize("case", KERNEL_CASES, ids=case_id)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernels_interpreter(case, dtype):
    B, H, H_kv, L, S, D, DV, causal, mask, rows = case
    q, k, v, m = make_inputs(B, H, H_kv, L, S, D, DV, dtype, mask=mask, fully_masked_rows=rows,
                             mask_grad=mask is not None and mask.startswith("float"))
    check_parity(q, k, v, m, causal, backend="triton")


@pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (CPU runs)")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_kernels_negative_scale(dtype):
    """A negative scale turns the row max into a min: the 16-bit kernels' shortcut (max of q.k, then
    scale) must not be taken."""
    q, k, v, _ = make_inputs(1, 2, 2, 35, 40, 16, 16, dtype)
    check_parity(q, k, v, None, False, scale=-0.7, backend="triton")


def causal_gqa_dropout(q, k, v, mask, grad, seed: int, backend: str):
    """Causal attention with grouped K/V heads, ``mask`` and dropout 0.3 drawn from ``seed``, on ``backend``:
    (output, gradients) as run_with_grads returns them."""
    def f(q_, k_, v_, m_):
        torch.manual_seed(seed)
        return fl.scaled_dot_product_attention(q_, k_, v_, attn_mask=m_, dropout_p=0.3, is_causal=True,
                                               enable_gqa=True)
    return run_with_grads(f, q, k, v, mask, grad, backend)


@pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (CPU runs)")
def test_triton_kernels_match_reference_with_dropout():
    """The kernels' dropout mask is the reference's (same Philox), so the two paths agree."""
    q, k, v, m = make_inputs(1, 4, 2, 35, 41, 32, 32, torch.float32, mask="float", mask_grad=True)
    grad = torch.randn(1, 4, 35, 32)
    out_t, g_t = causal_gqa_dropout(q, k, v, m, grad, seed=1, backend="triton")
    out_r, g_r = causal_gqa_dropout(q, k, v, m, grad, seed=1, backend="reference")
    torch.testing.assert_close(out_t, out_r, atol=2e-6, rtol=1e-5)
    for a, b in zip(g_t, g_r, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    keep = _dropout_probe(0.4, backend="triton", B=1, H=1, L=16, S=64)
    torch.testing.assert_close(keep, keep.round(), atol=1e-4, rtol=0)
    assert abs(keep.mean().item() - 0.6) < 5 * math.sqrt(0.24 / keep.numel())


@pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (CPU runs)")
def test_triton_kernels_only_needed_grads_and_determinism():
    q, k, v, _ = make_inputs(1, 4, 2, 33, 20, 16, 16, torch.float16)
    with fl.use_backend("triton"):
        out, lse = OPS.scaled_dot_product_attention(q, k, v, None, None, 0.0, True, 0.25)
        grad = torch.randn_like(out)
        args = (grad, q, k, v, out, lse, None, None, 0.0, True, 0.25)
        full = OPS.scaled_dot_product_attention_backward(*args, True, True, True, False)
        again = OPS.scaled_dot_product_attention_backward(*args, True, True, True, False)
        dq_only = OPS.scaled_dot_product_attention_backward(*args, True, False, False, False)
        dv_only = OPS.scaled_dot_product_attention_backward(*args, False, False, True, False)
    assert all(torch.equal(a, b) for a, b in zip(full, again, strict=True))
    assert torch.equal(dq_only[0], full[0]) and dq_only[1].numel() == 0 and dq_only[2].numel() == 0
    assert torch.equal(dv_only[2], full[2]) and dv_only[0].numel() == 0 and dv_only[1].numel() == 0
    _, lse_ref = OPS.scaled_dot_product_attention(q, k, v, None, None, 0.0, True, 0.25)
    torch.testing.assert_close(lse, lse_ref, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- CUDA (lent GPU)

GPU_CASES = [
    (2, 4, 4, 256, 256, 64, 64, False, None, ()),
    (2, 4, 4, 300, 517, 128, 128, True, None, ()),  # odd, L < S
    (1, 4, 4, 517, 300, 128, 128, True, None, ()),  # L > S
    (2, 8, 2, 384, 384, 64, 64, True, None, ()),  # GQA 4:1
    (1, 4, 4, 200, 333, 16, 16, False, "bool", (0, 99)),
    (1, 4, 2, 257, 255, 32, 32, True, "bool4", (7,)),
    (1, 2, 2, 190, 270, 80, 80, False, "float", (3,)),
    (1, 2, 2, 190, 270, 96, 96, True, "float_bcast", ()),
    (1, 2, 2, 130, 150, 256, 256, False, None, ()),
    (1, 2, 2, 130, 150, 256, 256, True, "bool", (1,)),
]


GPU_PARAMS = [pytest.param(c, torch.bfloat16, id="bf16-" + case_id(c)) for c in GPU_CASES] + [
    pytest.param(GPU_CASES[i], torch.float16, id="fp16-" + case_id(GPU_CASES[i])) for i in (1, 5, 7)
]


@pytest.mark.cuda
@pytest.mark.parametrize("case, dtype", GPU_PARAMS)
def test_cuda_parity(case, dtype):
    B, H, H_kv, L, S, D, DV, causal, mask, rows = case
    q, k, v, m = make_inputs(B, H, H_kv, L, S, D, DV, dtype, device="cuda", mask=mask, fully_masked_rows=rows,
                             mask_grad=mask is not None and mask.startswith("float"))
    out, grads = check_parity(q, k, v, m, causal)
    if mask == "bool":
        for i in rows:
            assert out[..., i, :].eq(0).all() and grads[0][..., i, :].eq(0).all()


@pytest.mark.cuda
def test_cuda_fp32():
    q, k, v, m = make_inputs(2, 4, 2, 150, 211, 64, 64, torch.float32, device="cuda", mask="bool")
    check_parity(q, k, v, m, True)


@pytest.mark.cuda
def test_cuda_deterministic_backward_and_memory():
    B, H, L, D = 1, 8, 4096, 128
    q, k, v, _ = make_inputs(B, H, 2, L, L, D, D, torch.bfloat16, device="cuda")
    grad = torch.randn(B, H, L, D, dtype=torch.bfloat16, device="cuda")
    f = lambda q_, k_, v_, m_: fl.scaled_dot_product_attention(q_, k_, v_, is_causal=True, enable_gqa=True)
    _, g1 = run_with_grads(f, q, k, v, None, grad)
    _, g2 = run_with_grads(f, q, k, v, None, grad)
    for a, b in zip(g1, g2, strict=True):
        assert torch.equal(a, b)
    # O(L) memory: forward + backward allocate far less than one (L, S) fp32 matrix per head
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    out = fl.scaled_dot_product_attention(*leaves, is_causal=True, enable_gqa=True)
    out.backward(grad)
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    inputs_outputs = sum(t.numel() * t.element_size() for t in (q, k, v, out, grad)) * 2
    assert extra < inputs_outputs + 2 * B * H * L * 4 * 2 + (1 << 20), extra
    assert extra < B * H * L * L * 4 / 8


@pytest.mark.cuda
def test_cuda_dropout():
    keep = _dropout_probe(0.2, B=2, H=4, L=512, S=256, device="cuda")
    torch.testing.assert_close(keep, keep.round(), atol=2e-3, rtol=0)
    keep = keep.round()
    assert abs(keep.mean().item() - 0.8) < 5 * math.sqrt(0.16 / keep.numel())
    # kernels and reference draw the same mask
    q, k, v, m = make_inputs(1, 4, 2, 100, 140, 64, 64, torch.float32, device="cuda", mask="bool")
    grad = torch.randn(1, 4, 100, 64, device="cuda")
    out_t, g_t = causal_gqa_dropout(q, k, v, m, grad, seed=4, backend="auto")
    out_r, g_r = causal_gqa_dropout(q, k, v, m, grad, seed=4, backend="reference")
    torch.testing.assert_close(out_t, out_r, atol=1e-5, rtol=1e-4)
    for a, b in zip(g_t, g_r, strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    out_t2, _ = causal_gqa_dropout(q, k, v, m, grad, seed=4, backend="auto")
    assert torch.equal(out_t, out_t2)


@pytest.mark.cuda
def test_cuda_compile_and_autocast():
    q, k, v, _ = make_inputs(2, 4, 4, 128, 128, 64, 64, torch.float32, device="cuda")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def f(q_, k_, v_):
        return fl.scaled_dot_product_attention(q_, k_, v_, is_causal=True)

    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = torch.compile(f, fullgraph=True)(*leaves)
        stock = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    assert out.dtype == torch.bfloat16
    ref = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), is_causal=True)
    assert_parity(out, stock, ref)
    out.float().sum().backward()
    assert all(t.grad is not None for t in leaves)


@pytest.mark.skipif(HAS_CUDA, reason="CPU-only check of the CPU fallback")
def test_auto_backend_on_cpu_runs_reference(monkeypatch):
    called = []
    real = attn_ops.attention_forward_reference
    monkeypatch.setattr(attn_ops, "attention_forward_reference", lambda *a, **kw: called.append(1) or real(*a, **kw))
    q, k, v, _ = make_inputs(1, 2, 2, 8, 8, 16, 16, torch.float32)
    fl.scaled_dot_product_attention(q, k, v)
    assert called
