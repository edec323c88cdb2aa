"""Experiment (H200, run from the repo root): the one pass (default mode) and the warp-specialized dK/dV pass
(deterministic mode) on dense calls not causal with persistent programs, one an SM ("persistent":
``one_pass_persistent`` True) against a program a tile ("grid": False), and cuDNN: forward+backward TFLOP/s, best of 3
shuffled rounds of triton.testing.do_bench, (B, H, L, D) bf16 inputs, B*L = 16384, H*D = 2048, D 64 and 128. First,
gradients against float64 at odd shapes (GQA, ragged lengths, fewer tiles than SMs) in both variants and modes, and
the deterministic mode's gradients bitwise repeated.

    python benchmarks/experiments/attention_persistent.py
"""
import itertools
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

VARIANTS = {"persistent": True, "grid": False}


def grads(fn, q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(g)
    return [t.grad.clone() for t in (q, k, v)]


def rel_err(got, ref):
    return max(((x.double() - r).abs().max() / r.abs().max()).item() for x, r in zip(got, ref, strict=True))


def attend(a, b, c):
    return fl.scaled_dot_product_attention(a, b, c, enable_gqa=True)


for D, (B, H, H_kv, L, S) in itertools.product((64, 128), [(1, 4, 4, 130, 4100), (1, 8, 2, 3001, 3001),
                                                         (2, 4, 1, 2048, 2048), (3, 16, 16, 2100, 2100)]):
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    F.scaled_dot_product_attention(q.double(), k.double(), v.double(), enable_gqa=True).backward(g.double())
    ref = [t.grad.double() for t in (q, k, v)]
    errs = {}
    for name, flag in VARIANTS.items():
        hopper.one_pass_persistent = flag
        errs[name] = rel_err(grads(attend, q, k, v, g), ref)
        with fl.use_deterministic_attention(True):
            first = grads(attend, q, k, v, g)
            again = grads(attend, q, k, v, g)
        errs[name + " det"] = rel_err(first, ref)
        assert all(torch.equal(x, y) for x, y in zip(first, again, strict=True)), (name, "det not repeatable")
    print(f"D{D} B{B} H{H}/{H_kv} L{L} S{S}: error vs float64 " + " ".join(f"{n}={e:.2e}" for n, e in errs.items()),
          flush=True)


def best(steps, args):
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


def ours(flag, det, fn):
    def run():
        hopper.one_pass_persistent = flag
        with fl.use_deterministic_attention(det):
            fn()
    return run


for D, L in itertools.product((64, 128), (2048, 4096, 16384)):
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def cudnn(q=q, k=k, v=v, g=g):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v).backward(g)

    def fused(q=q, k=k, v=v, g=g):
        fl.scaled_dot_product_attention(q, k, v).backward(g)
    steps = {"cudnn": cudnn}
    for (name, flag), det in itertools.product(VARIANTS.items(), (False, True)):
        steps[name + (" det" if det else "")] = ours(flag, det, fused)
    res = best(steps, [q, k, v])
    flops = 3.5 * 4 * B * H * L * L * D
    print(f"D{D} L{L}: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}" for n, ms in res.items())
          + f" | persistent/grid={res['grid'] / res['persistent']:.3f}"
          f" det={res['grid det'] / res['persistent det']:.3f}"
          f" | /cudnn persistent={res['cudnn'] / res['persistent']:.3f} grid={res['cudnn'] / res['grid']:.3f}"
          f" persistent det={res['cudnn'] / res['persistent det']:.3f} grid det={res['cudnn'] / res['grid det']:.3f}",
          flush=True)
