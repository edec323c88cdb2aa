"""Experiment (H200, run from the repo root): the default mode's D64 one pass in step pairs with step a's whole
dQ_part formed by warpgroup 0 and step b's by warpgroup 1 ("alt": ONE_PASS_ALT_DQ = (64,)) against each warpgroup
forming half the head dims of both steps ("shared": ()), and cuDNN: forward+backward TFLOP/s, best of 3 shuffled
rounds of triton.testing.do_bench, (B, H, L, D) bf16 inputs, B*L = 16384, H*D = 2048. First, each variant's gradients
against float64 at odd shapes (GQA, ragged lengths, an odd step count), beside the deterministic mode's.

    python benchmarks/experiments/attention_alt_dq.py

It ran on a tree where the alternation was a switch (``ONE_PASS_ALT_DQ``, head dims); it is now the step pairs' only
form (the same sm_90a PTX, D64 causal, triton 3.6), so this script needs that switch back to run.
"""
import itertools
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

VARIANTS = {"alt": (64,), "shared": ()}


def grads(fn, q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(g)
    return [t.grad.double() for t in (q, k, v)]


for B, H, H_kv, L, S, causal in [(2, 4, 2, 1030, 1030, True), (1, 4, 4, 130, 4100, False), (2, 2, 1, 2048, 2048, True),
                                 (1, 8, 2, 3001, 3001, False)]:
    q = torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16)
    ref = grads(lambda a, b, c: F.scaled_dot_product_attention(a.double(), b.double(), c.double(), is_causal=causal,
                                                               enable_gqa=True), q, k, v, g.double())
    errs = {}
    for name, alt in VARIANTS.items():
        hopper.ONE_PASS_ALT_DQ = alt
        got = grads(lambda a, b, c: fl.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True),
                    q, k, v, g)
        errs[name] = max(((x - r).abs().max() / r.abs().max()).item() for x, r in zip(got, ref, strict=True))
    with fl.use_deterministic_attention(True):
        got = grads(lambda a, b, c: fl.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True),
                    q, k, v, g)
    errs["det"] = max(((x - r).abs().max() / r.abs().max()).item() for x, r in zip(got, ref, strict=True))
    print(f"B{B} H{H}/{H_kv} L{L} S{S} causal={causal}: error vs float64 " + " ".join(
        f"{n}={e:.2e}" for n, e in errs.items()), flush=True)

D = 64
for L, causal in itertools.product((2048, 4096, 16384), (False, True)):
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def step(name, q=q, k=k, v=v, g=g, causal=causal):
        def run():
            if name == "cudnn":
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
            else:
                hopper.ONE_PASS_ALT_DQ = VARIANTS[name]
                fl.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
        return run
    res = {}
    for _ in range(3):
        order = ["alt", "shared", "cudnn"]
        random.shuffle(order)
        for name in order:
            ms = triton.testing.do_bench(step(name), warmup=25, rep=100, grad_to_none=[q, k, v])
            res[name] = min(res.get(name, 1e9), ms)
    flops = 3.5 * 4 * B * H * L * L * D / (2 if causal else 1)
    print(f"D64 L{L} {'causal' if causal else 'full'}: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}"
                                                                    for n, ms in res.items())
          + f" | alt/shared={res['shared'] / res['alt']:.3f} alt/cudnn={res['cudnn'] / res['alt']:.3f}"
          f" shared/cudnn={res['cudnn'] / res['shared']:.3f}", flush=True)
