"""Experiment (H200, run from the repo root): the default mode's D128 one pass with each step's dQ_part staged in
shared memory at its end and its TMA reduction (fence, barrier, issue) in the next step behind S^T and dP^T ("defer":
ONE_PASS_DQ_DEFER = (128,)) against staged and reduced within its step ("shipped": ()), and cuDNN: forward+backward
TFLOP/s, best of 3 shuffled rounds of triton.testing.do_bench, (B, H, L, D) bf16 inputs, B*L = 16384, H*D = 2048;
then 16K tokens with a 1024-key causal window and as packed documents (varlen, 64-4096 tokens, causal), defer
against shipped. First, each variant's gradients against float64 at odd shapes (GQA, ragged lengths, an odd step
count), beside the deterministic mode's.

    python benchmarks/experiments/attention_dq_defer.py
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

VARIANTS = {"defer": (128,), "shipped": ()}
D = 128


def grads(fn, q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(g)
    return [t.grad.double() for t in (q, k, v)]


def rel_err(got, ref):
    return max(((x - r).abs().max() / r.abs().max()).item() for x, r in zip(got, ref, strict=True))


for B, H, H_kv, L, S, causal in [(2, 4, 2, 1030, 1030, True), (1, 4, 4, 130, 4100, False), (2, 2, 1, 2048, 2048, True),
                                 (1, 8, 2, 3001, 3001, False)]:
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    ref = grads(lambda a, b, c: F.scaled_dot_product_attention(a.double(), b.double(), c.double(), is_causal=causal,
                                                               enable_gqa=True), q, k, v, g.double())
    errs = {}
    for name, flag in VARIANTS.items():
        hopper.ONE_PASS_DQ_DEFER = flag
        errs[name] = rel_err(grads(lambda a, b, c: fl.scaled_dot_product_attention(a, b, c, is_causal=causal,
                                                                                   enable_gqa=True), q, k, v, g), ref)
    with fl.use_deterministic_attention(True):
        errs["det"] = rel_err(grads(lambda a, b, c: fl.scaled_dot_product_attention(a, b, c, is_causal=causal,
                                                                                    enable_gqa=True), q, k, v, g), ref)
    print(f"B{B} H{H}/{H_kv} L{L} S{S} causal={causal}: error vs float64 " + " ".join(
        f"{n}={e:.2e}" for n, e in errs.items()), flush=True)


def best(steps, args):
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


def ours(name, fn):
    def run():
        hopper.ONE_PASS_DQ_DEFER = VARIANTS[name]
        fn()
    return run


for L, causal in itertools.product((2048, 4096, 16384), (False, True)):
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def cudnn(q=q, k=k, v=v, g=g, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)

    def fused(q=q, k=k, v=v, g=g, causal=causal):
        fl.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
    res = best({"defer": ours("defer", fused), "shipped": ours("shipped", fused), "cudnn": cudnn}, [q, k, v])
    flops = 3.5 * 4 * B * H * L * L * D / (2 if causal else 1)
    print(f"D128 L{L} {'causal' if causal else 'full'}: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}"
                                                                     for n, ms in res.items())
          + f" | defer/shipped={res['shipped'] / res['defer']:.3f} defer/cudnn={res['cudnn'] / res['defer']:.3f}"
          f" shipped/cudnn={res['cudnn'] / res['shipped']:.3f}", flush=True)

# 16K tokens: a causal 1024-key window (B 1, H 16), and packed documents (varlen, causal)
q, k, v = (torch.randn(1, 16, 16384, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(1, 16, 16384, D, device="cuda", dtype=torch.bfloat16)


def window(q=q, k=k, v=v, g=g):
    fl.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(1024, 0)).backward(g)


res = best({"defer": ours("defer", window), "shipped": ours("shipped", window)}, [q, k, v])
print(f"D128 16K window 1024 causal: defer/shipped={res['shipped'] / res['defer']:.3f} "
      f"(defer {res['defer']:.3f} ms, shipped {res['shipped']:.3f} ms)", flush=True)
lens = document_lengths(16384)
cu = torch.tensor([0] + list(itertools.accumulate(lens)), device="cuda", dtype=torch.int32)
qp, kp, vp = (torch.randn(16384, 16, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
gp = torch.randn(16384, 16, D, device="cuda", dtype=torch.bfloat16)


def packed():
    fl.varlen_attention(qp, kp, vp, cu, cu, max(lens), max(lens), is_causal=True).backward(gp)


res = best({"defer": ours("defer", packed), "shipped": ours("shipped", packed)}, [qp, kp, vp])
print(f"D128 16K packed documents ({len(lens)}) causal: defer/shipped={res['shipped'] / res['defer']:.3f} "
      f"(defer {res['defer']:.3f} ms, shipped {res['shipped']:.3f} ms)", flush=True)
