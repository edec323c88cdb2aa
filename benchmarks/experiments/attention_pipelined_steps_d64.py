"""Experiment (H200, run from the repo root): the pipelined single steps of ``attention_pipelined_steps.py`` at D64.
Dense calls: the shipped step pairs against pipelined single steps, in the default mode (dQ formed) and the
deterministic mode's dK/dV pass, against cuDNN; key intervals (a causal 1024-key window, packed documents) and the
soft-cap (16K tokens, H 32): the shipped single steps against pipelined ones, and in the deterministic mode the
one-warpgroup dK/dV pass (shipped there) against the pipelined warp-specialized one. Best of 3 shuffled rounds of
triton.testing.do_bench, bf16, B*L = 16384, H*D = 2048. First, each variant's gradients against float64 at odd
shapes, the deterministic ones run twice.

    python benchmarks/experiments/attention_pipelined_steps_d64.py
"""
import itertools
import random
import sys

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers import backend
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

sys.path.insert(0, "benchmarks")
from bench_varlen_attention import document_lengths  # noqa: E402

SHIPPED_WS_APPLIES = hopper.ws_dkdv_applies


def ws_everywhere(q, k, is_causal, intervals, softcap):
    return hopper.ws_dkdv_enabled and k.shape[2] >= hopper.WS_DKDV_MIN_KEYS


# name: (deterministic, ONE_PASS_STEP_PAIRS, ONE_PASS_PIPELINED, WS_DKDV_PIPELINED, ws_dkdv_applies)
VARIANTS = {
    "shipped": (False, (64,), (), (), SHIPPED_WS_APPLIES),
    "piped": (False, (), (64,), (64,), SHIPPED_WS_APPLIES),
    "det shipped": (True, (64,), (), (), SHIPPED_WS_APPLIES),
    "det piped": (True, (), (64,), (64,), ws_everywhere),
}


def use(name):
    det, pairs, one_pass, ws, applies = VARIANTS[name]
    hopper.ONE_PASS_STEP_PAIRS, hopper.ONE_PASS_PIPELINED, hopper.WS_DKDV_PIPELINED = pairs, one_pass, ws
    hopper.ws_dkdv_applies = applies
    backend._deterministic_attention = det  # what ``fl.use_deterministic_attention`` sets, for the whole call


def grads(fn, q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(g)
    return [t.grad.clone() for t in (q, k, v)]


def rel_err(got, ref):
    return max(((x.double() - r).abs().max() / r.abs().max()).item() for x, r in zip(got, ref, strict=True))


def reference(a, b, c, causal, window, cap):
    L, S, D, rep = a.shape[2], b.shape[2], a.shape[3], a.shape[1] // b.shape[1]
    s = (a @ b.repeat_interleave(rep, 1).transpose(-1, -2)) * D**-0.5
    if cap:
        s = cap * torch.tanh(s / cap)
    i = torch.arange(L, device="cuda")[:, None]
    j = torch.arange(S, device="cuda")[None, :]
    keep = torch.ones(L, S, dtype=torch.bool, device="cuda")
    if causal:
        keep &= j <= i
    if window:
        keep &= j >= i - window
    return s.masked_fill(~keep, -float("inf")).softmax(-1) @ c.repeat_interleave(rep, 1)


SHAPES = [(2, 4, 2, 2100, True, 0, 0.0), (1, 8, 2, 3001, False, 0, 0.0), (1, 4, 4, 2500, True, 300, 0.0),
          (1, 4, 2, 2500, False, 0, 30.0), (2, 2, 1, 2048, True, 0, 30.0)]
for B, H, H_kv, L, causal, window, cap in SHAPES:
    q = torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16)
    ref = grads(lambda a, b, c: reference(a.double(), b.double(), c.double(), causal, window, cap), q, k, v,
                g.double())
    extra = ({"softcap": cap} if cap else {}) | ({"window_size": (window, 0)} if window else {})
    line = []
    for name in VARIANTS:
        use(name)

        def ours(a, b, c):
            return fl.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True, **extra)
        first = grads(ours, q, k, v, g)
        again = "" if not VARIANTS[name][0] else (
            " (repeat equal)" if all(torch.equal(x, y) for x, y in zip(first, grads(ours, q, k, v, g), strict=True))
            else " (REPEAT DIFFERS)")
        line.append(f"{name}={rel_err(first, ref):.2e}{again}")
    print(f"B{B} H{H}/{H_kv} L{L} causal={causal} window={window} cap={cap}: error vs float64 " + ", ".join(line),
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


def variant(name, fn):
    def run():
        use(name)
        fn()
    return run


def row(label, res, flops=None):
    pairs = [("piped", "shipped"), ("det piped", "det shipped")] + (
        [("piped", "cudnn"), ("shipped", "cudnn"), ("det piped", "cudnn"), ("det shipped", "cudnn")]
        if "cudnn" in res else [])
    print(f"{label}: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}" if flops else f"{n}={ms:.3f} ms"
                                  for n, ms in sorted(res.items()))
          + " | " + " ".join(f"{a}/{b}={res[b] / res[a]:.3f}" for a, b in pairs), flush=True)


for L, causal in itertools.product((2048, 4096, 16384), (False, True)):
    B, H = 16384 // L, 32
    q, k, v = (torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16)

    def cudnn(q=q, k=k, v=v, g=g, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)

    def fused(q=q, k=k, v=v, g=g, causal=causal):
        fl.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
    res = best({n: variant(n, fused) for n in VARIANTS} | {"cudnn": cudnn}, [q, k, v])
    row(f"D64 L{L} {'causal' if causal else 'full'}", res, 3.5 * 4 * B * H * L * L * 64 / (2 if causal else 1))

# 16K tokens, H 32: a causal 1024-key window, the soft-cap (causal and not), packed documents (varlen, causal)
q, k, v = (torch.randn(1, 32, 16384, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(1, 32, 16384, 64, device="cuda", dtype=torch.bfloat16)
for label, kwargs in [("window 1024 causal", {"is_causal": True, "window_size": (1024, 0)}),
                      ("soft-cap 30 causal", {"is_causal": True, "softcap": 30.0}),
                      ("soft-cap 30", {"softcap": 30.0})]:
    def masked(kwargs=kwargs):
        fl.scaled_dot_product_attention(q, k, v, **kwargs).backward(g)
    res = best({n: variant(n, masked) for n in VARIANTS}, [q, k, v])
    row(f"D64 16K {label}", res)
lens = document_lengths(16384)
cu = torch.tensor([0] + list(itertools.accumulate(lens)), device="cuda", dtype=torch.int32)
qp, kp, vp = (torch.randn(16384, 32, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
gp = torch.randn(16384, 32, 64, device="cuda", dtype=torch.bfloat16)


def packed():
    fl.varlen_attention(qp, kp, vp, cu, cu, max(lens), max(lens), is_causal=True).backward(gp)


res = best({n: variant(n, packed) for n in VARIANTS}, [qp, kp, vp])
row(f"D64 16K packed documents ({len(lens)}) causal", res)
use("shipped")
backend._deterministic_attention = None
