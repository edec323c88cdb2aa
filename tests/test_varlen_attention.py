"""fl.varlen_attention: packed variable-length sequences (FlashAttention's varlen layout) against attention spelled
out per sequence (float64 reference; the parity rule against the same in the inputs' dtype), random length mixes with
empty and length-1 sequences, causal (bottom-right), windows, soft-capping, GQA; the blockwise reference, the Triton
kernels under the interpreter, and the GPU; opcheck and torch.compile; errors."""

from __future__ import annotations

import math
import os

import pytest
import torch

import fusedlayers as fl
from tests.parity import assert_parity, assert_within_bound
from tests.test_scaled_dot_product_attention import (
    BACKENDS,
    attention_error_bounds,
    check_gluon_in_both_modes,
    gluon_backward_kernels,
    gluon_forward_kernels,
    gluon_kernel_calls,
    kept_pairs,
)


def sequence_keep(L, S, causal, window, device):
    """The (query, key) pairs a sequence keeps: bottom-right aligned (query i of L at key i + S - L)."""
    return kept_pairs(L, S, window, device, causal, shift=S - L)


def per_sequence_bounds(q, k, v, grad, cu_q, cu_k, causal, window, softcap):
    """The fp32 error model's elementwise bounds (test_scaled_dot_product_attention's ``attention_error_bounds``,
    rigorous for any summation order and CPU) of the output and of dq, dk, dv, per sequence, packed as they are."""
    parts = {"output": [], "dq": [], "dk": [], "dv": []}
    for b in range(len(cu_q) - 1):
        qs, gs = (t[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None] for t in (q, grad))
        ks, vs = (t[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None] for t in (k, v))
        L, S = qs.shape[2], ks.shape[2]
        if L == 0 or S == 0:  # nothing to attend: zeros, exactly
            bounds = {"output": torch.zeros_like(qs), "dq": torch.zeros_like(qs), "dk": torch.zeros_like(ks),
                      "dv": torch.zeros_like(vs)}
        else:
            bounds = attention_error_bounds(qs, ks, vs, sequence_keep(L, S, causal, window, q.device), gs, False,
                                            softcap=softcap)
        for name, bound in bounds.items():
            parts[name].append(bound[0].transpose(0, 1))
    return {name: torch.cat(p) for name, p in parts.items()}


def per_sequence(q, k, v, cu_q, cu_k, causal=False, window=(-1, -1), softcap=0.0):
    """Each sequence on its own, as dense attention with explicit masks: bottom-right aligned (query i of L at key
    i + S - L), rows with no key give 0; GQA by repeating K/V."""
    outs = []
    G = q.shape[1] // k.shape[1]
    for b in range(len(cu_q) - 1):
        qs = q[cu_q[b]:cu_q[b + 1]].transpose(0, 1)
        ks = k[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(G, 0)
        vs = v[cu_k[b]:cu_k[b + 1]].transpose(0, 1).repeat_interleave(G, 0)
        s = qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1])
        if softcap > 0.0:
            s = softcap * torch.tanh(s / softcap)
        keep = sequence_keep(qs.shape[1], ks.shape[1], causal, window, q.device)
        p = torch.softmax(s.masked_fill(~keep, float("-inf")), -1).nan_to_num(0.0)
        outs.append((p @ vs).transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2])


def packed(lens_q, lens_k, H, H_kv, D, dtype, device="cpu", seed=0):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32, device=device)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32, device=device)
    q = torch.randn(sum(lens_q), H, D, generator=g).to(device, dtype)
    k = torch.randn(sum(lens_k), H_kv, D, generator=g).to(device, dtype)
    v = torch.randn(sum(lens_k), H_kv, D, generator=g).to(device, dtype)
    return q, k, v, cu_q, cu_k


def random_lengths(n, most, seed):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, most + 1, (n,), generator=g).tolist()
    return [0, 1, *lens]  # an empty sequence and a single token always among them


# (lengths of q, lengths of k or None = the same, H, H_kv, D, causal, window, softcap)
CASES = [
    (random_lengths(5, 40, 1), None, 4, 2, 16, False, (-1, -1), 0.0),
    (random_lengths(5, 40, 2), None, 2, 2, 32, True, (-1, -1), 0.0),
    ([5, 0, 37, 1, 19], [7, 3, 37, 1, 4], 4, 2, 16, True, (-1, -1), 0.0),  # L != S per sequence: bottom-right
    (random_lengths(4, 50, 3), None, 2, 1, 16, True, (6, 0), 0.0),
    (random_lengths(4, 50, 4), None, 2, 2, 16, False, (4, 9), 0.0),
    (random_lengths(4, 30, 5), None, 3, 3, 16, False, (-1, -1), 2.5),
    (random_lengths(4, 30, 6), None, 4, 4, 32, True, (10, -1), 1.5),
    # sequences longer than the interpreter's blocks: blocks every row sees whole run unmasked
    ([100, 3, 130, 0, 70], None, 2, 1, 16, True, (-1, -1), 0.0),
    ([90, 1, 120], [110, 2, 100], 2, 2, 16, False, (50, -1), 2.0),
    ([120, 5, 90], [100, 40, 130], 2, 1, 16, True, (40, 0), 0.0),
]


