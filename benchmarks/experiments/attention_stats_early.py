"""Experiment (H200, run from the repo root): the one-pass kernel's consumers reading a step's logsumexp and delta
from shared memory before issuing the step's S^T and dP^T ("early": ``STATS_EARLY``) rather than behind them
("kept"), in both modes (the default one pass, and the deterministic mode's warp-specialized dK/dV pass), against
cuDNN: forward+backward TFLOP/s, best of 3 shuffled rounds of triton.testing.do_bench, (B, H, L, D) bf16, B*L =
16384, H*D = 2048, D 64/128, causal and not. First, both forms' gradients at odd shapes: bitwise equal (only the
loads move).

    python benchmarks/experiments/attention_stats_early.py
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


for det, D, causal, (B, H, H_kv, L, S) in itertools.product((False, True), (64, 128), (False, True),
                                                            [(1, 8, 2, 3001, 3001), (2, 4, 1, 2050, 2050)]):
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    got = {}
    with fl.use_deterministic_attention(det):
        for early in (False, True):
            hopper.STATS_EARLY = early
            got[early] = grads(q, k, v, g, causal)
    hopper.STATS_EARLY = False
    err = max(((x.double() - y.double()).abs().max() / y.double().abs().max()).item()
              for x, y in zip(got[True], got[False], strict=True))
    same = all(torch.equal(x, y) for x, y in zip(got[True], got[False], strict=True))
    print(f"det={det} D{D} causal={causal} B{B} H{H}/{H_kv} L{L}: early bitwise equal to kept: {same}"
          + ("" if same or not det else f" (largest difference {err:.1e})"), flush=True)


def best(steps, args):
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


def variant(early, det, fn):
    def run():
        hopper.STATS_EARLY = early
        with fl.use_deterministic_attention(det):
            fn()
    return run


for D, causal, L in itertools.product((64, 128), (False, True), (2048, 4096, 16384)):
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def cudnn(q=q, k=k, v=v, g=g, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)

    def fused(q=q, k=k, v=v, g=g, causal=causal):
        fl.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
    steps = {"kept": variant(False, False, fused), "early": variant(True, False, fused),
             "det_kept": variant(False, True, fused), "det_early": variant(True, True, fused), "cudnn": cudnn}
    res = best(steps, [q, k, v])
    hopper.STATS_EARLY = False
    flops = 3.5 * 4 * B * H * L * L * D / (2 if causal else 1)
    print(f"D{D} L{L} causal={causal}: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}" for n, ms in res.items())
          + f" | early/kept={res['kept'] / res['early']:.3f} det early/kept={res['det_kept'] / res['det_early']:.3f}"
          f" | kept/cudnn={res['cudnn'] / res['kept']:.3f} det_kept/cudnn={res['cudnn'] / res['det_kept']:.3f}",
          flush=True)
