"""Experiment (H200, run from the repo root): the default mode's D128 one pass with each dQ_part added to the fp32 dQ
by 16-byte fp32 atomics from registers into a dq32 held in the accumulator's fragment order ("frag":
ONE_PASS_DQ_FRAGMENTS = (128,); "wg1": warpgroup 1's half so, warpgroup 0's by the TMA), against staging it in
shared memory for a TMA reduction ("tma": ()), and cuDNN:
forward+backward TFLOP/s, best of 3 shuffled rounds of triton.testing.do_bench, (B, H, L, D) bf16 inputs,
B*L = 16384, H*D = 2048; then 16K tokens with a 1024-key causal window and as packed documents. First, each variant's
gradients against float64 at odd shapes (GQA, ragged lengths, L != S), beside the deterministic
mode's.

    python benchmarks/experiments/attention_dq_fragments.py
"""
import itertools
import random
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

sys.path.insert(0, "benchmarks")
from bench_varlen_attention import document_lengths  # noqa: E402

VARIANTS = {"frag": ((128,), False), "wg1": ((128,), True), "tma": ((), False)}


def use(name):
    hopper.ONE_PASS_DQ_FRAGMENTS, hopper.ONE_PASS_DQ_FRAGMENTS_WG1 = VARIANTS[name]

D = 128


def grads(fn, q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(g)
    return [t.grad.double() for t in (q, k, v)]


def rel_err(got, ref):
    return max(((x - r).abs().max() / r.abs().max()).item() for x, r in zip(got, ref, strict=True))


for Dg, (B, H, H_kv, L, S, causal, window) in itertools.product((128,), [
        (2, 4, 2, 1030, 1030, True, None), (1, 4, 4, 130, 4100, False, None), (2, 2, 1, 2048, 2048, True, None),
        (1, 8, 2, 3001, 3001, False, None), (1, 6, 3, 2100, 4100, False, None), (1, 4, 4, 3001, 3001, True, 700)]):
    q = torch.randn(B, H, L, Dg, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, Dg, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, Dg, device="cuda", dtype=torch.bfloat16)
    mask = None
    if window is not None:
        i = torch.arange(L, device="cuda")[:, None]
        j = torch.arange(S, device="cuda")[None, :]
        mask = (j <= i) & (j >= i - window)
    ref = grads(lambda a, b, c: F.scaled_dot_product_attention(
        a.double(), b.double(), c.double(), attn_mask=mask, is_causal=causal and mask is None, enable_gqa=True),
        q, k, v, g.double())
    kw = dict(is_causal=causal, enable_gqa=True) | ({"window_size": (window, 0)} if window else {})
    errs, got = {}, {}
    for name in VARIANTS:
        use(name)
        got[name] = grads(lambda a, b, c: fl.scaled_dot_product_attention(a, b, c, **kw), q, k, v, g)
        errs[name] = rel_err(got[name], ref)
    with fl.use_deterministic_attention(True):
        errs["det"] = rel_err(grads(lambda a, b, c: fl.scaled_dot_product_attention(a, b, c, **kw), q, k, v, g), ref)
    dkdv_same = all(torch.equal(x, y) for n in ("frag", "wg1")
                    for x, y in zip(got[n][1:], got["tma"][1:], strict=True))
    print(f"D{Dg} B{B} H{H}/{H_kv} L{L} S{S} causal={causal} window={window}: error vs float64 " + " ".join(
        f"{n}={e:.2e}" for n, e in errs.items()) + f"; dK, dV bitwise equal: {dkdv_same}", flush=True)


def best(steps, args):
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


def ours(name, fn):
    def run():
        use(name)
        fn()
    return run


for L, causal in itertools.product((2048, 4096, 16384), (False, True)):
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def cudnn(q=q, k=k, v=v, g=g, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)

    def fused(q=q, k=k, v=v, g=g, causal=causal):
        fl.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
    res = best({n: ours(n, fused) for n in VARIANTS} | {"cudnn": cudnn}, [q, k, v])
    flops = 3.5 * 4 * B * H * L * L * D / (2 if causal else 1)
    print(f"D{D} L{L} {'causal' if causal else 'full'}: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}"
                                                                     for n, ms in res.items())
          + " | " + " ".join(f"{n}/tma={res['tma'] / res[n]:.3f}" for n in ("frag", "wg1"))
          + " | " + " ".join(f"{n}/cudnn={res['cudnn'] / res[n]:.3f}" for n in VARIANTS), flush=True)

# 16K tokens (H x D = 2048): a causal 1024-key window, and packed documents (varlen, causal)
lens = document_lengths(16384)
cu = torch.tensor([0] + list(itertools.accumulate(lens)), device="cuda", dtype=torch.int32)
H = 2048 // D
q, k, v = (torch.randn(1, H, 16384, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(1, H, 16384, D, device="cuda", dtype=torch.bfloat16)


def window(q=q, k=k, v=v, g=g):
    fl.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(1024, 0)).backward(g)


res = best({n: ours(n, window) for n in VARIANTS}, [q, k, v])
print(f"D{D} 16K window 1024 causal: " + " ".join(f"{n}/tma={res['tma'] / res[n]:.3f}" for n in ("frag", "wg1"))
      + f" (tma {res['tma']:.3f} ms)", flush=True)
qp, kp, vp = (torch.randn(16384, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
gp = torch.randn(16384, H, D, device="cuda", dtype=torch.bfloat16)


def packed(qp=qp, kp=kp, vp=vp, gp=gp):
    fl.varlen_attention(qp, kp, vp, cu, cu, max(lens), max(lens), is_causal=True).backward(gp)


res = best({n: ours(n, packed) for n in VARIANTS}, [qp, kp, vp])
print(f"D{D} 16K packed documents ({len(lens)}) causal: " + " ".join(
    f"{n}/tma={res['tma'] / res[n]:.3f}" for n in ("frag", "wg1")) + f" (tma {res['tma']:.3f} ms)", flush=True)