def check(case, dtype, device="cpu", backend="auto"):
    lens_q, lens_k, H, H_kv, D, causal, window, softcap = case
    lens_k = lens_k or lens_q
    q, k, v, cu_q, cu_k = packed(lens_q, lens_k, H, H_kv, D, dtype, device)
    grad = torch.randn(q.shape[0], H, D, dtype=dtype, device=device)
    kw = dict(causal=causal, window=window, softcap=softcap)

    def run(fn, *inputs):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        return out.detach(), torch.autograd.grad(out, leaves, grad.to(out.dtype))

    with fl.use_backend(backend):
        fused = run(lambda a, b, c: fl.varlen_attention(a, b, c, cu_q, cu_k, max(lens_q), max(lens_k),
                                                        is_causal=causal, window_size=window, softcap=softcap),
                    q, k, v)
    cq, ck = cu_q.tolist(), cu_k.tolist()
    stock = run(lambda a, b, c: per_sequence(a, b, c, cq, ck, **kw), q, k, v)
    ref = run(lambda a, b, c: per_sequence(a, b, c, cq, ck, **kw), q.double(), k.double(), v.double())
    # fp32: within the error model (as test_scaled_dot_product_attention's fp32 results); else the parity rule
    bounds = per_sequence_bounds(q, k, v, grad, cq, ck, **kw) if dtype == torch.float32 else None
    for name, xf, xs, xr in zip(("output", "dq", "dk", "dv"), [fused[0], *fused[1]], [stock[0], *stock[1]],
                                [ref[0], *ref[1]], strict=True):
        assert xf.dtype == dtype and not xf.isnan().any(), name
        if bounds is not None:
            assert_within_bound(xf, xr, bounds[name], f"fused {name}")
            assert_within_bound(xs, xr, bounds[name], f"stock {name} (the error model itself)")
        else:
            assert_parity(xf, xs, xr, name)
    return fused


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float64], ids=str)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_matches_attention_per_sequence(case, dtype, backend):
    if dtype == torch.float16 and backend == "reference":
        pytest.skip("the reference computes fp16 in fp32 like the kernels; fp32 covers it")
    check(case, dtype, backend=backend)


def test_sequences_do_not_see_each_other():
    """Changing one sequence's keys changes only its own rows."""
    q, k, v, cu_q, cu_k = packed([6, 9, 4], [6, 9, 4], 2, 2, 8, torch.float32)
    a = fl.varlen_attention(q, k, v, cu_q, cu_k, 9, 9)
    k2 = k.clone()
    k2[6:15] = torch.randn(9, 2, 8)  # the second sequence (a constant shift would cancel in the softmax)
    b = fl.varlen_attention(q, k2, v, cu_q, cu_k, 9, 9)
    assert torch.equal(a[:6], b[:6]) and torch.equal(a[15:], b[15:])
    assert (a[6:15] - b[6:15]).abs().max() > 1e-3


def test_op_checks_and_compile():
    q, k, v, cu_q, cu_k = packed([5, 0, 11, 1], [5, 0, 11, 1], 2, 1, 8, torch.float32)
    from fusedlayers.functional import _varlen_intervals

    lens = (cu_q[1:] - cu_q[:-1]).long(), (cu_k[1:] - cu_k[:-1]).long()
    intervals = _varlen_intervals(cu_q.long(), cu_k.long(), *lens, True, (-1, -1), q.shape[0], k.shape[0])
    args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), *intervals, None, 0.0, 0.35, 0.0, 5.5)
    torch.library.opcheck(torch.ops.fusedlayers.varlen_attention, args)

    def f(q_, k_, v_):
        return fl.varlen_attention(q_, k_, v_, cu_q, cu_k, 11, 11, is_causal=True).sum()

    compiled = torch.compile(f, fullgraph=True)
    eager_grads = torch.autograd.grad(f(q, k, v), (q, k, v))
    compiled_grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    for a, b in zip(eager_grads, compiled_grads, strict=True):
        torch.testing.assert_close(a, b)


