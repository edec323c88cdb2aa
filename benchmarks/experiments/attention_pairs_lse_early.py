"""Experiment (H200, run from the repo root): the default mode's D64 step pairs reading step b's logsumexp from
shared memory before issuing its S^T ("lse": ``PAIRS_LSE_EARLY = 1``; ptxas sm_90a: no spills not causal, 16 bytes
causal against 12) rather than behind its products ("kept"; Nsight Compute: the FSEL/FFMA that take the statistics
hold 10 K of the pass's 15 K short-scoreboard samples at L 2048 not causal), against cuDNN: forward+backward TFLOP/s,
best of 3 shuffled rounds of triton.testing.do_bench, (B, H, L, 64) bf16, B*L = 16384, H = 32, causal and not.
First, at odd shapes: dK and dV bitwise equal to the kept form's, dQ's largest difference (its sums unordered).

    python benchmarks/experiments/attention_pairs_lse_early.py
"""
import itertools
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper


def grads(q, k, v, g, causal):
    for t in (q, k, v):
        t.grad = None
    fl.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).backward(g)
    return [t.grad.clone() for t in (q, k, v)]


for causal, (B, H, H_kv, L) in itertools.product((False, True), [(1, 8, 2, 3001), (2, 4, 1, 2050)]):
    q = torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16)
    got = {}
    for early in (0, 1):
        hopper.PAIRS_LSE_EARLY = early
        got[early] = grads(q, k, v, g, causal)
    hopper.PAIRS_LSE_EARLY = 0
    dq_err = ((got[1][0].double() - got[0][0].double()).abs().max() / got[0][0].double().abs().max()).item()
    same = all(torch.equal(x, y) for x, y in zip(got[1][1:], got[0][1:], strict=True))
    print(f"causal={causal} B{B} H{H}/{H_kv} L{L}: dK, dV bitwise equal {same}, dQ largest difference {dq_err:.1e}",
          flush=True)


def best(steps, args):
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


def variant(early, fn):
    def run():
        hopper.PAIRS_LSE_EARLY = early
        fn()
    return run


for causal, L in itertools.product((False, True), (2048, 4096, 16384)):
    B, H, D = 16384 // L, 32, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def cudnn(q=q, k=k, v=v, g=g, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)

    def fused(q=q, k=k, v=v, g=g, causal=causal):
        fl.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
    res = best({"kept": variant(0, fused), "lse": variant(1, fused), "cudnn": cudnn}, [q, k, v])
    hopper.PAIRS_LSE_EARLY = 0
    flops = 3.5 * 4 * B * H * L * L * D / (2 if causal else 1)
    print(f"D{D} L{L} causal={causal}: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}" for n, ms in res.items())
          + f" | lse/kept={res['kept'] / res['lse']:.3f} | kept/cudnn={res['cudnn'] / res['kept']:.3f}"
          f" lse/cudnn={res['cudnn'] / res['lse']:.3f}", flush=True)
