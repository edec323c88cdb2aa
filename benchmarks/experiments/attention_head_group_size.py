"""Experiment (H200, run from the repo root): causal backward programs dealt G heads at a time for G = 2, 4 and 8
(``_head_group`` replaced) against head by head at L 1K and 2K, where ``_head_group`` keeps head by head (its G
would be 8 or 16), and at 4K for reference (G 4 shipped). Forward+backward TFLOP/s, best of 3 shuffled rounds of
triton.testing.do_bench with cuDNN, in both modes, (B, H, L, D) bf16, B*L = 16384, H*D = 2048.

    python benchmarks/experiments/attention_head_group_size.py
"""
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

shipped = hopper._head_group


def best(steps, args):
    res = {}
    for _ in range(3):
        names = list(steps)
        random.shuffle(names)
        for name in names:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


for D, L in [(128, 1024), (128, 2048), (128, 4096), (64, 2048), (64, 4096)]:
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def step(group, det=False, cudnn=False, q=q, k=k, v=v, g=g):
        def run():
            hopper._head_group = lambda q, S, is_causal, intervals: group if is_causal and intervals is None else 0
            with fl.use_deterministic_attention(det), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                attention = F.scaled_dot_product_attention if cudnn else fl.scaled_dot_product_attention
                attention(q, k, v, is_causal=True).backward(g)
            hopper._head_group = shipped
        return run
    steps = {f"G{G}{' det' * det}": step(G, det) for G in (0, 2, 4, 8) for det in (False, True)}
    res = best(steps | {"cudnn": step(0, cudnn=True)}, [q, k, v])
    tf = {n: 3.5 * 2 * B * H * L * L * D / ms * 1e-9 for n, ms in res.items()}
    print(f"D{D} L{L} causal (shipped G{shipped(q, L, True, None)}): /head by head "
          + " ".join(f"{n} {tf[n] / tf['G0' + n[2:]]:.3f}" for n in steps if not n.startswith("G0"))
          + "; /cuDNN " + " ".join(f"{n} {tf[n] / tf['cudnn']:.3f}" for n in steps), flush=True)
