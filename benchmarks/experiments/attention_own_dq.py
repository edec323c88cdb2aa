"""Experiment (H200, run from the repo root): the default mode's D64 one-pass backward with each consumer warpgroup
forming dQ_part over its own 64 keys and all head dims ("own": ONE_PASS_OWN_DQ = (64,); "own1": the same with a
step an iteration rather than step pairs) against both warpgroups'
keys and half the head dims each ("shared": ()), and cuDNN, forward+backward, best of 3 shuffled rounds of
triton.testing.do_bench. Dense (B, H, L, D) bf16 inputs, B*L = 16384, H*D = 2048; then bench_varlen_attention's
masks on 16384 tokens. Prints MISMATCH where own's gradients differ from shared's by more than 1e-2 of the largest.

    python benchmarks/experiments/attention_own_dq.py
"""
import itertools
import random
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, "benchmarks")
from bench_varlen_attention import SOFTCAP, document_lengths  # noqa: E402

import fusedlayers as fl  # noqa: E402
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper  # noqa: E402

# name: (ONE_PASS_OWN_DQ, ONE_PASS_STEP_PAIRS); "own1": own with a step an iteration
OWN = {"own": ((64,), (64,)), "shared": ((), (64,)), "own1": ((64,), ())}


def configure(name):
    hopper.ONE_PASS_OWN_DQ, hopper.ONE_PASS_STEP_PAIRS = OWN[name]


def compare(label, fn, inputs, names, flops):
    g = torch.randn_like(fn("own", *inputs))

    def step(name):
        def run():
            fn(name, *inputs).backward(g)
        return run
    res, grads = {}, {}
    for r in range(3):
        order = list(names)
        random.shuffle(order)
        for name in order:
            if r == 0 and name in OWN:
                for t in inputs:
                    t.grad = None
                step(name)()
                grads[name] = [t.grad.float().clone() for t in inputs]
            ms = triton.testing.do_bench(step(name), warmup=25, rep=100, grad_to_none=list(inputs))
            res[name] = min(res.get(name, 1e9), ms)
    err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads["own"], grads["shared"], strict=True))
    line = f"{label:28s} " + " ".join(f"{n}={flops / res[n] * 1e-9:.0f}" if flops else f"{n}={res[n]:.3f}ms"
                                      for n in names)
    line += f" | own/shared={res['shared'] / res['own']:.3f}"
    if "own1" in res:
        line += f" own1/shared={res['shared'] / res['own1']:.3f}"
    if "cudnn" in res:
        line += f" own/cudnn={res['cudnn'] / res['own']:.3f} shared/cudnn={res['cudnn'] / res['shared']:.3f}"
    print(line + (f"  MISMATCH {err:.2e}" if err > 1e-2 else f"  (diff {err:.1e})"), flush=True)


def dense(name, q, k, v, causal):
    if name == "cudnn":
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    configure(name)
    return fl.scaled_dot_product_attention(q, k, v, is_causal=causal)


D = 64
for L, causal in itertools.product((2048, 4096, 16384), (False, True)):
    B, H = 16384 // L, 2048 // D
    inputs = [torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    flops = 3.5 * 4 * B * H * L * L * D / (2 if causal else 1)
    compare(f"D64 L{L} {'causal' if causal else 'full'}", lambda n, *t, c=causal: dense(n, *t, c), inputs,
            ["own", "shared", "own1", "cudnn"], flops)

n = 16384
lens = document_lengths(n)
cu_docs = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
cu_one = torch.tensor([0, n], dtype=torch.int32, device="cuda")
CASES = [("packed", dict(causal=True, docs=True)), ("window1024", dict(causal=True, left=1024)),
         ("window4096", dict(causal=True, left=4096)), ("softcap causal", dict(causal=True, cap=SOFTCAP)),
         ("softcap", dict(causal=False, cap=SOFTCAP))]
for label, c in CASES:
    inputs = [torch.randn(n, 2048 // D, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)]
    cu, longest = (cu_docs, max(lens)) if c.get("docs") else (cu_one, n)
    window = (c["left"], 0) if "left" in c else (-1, -1)

    def masked(name, q, k, v, c=c, cu=cu, longest=longest, window=window):
        configure(name)
        return fl.varlen_attention(q, k, v, cu, cu, longest, longest, is_causal=c["causal"], window_size=window,
                                   softcap=c.get("cap", 0.0))
    compare(f"D64 {label}", masked, inputs, ["own", "shared"], None)
