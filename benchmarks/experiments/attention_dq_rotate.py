"""Experiment (H200, run from the repo root): the default mode's dense one pass, not causal, with each key block's
steps rotated to start at its own index ("rot": ONE_PASS_ROTATE), so that the key blocks running at once add dQ_part
to different dQ tiles rather than all to the same one, with dQ_part added by the TMA or by fragment-order atomics
("fragN_rot": an N-deep ring), against today's form ("base"), and cuDNN: forward+backward TFLOP/s, best of 3 shuffled
rounds of triton.testing.do_bench, (B, H, L, D) bf16 inputs, B*L = 16384, H*D = 2048, two runs. First, each variant's
gradients against float64 at odd shapes (GQA, ragged lengths, L != S).

    python benchmarks/experiments/attention_dq_rotate.py
"""
import itertools
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

KEPT = dict(hopper.ONE_PASS_DQ_FRAGMENTS)
NO_FRAG128 = {k: v for k, v in KEPT.items() if k != (128, False)}
VARIANTS = {
    128: {"base": (KEPT, ()), "rot": (KEPT, ((128, True),)), "tma_rot": (NO_FRAG128, ((128, False),))},
    64: {"base": (KEPT, ()), "tma_rot": (KEPT, ((64, False),)), "frag4_rot": (KEPT | {(64, False): 4}, ((64, True),)),
         "frag6_rot": (KEPT | {(64, False): 6}, ((64, True),))},
}


def use(D, name):
    hopper.ONE_PASS_DQ_FRAGMENTS, hopper.ONE_PASS_ROTATE = VARIANTS[D][name]


def grads(fn, q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(g)
    return [t.grad.double() for t in (q, k, v)]


def rel_err(got, ref):
    return max(((x - r).abs().max() / r.abs().max()).item() for x, r in zip(got, ref, strict=True))


for D, (B, H, H_kv, L, S) in itertools.product((128, 64), [(1, 4, 4, 130, 4100), (1, 8, 2, 3001, 3001),
                                                          (1, 6, 3, 2100, 4100), (2, 4, 1, 1030, 1030)]):
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    ref = grads(lambda a, b, c: F.scaled_dot_product_attention(
        a.double(), b.double(), c.double(), enable_gqa=True), q, k, v, g.double())
    errs, got = {}, {}
    for name in VARIANTS[D]:
        use(D, name)
        got[name] = grads(lambda a, b, c: fl.scaled_dot_product_attention(a, b, c, enable_gqa=True), q, k, v, g)
        errs[name] = rel_err(got[name], ref)
    dkdv_same = all(torch.equal(x, y) for n in VARIANTS[D] for x, y in zip(got[n][1:], got["base"][1:], strict=True))
    print(f"D{D} B{B} H{H}/{H_kv} L{L} S{S}: error vs float64 " + " ".join(
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


def ours(D, name, fn):
    def run():
        use(D, name)
        fn()
    return run


for run, D, L in itertools.product((1, 2), (128, 64), (2048, 4096, 16384)):
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def cudnn(q=q, k=k, v=v, g=g):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v).backward(g)

    def fused(q=q, k=k, v=v, g=g):
        fl.scaled_dot_product_attention(q, k, v).backward(g)
    res = best({n: ours(D, n, fused) for n in VARIANTS[D]} | {"cudnn": cudnn}, [q, k, v])
    flops = 3.5 * 4 * B * H * L * L * D
    print(f"run {run} D{D} L{L} full: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}" for n, ms in res.items())
          + " | " + " ".join(f"{n}/base={res['base'] / res[n]:.3f}" for n in VARIANTS[D] if n != "base")
          + " | " + " ".join(f"{n}/cudnn={res['cudnn'] / res[n]:.3f}" for n in VARIANTS[D]), flush=True)
