"""Experiment (H200, run from the repo root): the one pass's fp32 dQ_part tile in shared memory with a 32-byte swizzle
("s32": DQ_SWIZZLE = 32; a warp's row pairs then fall in distinct banks, the TMA adding it in 8 boxes of 8 columns)
against the 128-byte swizzle ("s128", the tile's default: the rows r and r ^ 1 of a half-warp's store share banks,
2 boxes), and cuDNN: forward+backward TFLOP/s, best of 3 shuffled rounds of triton.testing.do_bench, (B, H, L, D) bf16,
B*L = 16384, H*D = 2048, D 64 and 128; then 16K tokens as packed documents (varlen, causal). First, each variant's
gradients against float64 at odd shapes (GQA, ragged lengths), beside the deterministic mode's.

    python benchmarks/experiments/attention_dq_swizzle.py
"""
import itertools
import random
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

sys.path.insert(0, "benchmarks")
from bench_varlen_attention import document_lengths  # noqa: E402

VARIANTS = {"s32": 32, "s128": 128}


def grads(fn, q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(g)
    return [t.grad.double() for t in (q, k, v)]


def rel_err(got, ref):
    return max(((x - r).abs().max() / r.abs().max()).item() for x, r in zip(got, ref, strict=True))


def reference(q, k, v, causal, cap):
    """float64 attention with GQA, a causal mask and a soft-cap, as the fused op defines them."""
    q, k, v = q.double(), k.double(), v.double()
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if cap:
        s = cap * torch.tanh(s / cap)
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    return s.softmax(-1) @ v


def ours(name, fn):
    def run():
        hopper.DQ_SWIZZLE = VARIANTS[name]
        fn()
    return run


def best(steps, args):
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


for D in (64, 128):
    for B, H, H_kv, L, S, causal, cap in [(2, 4, 2, 1030, 1030, True, 0.0), (1, 4, 4, 130, 4100, False, 0.0),
                                          (1, 8, 2, 3001, 3001, False, 0.0), (2, 2, 1, 2048, 2048, True, 30.0)]:
        if cap and D == 128:
            continue
        q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k, v = (torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
        g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

        def fused(a, b, c, causal=causal, cap=cap):
            return fl.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True, softcap=cap)
        ref = grads(lambda a, b, c, causal=causal, cap=cap: reference(a, b, c, causal, cap), q, k, v, g.double())
        errs = {}
        for name, swz in VARIANTS.items():
            hopper.DQ_SWIZZLE = swz
            errs[name] = rel_err(grads(fused, q, k, v, g), ref)
        with fl.use_deterministic_attention(True):
            errs["det"] = rel_err(grads(fused, q, k, v, g), ref)
        print(f"D{D} B{B} H{H}/{H_kv} L{L} S{S} causal={causal} softcap={cap}: error vs float64 " + " ".join(
            f"{n}={e:.2e}" for n, e in errs.items()), flush=True)

for D, L, causal in itertools.product((64, 128), (2048, 4096, 16384), (False, True)):
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def cudnn(q=q, k=k, v=v, g=g, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)

    def fused(q=q, k=k, v=v, g=g, causal=causal):
        fl.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
    res = best({"s32": ours("s32", fused), "s128": ours("s128", fused), "cudnn": cudnn}, [q, k, v])
    flops = 3.5 * 4 * B * H * L * L * D / (2 if causal else 1)
    print(f"D{D} L{L} {'causal' if causal else 'full'}: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}"
                                                                     for n, ms in res.items())
          + f" | s32/s128={res['s128'] / res['s32']:.3f} s32/cudnn={res['cudnn'] / res['s32']:.3f}"
          f" s128/cudnn={res['cudnn'] / res['s128']:.3f}", flush=True)

lens = document_lengths(16384)
cu = torch.tensor([0] + list(itertools.accumulate(lens)), device="cuda", dtype=torch.int32)
for D in (64, 128):
    qp, kp, vp = (torch.randn(16384, 2048 // D, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                  for _ in range(3))
    gp = torch.randn(16384, 2048 // D, D, device="cuda", dtype=torch.bfloat16)

    def packed(qp=qp, kp=kp, vp=vp, gp=gp):
        fl.varlen_attention(qp, kp, vp, cu, cu, max(lens), max(lens), is_causal=True).backward(gp)
    res = best({"s32": ours("s32", packed), "s128": ours("s128", packed)}, [qp, kp, vp])
    print(f"D{D} 16K packed documents ({len(lens)}) causal: s32/s128={res['s128'] / res['s32']:.3f} "
          f"(s32 {res['s32']:.3f} ms, s128 {res['s128']:.3f} ms)", flush=True)
