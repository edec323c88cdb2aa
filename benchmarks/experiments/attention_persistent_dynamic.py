"""Experiment (H200, run from the repo root): the one pass (and the deterministic mode's warp-specialized dK/dV
pass) with one program an SM looping over tiles, dealt statically (every num_programs-th tile) or dynamically (the
next tile from a global counter), against a program a tile. First, at odd shapes, each variant's gradients against
a program a tile's: dK and dV bitwise equal (a tile sums its steps in the same order), dQ within the unordered sums'
rounding in the default mode and bitwise equal in the deterministic one. Then forward+backward TFLOP/s, best of 3
shuffled rounds of triton.testing.do_bench, cuDNN in the same rounds, (B, H, L, D) bf16, B*L = 16384, H*D = 2048.

    python benchmarks/experiments/attention_persistent_dynamic.py
"""
import itertools
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

VARIANTS = {"tile": None, "static": "static", "dynamic": "dynamic"}


def grads(q, k, v, g, causal):
    for t in (q, k, v):
        t.grad = None
    fl.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).backward(g)
    return [t.grad.clone() for t in (q, k, v)]


shapes = [(1, 8, 2, 3001, 3001), (2, 4, 1, 2050, 2050), (3, 4, 4, 1100, 1100), (1, 2, 2, 130, 4100)]
for D, causal, det, (B, H, H_kv, L, S) in itertools.product((64, 128), (False, True), (False, True), shapes):
    if causal and L != S:
        continue
    torch.manual_seed(0)
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    got = {}
    with fl.use_deterministic_attention(det):
        for name, mode in VARIANTS.items():
            hopper.ONE_PASS_PERSISTENT = mode
            got[name] = grads(q, k, v, g, causal)
    hopper.ONE_PASS_PERSISTENT = None
    base = got["tile"]
    line = []
    for name in ("static", "dynamic"):
        dq, dk, dv = got[name]
        err = ((dq.double() - base[0].double()).abs().max() / base[0].double().abs().max()).item()
        line.append(f"{name}: dK dV equal {torch.equal(dk, base[1]) and torch.equal(dv, base[2])}, "
                    f"dQ equal {torch.equal(dq, base[0])} (rel diff {err:.1e})")
    print(f"D{D} causal={causal} det={det} B{B} H{H}/{H_kv} L{L} S{S}: " + "; ".join(line), flush=True)


def best(steps, args):
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


def variant(mode, det, fn):
    def run():
        hopper.ONE_PASS_PERSISTENT = mode
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
    steps = {(f"det-{n}" if det else n): variant(m, det, fused) for det in (False, True) for n, m in VARIANTS.items()}
    res = best(steps | {"cudnn": cudnn}, [q, k, v])
    hopper.ONE_PASS_PERSISTENT = None
    flops = 3.5 * 4 * B * H * L * L * D / (2 if causal else 1)
    out = []
    for p in ("", "det-"):
        out.append(" ".join(f"{p}{n}/{p}tile={res[p + 'tile'] / res[p + n]:.3f}" for n in ("static", "dynamic"))
                   + f" {p}tile/cudnn={res['cudnn'] / res[p + 'tile']:.3f}")
    print(f"D{D} L{L} causal={causal}: " + " | ".join(out) + " | TFLOP/s "
          + " ".join(f"{n}={flops / ms * 1e-9:.0f}" for n, ms in res.items()), flush=True)
