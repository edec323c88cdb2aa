"""Experiment (H200, run from the repo root): the deterministic mode's D64 dK/dV pass on causal calls with persistent
programs taking their tiles from a host-built schedule (``_dkdv_schedule``: launch order, each tile to the program that
frees up first) against a program a tile. First, at odd causal shapes with more tiles than SMs, the scheduled pass's
gradients against a program a tile's (bitwise). Then deterministic forward+backward TFLOP/s, best of 3 shuffled rounds
of triton.testing.do_bench, cuDNN in the same rounds, (B, 32, L, 64) bf16, B*L = 16384.

    python benchmarks/experiments/attention_det_persistent_causal.py
"""
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

TILE, SCHEDULED = ((64, False),), ((64, False), (64, True))
hopper.MIN_FLOPS = 0
KEPT_MIN_KEYS = dict(hopper.WS_DKDV_MIN_KEYS)
hopper.WS_DKDV_MIN_KEYS = dict.fromkeys(KEPT_MIN_KEYS, 0)  # the small shapes below take the warp-specialized pass


def grads(q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    with fl.use_deterministic_attention(True):
        fl.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True).backward(g)
    return [t.grad.clone() for t in (q, k, v)]


for B, H, H_kv, L in [(3, 4, 4, 2050), (8, 8, 2, 1100), (1, 16, 16, 3001)]:
    q = torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16)
    hopper.WS_DKDV_PERSISTENT = SCHEDULED
    sched = grads(q, k, v, g)
    hopper.WS_DKDV_PERSISTENT = TILE
    tile = grads(q, k, v, g)
    print(f"B{B} H{H}/{H_kv} L{L} causal: scheduled equal to a program a tile "
          f"{[torch.equal(x, y) for x, y in zip(sched, tile, strict=True)]}", flush=True)
hopper.WS_DKDV_MIN_KEYS = KEPT_MIN_KEYS


def best(steps, args):
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


for L in (2048, 4096, 16384):
    B, H, D = 16384 // L, 32, 64
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def cudnn(q=q, k=k, v=v, g=g):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)

    def det(routing, q=q, k=k, v=v, g=g):
        def run():
            hopper.WS_DKDV_PERSISTENT = routing
            with fl.use_deterministic_attention(True):
                fl.scaled_dot_product_attention(q, k, v, is_causal=True).backward(g)
        return run
    res = best({"scheduled": det(SCHEDULED), "tile": det(TILE), "cudnn": cudnn}, [q, k, v])
    flops = 3.5 * 4 * B * H * L * L * D / 2
    print(f"D{D} L{L} causal: scheduled/tile={res['tile'] / res['scheduled']:.3f} "
          f"scheduled/cudnn={res['cudnn'] / res['scheduled']:.3f} tile/cudnn={res['cudnn'] / res['tile']:.3f} | "
          + " ".join(f"{n}={flops / ms * 1e-9:.0f}" for n, ms in res.items()), flush=True)
