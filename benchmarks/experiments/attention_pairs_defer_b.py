"""Experiment (H200, run from the repo root): the D64 one pass's step pairs with warpgroup 1's dQ_part of step b
handed to the TMA in the next iteration, under step a's S^T and dP^T (``ONE_PASS_PAIRS_DEFER_B``), against the
shipped hand-off at the iteration's end. Gradients against float64 at odd shapes first (odd and even step counts),
then forward+backward TFLOP/s, best of 3 shuffled rounds of triton.testing.do_bench, (B, H, L, 64) bf16,
B*L = 16384, H = 32; cuDNN in the same rounds.

    python benchmarks/experiments/attention_pairs_defer_b.py
"""
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

for H, H_kv, L, S, causal in ((8, 2, 3001, 3001, False), (2, 2, 3001, 3001, True), (4, 4, 2100, 4100, False),
                              (2, 2, 2048, 2048, False)):
    q = torch.randn(1, H, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, H_kv, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(1, H, L, 64, device="cuda", dtype=torch.bfloat16)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=True).backward(g.double())
    for defer in (False, True):
        hopper.ONE_PASS_PAIRS_DEFER_B = defer
        for t in (q, k, v):
            t.grad = None
        fl.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).backward(g)
        err = [((t.grad.double() - r.grad).abs().max() / r.grad.abs().max()).item()
               for t, r in zip((q, k, v), ref, strict=True)]
        print(f"H{H}:{H_kv} L{L} S{S} causal={causal} defer={defer}: dq/dk/dv error vs float64 "
              + " ".join(f"{e:.2e}" for e in err), flush=True)

for L in (2048, 4096, 16384):
    for causal in (False, True):
        B, H = 16384 // L, 32
        q, k, v = (torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        g = torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16)

        def ours(defer, q=q, k=k, v=v, g=g, causal=causal):
            def run():
                hopper.ONE_PASS_PAIRS_DEFER_B = defer
                fl.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
            return run

        def cudnn(q=q, k=k, v=v, g=g, causal=causal):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
        steps = {"shipped": ours(False), "defer": ours(True), "cudnn": cudnn}
        res = {}
        for _ in range(3):
            order = list(steps)
            random.shuffle(order)
            for name in order:
                res[name] = min(res.get(name, 1e9), triton.testing.do_bench(steps[name], warmup=25, rep=100,
                                                                            grad_to_none=[q, k, v]))
        flops = 3.5 * 4 * B * H * L * L * 64 / (2 if causal else 1)
        print(f"D64 L{L} causal={causal}: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}" for n, ms in res.items())
              + f" | defer/shipped={res['shipped'] / res['defer']:.3f}"
              + f" shipped/cudnn={res['cudnn'] / res['shipped']:.3f}", flush=True)
hopper.ONE_PASS_PAIRS_DEFER_B = False