def test_bad_input_names_the_argument():
    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4], 2, 2, 8, torch.float32)
    with pytest.raises(ValueError, match="query must be 3-D"):
        fl.varlen_attention(q[None], k, v, cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_q must be a 1-D int32"):
        fl.varlen_attention(q, k, v, cu_q.long(), cu_k, 4, 4)
    with pytest.raises(ValueError, match="cu_seqlens_k must start at 0, never decrease and end at 7"):
        fl.varlen_attention(q, k, v, cu_q, torch.tensor([0, 5, 6], dtype=torch.int32), 4, 4)
    with pytest.raises(ValueError, match="same number of sequences"):
        fl.varlen_attention(q, k, v, cu_q, torch.tensor([0, 7], dtype=torch.int32), 4, 7)
    with pytest.raises(ValueError, match=r"max_seqlen_q must be an int >= the longest sequence \(4\)"):
        fl.varlen_attention(q, k, v, cu_q, cu_k, 3, 4)
    with pytest.raises(ValueError, match=r"query heads \(2\) must be a multiple"):
        fl.varlen_attention(q, k[:, :0], v[:, :0], cu_q, cu_k, 4, 4)
    with pytest.raises(ValueError, match="window_size must be a pair"):
        fl.varlen_attention(q, k, v, cu_q, cu_k, 4, 4, window_size=(2,))


def test_lengths_changed_in_place_are_checked_again():
    """The key intervals of the last cu_seqlens are reused (one check per model step, not per layer), but not once
    the tensor changed in place: new lengths give new intervals, bad ones an error."""
    q, k, v, cu_q, cu_k = packed([3, 4], [3, 4], 2, 2, 8, torch.float32)
    first = fl.varlen_attention(q, k, v, cu_q, cu_q, 4, 4, is_causal=True)
    torch.testing.assert_close(first, per_sequence(q, k, v, cu_q, cu_q, causal=True))
    cu_q[1] = 5  # lengths (5, 2)
    moved = fl.varlen_attention(q, k, v, cu_q, cu_q, 5, 5, is_causal=True)
    torch.testing.assert_close(moved, per_sequence(q, k, v, cu_q, cu_q, causal=True))
    cu_q[1] = 9
    with pytest.raises(ValueError, match="cu_seqlens_q must start at 0, never decrease"):
        fl.varlen_attention(q, k, v, cu_q, cu_q, 5, 5, is_causal=True)


def test_inference_mode():
    """Tensors made under inference_mode have no version counter: nothing is cached for them, the result is the
    same."""
    q, k, v, cu_q, _ = packed([3, 4], [3, 4], 2, 2, 8, torch.float32)
    want = per_sequence(q, k, v, cu_q, cu_q, causal=True)
    with torch.inference_mode():
        cu_inf = cu_q.clone()
        for cu in (cu_inf, cu_inf, cu_q):
            torch.testing.assert_close(fl.varlen_attention(q, k, v, cu, cu, 4, 4, is_causal=True), want)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("case", CASES, ids=[f"case{i}" for i in range(len(CASES))])
def test_cuda_matches_attention_per_sequence(case, dtype):
    check(case, dtype, device="cuda")


# head dims 64 and 128, sequences longer than the Hopper kernels' blocks
HOPPER_CASES = [
    ([700, 1, 0, 333, 150, 64], None, 4, 4, 128, True, (-1, -1), 0.0),
    ([300, 17, 260], None, 4, 2, 64, True, (127, 0), 0.0),
    ([200, 150], None, 2, 2, 128, False, (100, 50), 0.0),
    ([300, 80, 200], [150, 0, 260], 2, 2, 128, True, (-1, -1), 0.0),  # more queries than keys: rows without keys
    ([129, 64, 255], [200, 64, 100], 4, 1, 64, False, (-1, -1), 0.0),
    ([700, 1, 0, 333, 150, 64], None, 4, 2, 128, True, (-1, -1), 30.0),  # soft-capped
    ([300, 17, 260], None, 2, 2, 64, False, (127, 40), 15.0),
]


@pytest.mark.cuda
@pytest.mark.parametrize("ws", [False, True], ids=["one-warpgroup", "warp-specialized"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", HOPPER_CASES, ids=[f"case{i}" for i in range(len(HOPPER_CASES))])
def test_cuda_hopper_kernels(case, dtype, ws, monkeypatch):
    """On Hopper the Gluon kernels run packed sequences and windows (as per-row key intervals), forward and backward
    (one pass, or dK/dV and dQ in deterministic mode): each ran, and the parity rule holds in both modes."""
    calls = gluon_kernel_calls(monkeypatch, ws_on_intervals=ws)
    check_gluon_in_both_modes(lambda: check(case, dtype, device="cuda"), calls, gluon_forward_kernels(ws), case[4],
                              case[7] > 0, intervals=True)


# D256: the Gluon forward (either one on intervals) and backward (dK/dV on two warpgroups)
HOPPER_D256_CASES = [
    ([300, 1, 0, 200, 150], None, 4, 2, 256, True, (-1, -1), 0.0),
    ([200, 150], [120, 260], 2, 2, 256, False, (100, 50), 20.0),
]


@pytest.mark.cuda
@pytest.mark.parametrize("ws", [False, True], ids=["one-warpgroup", "warp-specialized"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("case", HOPPER_D256_CASES, ids=[f"case{i}" for i in range(len(HOPPER_D256_CASES))])
def test_cuda_hopper_d256(case, dtype, ws, monkeypatch):
    """At head dim 256 packed sequences run the Gluon forward, dK/dV and dQ kernels: the parity rule holds."""
    calls = gluon_kernel_calls(monkeypatch, ws_on_intervals=ws)
    check(case, dtype, device="cuda")
    assert set(calls) == gluon_forward_kernels(ws) | gluon_backward_kernels(case[4], False, case[7] > 0, True)


@pytest.mark.parametrize("case", CASES[:4], ids=[f"case{i}" for i in range(4)])
def test_reference_in_small_chunks(case, monkeypatch):
    """The reference's query chunks (each against the keys its rows' intervals span, batched) add up to the same
    result when they are small: chunk boundaries inside sequences, keys shared by several chunks, several batches."""
    from fusedlayers.ops import scaled_dot_product_attention as attn_ops
    from fusedlayers.ops import varlen_attention as varlen_ops

    monkeypatch.setattr(attn_ops, "REFERENCE_BLOCK_N", 8)
    monkeypatch.setattr(varlen_ops, "REFERENCE_QUERY_CHUNK", 8)
    monkeypatch.setattr(varlen_ops, "REFERENCE_GATHER_BUDGET", 2000)  # a few chunks per batch, several batches
    check(case, torch.float64, backend="reference")


@pytest.mark.skipif(not os.environ.get("TRITON_INTERPRET"), reason="needs TRITON_INTERPRET=1 (CPU runs)")
def test_dropout_mask_is_the_kernels(monkeypatch):
    """With dropout the reference (in chunks) and the kernels apply the same keep mask: the same result."""
    from fusedlayers.ops import scaled_dot_product_attention as attn_ops
    from fusedlayers.ops import varlen_attention as varlen_ops

    monkeypatch.setattr(attn_ops, "REFERENCE_BLOCK_N", 16)
    monkeypatch.setattr(varlen_ops, "REFERENCE_QUERY_CHUNK", 16)
    q, k, v, cu_q, cu_k = packed([20, 0, 45, 1, 30], [20, 0, 45, 1, 30], 2, 1, 16, torch.float32)
    outs = []
    for backend in ("reference", "triton"):
        torch.manual_seed(7)
        with fl.use_backend(backend):
            outs.append(fl.varlen_attention(q, k, v, cu_q, cu_k, 45, 45, dropout_p=0.3, is_causal=True))
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-5, atol=1e-5)
    torch.manual_seed(8)
    assert (fl.varlen_attention(q, k, v, cu_q, cu_k, 45, 45, dropout_p=0.3, is_causal=True) - outs[0]).abs().max() > 0


def test_reference_plan_is_reused_until_its_inputs_change(monkeypatch):
    """The reference's chunk plan is built once for the interval tensors every layer passes, and again when they
    change in place or the chunking does."""
    from fusedlayers.ops import varlen_attention as varlen_ops

    row_lo = torch.tensor([0, 0, 0, 3, 3], dtype=torch.int32)
    row_hi = torch.tensor([0, 1, 2, 3, 4], dtype=torch.int32)
    q = torch.randn(5, 2, 8)
    plan = varlen_ops._chunks(row_lo, row_hi, q, q, q)
    assert varlen_ops._chunks(row_lo, row_hi, q, q, q) is plan
    assert varlen_ops._chunks(row_lo.clone(), row_hi, q, q, q) is not plan  # other tensors, equal values
    plan = varlen_ops._chunks(row_lo, row_hi, q, q, q)
    monkeypatch.setattr(varlen_ops, "REFERENCE_QUERY_CHUNK", 2)
    smaller = varlen_ops._chunks(row_lo, row_hi, q, q, q)
    assert smaller is not plan and smaller.groups[0][0].rows.shape[1] == 2
    row_hi[4] = 3  # an in-place change
    assert varlen_ops._chunks(row_lo, row_hi, q, q, q) is not smaller
