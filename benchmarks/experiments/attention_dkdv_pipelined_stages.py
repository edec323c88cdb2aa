"""Experiment (H200, run from the repo root): the deterministic mode's D128 dK/dV pass (warp-specialized, not causal)
with pipelined single steps and a 3- or 4-deep Q/dO ring, against the shipped one (3 stages, not pipelined) and
cuDNN: forward+backward TFLOP/s, best of 3 shuffled rounds of triton.testing.do_bench, (B, H, L, 128) bf16,
B*L = 16384, H = 16. First, each variant's gradients at an odd shape against the shipped ones, run twice.

    python benchmarks/experiments/attention_dkdv_pipelined_stages.py
"""
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

VARIANTS = {"shipped": ((64,), 3), "piped3": ((64, 128), 3), "piped4": ((64, 128), 4)}


def use(name):
    hopper.WS_DKDV_PIPELINED, stages = VARIANTS[name]
    hopper.WS_DKDV_STAGES = {64: 4, 128: stages}


def grads(q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    fl.scaled_dot_product_attention(q, k, v, enable_gqa=True).backward(g)
    return [t.grad.clone() for t in (q, k, v)]


q = torch.randn(1, 8, 3001, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
k, v = (torch.randn(1, 2, 3001, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
g = torch.randn(1, 8, 3001, 128, device="cuda", dtype=torch.bfloat16)
with fl.use_deterministic_attention(True):
    use("shipped")
    ref = grads(q, k, v, g)
    for name in VARIANTS:
        use(name)
        a, b = grads(q, k, v, g), grads(q, k, v, g)
        diff = max(((x.float() - r.float()).abs().max() / r.float().abs().max()).item()
                   for x, r in zip(a, ref, strict=True))
        print(f"{name}: repeat equal {all(torch.equal(x, y) for x, y in zip(a, b, strict=True))}, "
              f"largest difference from shipped {diff:.2e}", flush=True)

for L in (2048, 4096, 16384):
    B, H = 16384 // L, 16
    q, k, v = (torch.randn(B, H, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, 128, device="cuda", dtype=torch.bfloat16)

    def ours(name, q=q, k=k, v=v, g=g):
        def run():
            use(name)
            with fl.use_deterministic_attention(True):
                fl.scaled_dot_product_attention(q, k, v).backward(g)
        return run

    def cudnn(q=q, k=k, v=v, g=g):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v).backward(g)
    steps = {n: ours(n) for n in VARIANTS} | {"cudnn": cudnn}
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            res[name] = min(res.get(name, 1e9), triton.testing.do_bench(steps[name], warmup=25, rep=100,
                                                                        grad_to_none=[q, k, v]))
    flops = 3.5 * 4 * B * H * L * L * 128
    print(f"D128 L{L} deterministic: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}" for n, ms in res.items())
          + " | " + " ".join(f"{n}/shipped={res['shipped'] / res[n]:.3f}" for n in ("piped3", "piped4"))
          + f" shipped/cudnn={res['cudnn'] / res['shipped']:.3f}", flush=True)
use("shipped")
