"""Experiment (H200, run from the repo root): how much of a wave the backward's last, partial wave of equal tiles
costs. Each row times the kernels of one forward+backward (torch.profiler, 10 calls, best of 3 rounds) at H heads and
at H + 1, chosen so that H + 1 gives a whole number of waves of 128-key tiles (one program an SM) and H a partial last
wave; kernel time (H + 1) / (H) is (H + 1) / H where the partial wave costs its share, 1.0 where it costs a whole one.

    python benchmarks/experiments/attention_tail_waves.py
"""
import sys

import torch

sys.path.insert(0, "benchmarks")
from timing import kernel_us  # noqa: E402

import fusedlayers as fl  # noqa: E402

SMS = torch.cuda.get_device_properties(0).multi_processor_count


def times(B, H, L, D, causal, det):
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)

    def step():
        with fl.use_deterministic_attention(det):
            torch.autograd.grad(fl.scaled_dot_product_attention(q, k, v, is_causal=causal), (q, k, v), do)
    best = {}
    for _ in range(3):
        for name, us in kernel_us(step, calls=10, warmup=3).items():
            best[name] = min(best.get(name, 1e12), us)
    return {n.split("(")[0].removeprefix("void ")[:28]: round(us) for n, us in best.items() if us > 20}


for D, B, H, L in [(64, 4, 32, 4096), (64, 1, 32, 16384), (128, 2, 32, 4096), (128, 1, 32, 8192)]:
    for det in (False, True):
        a, b = times(B, H, L, D, False, det), times(B, H + 1, L, D, False, det)
        tiles = L // 128 * B * H
        print(f"D{D} B{B} L{L} det={det}: tiles {tiles} ({tiles / SMS:.2f} waves) -> {tiles + L // 128 * B} "
              f"({(tiles + L // 128 * B) / SMS:.2f}); (H+1)/H={(H + 1) / H:.3f}", flush=True)
        for name in a:
            if name in b:
                print(f"    {name}: {a[name]} -> {b[name]} us, ratio {b[name] / a[name]:.3f}", flush=True)
