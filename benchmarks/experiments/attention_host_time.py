"""Experiment (H200, run from the repo root): the host time of a forward and a backward call (Python, autograd and
kernel launches, measured with the GPU idle, so nothing waits on it), ours against torch's SDPA pinned to cuDNN, and
do_bench's cache flush it hides behind; then where our calls spend it (cProfile). bf16 (B, H, L, D), B*L = 16384,
H*D = 2048.

    python benchmarks/experiments/attention_host_time.py
"""
import cProfile
import pstats
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl


def host_us(fn, n=50):
    """Median host time of fn() with the GPU idle before each call."""
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        torch.cuda.synchronize()
    return sorted(times)[n // 2] * 1e6


cache = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int, device="cuda")
start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
for _ in range(3):
    start.record()
    cache.zero_()
    end.record()
    torch.cuda.synchronize()
print(f"do_bench's cache flush: {start.elapsed_time(end) * 1e3:.0f} us of GPU time")

for D, L, causal in [(128, 2048, False), (128, 2048, True), (64, 2048, False), (128, 16384, False)]:
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    row = []
    for name, attn in [("fl", lambda: fl.scaled_dot_product_attention(q, k, v, is_causal=causal)),
                       ("cudnn", lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal))]:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            for _ in range(3):
                attn().backward(g)
            fwd = host_us(attn)
            out = attn()
            bwd = host_us(lambda: torch.autograd.grad(out, (q, k, v), g, retain_graph=True))
        row.append(f"{name} forward {fwd:.0f} us, backward {bwd:.0f} us")
    print(f"D{D} L{L} causal={causal}: " + "; ".join(row), flush=True)

for L in (2048, 16384):
    D, B = 128, 16384 // L
    q, k, v = (torch.randn(B, 16, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, 16, L, D, device="cuda", dtype=torch.bfloat16)
    for part in ("forward", "backward"):
        profile = cProfile.Profile()
        for _ in range(50):
            torch.cuda.synchronize()
            if part == "forward":
                profile.enable()
            out = fl.scaled_dot_product_attention(q, k, v)
            profile.disable()
            torch.cuda.synchronize()
            if part == "backward":
                profile.enable()
            torch.autograd.grad(out, (q, k, v), g)
            profile.disable()
        print(f"== L{L} {part}, 50 calls")
        pstats.Stats(profile).sort_stats("cumulative").print_stats(22)
