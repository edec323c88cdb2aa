"""Experiment (H200, run from the repo root; ``python ... 64``: D64 at L 1K-2K, where the one pass starts): the default
mode's dense D128 causal one pass with each dQ_part added
to the fp32 dQ by 16-byte fp32 atomics from registers into a dq32 in the accumulator's fragment order ("fragN", an
N-deep Q/dO ring in the freed shared memory), against staging it in shared memory for a TMA reduction ("tma"), and
cuDNN: forward+backward TFLOP/s, best of 3 shuffled rounds of triton.testing.do_bench, (B, H, L, D) bf16 inputs,
B*L = 16384, H*D = 2048, two runs. First, each variant's gradients against float64 at odd shapes.

    python benchmarks/experiments/attention_dq_fragments_causal.py
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

KEPT = dict(hopper.ONE_PASS_DQ_FRAGMENTS)
D = int(sys.argv[1]) if len(sys.argv) > 1 else 128
if D == 64:  # the kept 6-deep fragment form against the TMA
    VARIANTS = {"tma": {k: v for k, v in KEPT.items() if k != (64, True)}, "frag6": KEPT}
    LENGTHS = (1024, 1536, 2048)
else:
    VARIANTS = {"tma": KEPT, "frag2": KEPT | {(128, True): 2}, "frag3": KEPT | {(128, True): 3}}
    LENGTHS = (2048, 4096, 16384)


def use(name):
    hopper.ONE_PASS_DQ_FRAGMENTS = VARIANTS[name]


def grads(fn, q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(g)
    return [t.grad.double() for t in (q, k, v)]


def rel_err(got, ref):
    return max(((x - r).abs().max() / r.abs().max()).item() for x, r in zip(got, ref, strict=True))


for B, H, H_kv, L, S in [(2, 4, 2, 1030, 1030), (2, 2, 1, 2048, 2048), (3, 4, 4, 1100, 1100), (1, 6, 3, 300, 4100)]:
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    ref = grads(lambda a, b, c: F.scaled_dot_product_attention(
        a.double(), b.double(), c.double(), is_causal=True, enable_gqa=True), q, k, v, g.double())
    errs, got = {}, {}
    for name in VARIANTS:
        use(name)
        got[name] = grads(lambda a, b, c: fl.scaled_dot_product_attention(a, b, c, is_causal=True,
                                                                          enable_gqa=True), q, k, v, g)
        errs[name] = rel_err(got[name], ref)
    dkdv_same = all(torch.equal(x, y) for n in VARIANTS for x, y in zip(got[n][1:], got["tma"][1:], strict=True))
    print(f"D{D} B{B} H{H}/{H_kv} L{L} S{S} causal: error vs float64 " + " ".join(
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


for run, L in itertools.product((1, 2), LENGTHS):
    B, H = max(16384 // L, 1), 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def cudnn(q=q, k=k, v=v, g=g):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    def fused(q=q, k=k, v=v, g=g):
        fl.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
    res = best({n: ours(n, fused) for n in VARIANTS} | {"cudnn": cudnn}, [q, k, v])
    flops = 3.5 * 4 * B * H * L * L * D / 2
    print(f"run {run} D{D} L{L} causal: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}" for n, ms in res.items())
          + " | " + " ".join(f"{n}/tma={res['tma'] / res[n]:.3f}" for n in VARIANTS if n != "tma")
          + " | " + " ".join(f"{n}/cudnn={res['cudnn'] / res[n]:.3f}" for n in VARIANTS), flush=True)
use("tma")
