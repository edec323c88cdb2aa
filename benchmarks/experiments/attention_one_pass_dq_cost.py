"""Experiment (H200, run from the repo root): what the D128 one pass spends on dQ, by switching parts of it off
(``ONE_PASS_ABLATE``; gradients wrong in 1-6): 1, dQ_part written by a TMA store instead of the TMA's reduce-add; 2,
dQ_part formed but not staged or added; 3, no dQ_part product (dS^T still stored, the warpgroups still meet); 4, 5,
6: the shipped hand-off without its wait for the previous reduction's read of the tile, without its fence, without
its stores; 7: dQ_part's columns permuted in registers so that each thread's 16 values of a row are contiguous (four
16-byte stores a row instead of eight 8-byte ones), dq32 held in that order and put back by the conversion; 8:
dQ_part issued before dV and dK, so that its hand-off runs under both. Gradients of 7 and 8 against float64 at odd
shapes; forward+backward ms and TFLOP/s of the variants in TIMED, best of 3 shuffled rounds of
triton.testing.do_bench, (B, H, L, 128) bf16, B*L = 16384, H = 16; cuDNN in the same rounds.

    python benchmarks/experiments/attention_one_pass_dq_cost.py
"""
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

VARIANTS = {"shipped": 0, "tma_store": 1, "no_staging": 2, "no_dq_product": 3, "no_read_wait": 4, "no_fence": 5,
            "no_stores": 6, "permuted": 7, "dq_first": 8}
TIMED = ("shipped", "no_staging", "no_stores", "dq_first")

for L, S, causal in ((3001, 3001, False), (2100, 4100, False), (3001, 3001, True)):
    q = torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16)
    ref = [t.detach().double().requires_grad_() for t in (q, k, v)]
    F.scaled_dot_product_attention(*ref, is_causal=causal, enable_gqa=True).backward(g.double())
    for name in ("shipped", "dq_first"):
        hopper.ONE_PASS_ABLATE = VARIANTS[name]
        for t in (q, k, v):
            t.grad = None
        fl.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).backward(g)
        err = [((t.grad.double() - r.grad).abs().max() / r.grad.abs().max()).item()
               for t, r in zip((q, k, v), ref, strict=True)]
        print(f"L{L} S{S} causal={causal} {name}: dq/dk/dv error vs float64 " + " ".join(f"{e:.2e}" for e in err),
              flush=True)

for L, causal in ((2048, False), (4096, False), (16384, False), (16384, True)):
    B, H = 16384 // L, 16
    q, k, v = (torch.randn(B, H, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, 128, device="cuda", dtype=torch.bfloat16)

    def ours(name, q=q, k=k, v=v, g=g, causal=causal):
        def run():
            hopper.ONE_PASS_ABLATE = VARIANTS[name]
            fl.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
        return run

    def det(q=q, k=k, v=v, g=g, causal=causal):
        hopper.ONE_PASS_ABLATE = 0
        with fl.use_deterministic_attention(True):
            fl.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)

    def cudnn(q=q, k=k, v=v, g=g, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
    steps = {n: ours(n) for n in TIMED} | {"cudnn": cudnn}
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            res[name] = min(res.get(name, 1e9), triton.testing.do_bench(steps[name], warmup=25, rep=100,
                                                                        grad_to_none=[q, k, v]))
    flops = 3.5 * 4 * B * H * L * L * 128 / (2 if causal else 1)
    print(f"D128 L{L} causal={causal}: " + " ".join(f"{n}={res[n]:.3f}ms/{flops / res[n] * 1e-9:.0f}" for n in steps)
          + " | " + " ".join(f"shipped/{n}={res['shipped'] / res[n]:.3f}" for n in steps if n != "shipped"),
          flush=True)
hopper.ONE_PASS_ABLATE = 0
