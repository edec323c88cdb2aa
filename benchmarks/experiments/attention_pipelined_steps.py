"""Experiment (H200, run from the repo root): single backward steps with the next step's S^T issued once this step's
dV has run and its dP^T once dK has ("pipelined"), against the shipped order (each step's products issued and waited
for within it). Default mode: the D128 one pass (ONE_PASS_PIPELINED = (128,) against ()), forward+backward against
cuDNN. Deterministic mode: the warp-specialized dK/dV pass (WS_DKDV_PIPELINED), D128 not causal as routed, D128
causal with that pass forced (against the one-warpgroup pass it runs today) and D64 soft-capped. Best of 3 shuffled
rounds of triton.testing.do_bench, (B, H, L, D) bf16, B*L = 16384, H*D = 2048; 16K tokens with a 1024-key causal
window and as packed documents. First, each variant's gradients against float64 at odd shapes, and the deterministic
variants run twice (bitwise equal or not).

    python benchmarks/experiments/attention_pipelined_steps.py
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
    return hopper.ws_dkdv_enabled and not intervals and not softcap and k.shape[2] >= hopper.WS_DKDV_MIN_KEYS


# name: (deterministic, ONE_PASS_PIPELINED, WS_DKDV_PIPELINED, ws_dkdv_applies)
VARIANTS = {
    "pipelined": (False, (128,), True, SHIPPED_WS_APPLIES),
    "shipped": (False, (), False, SHIPPED_WS_APPLIES),
    "det pipelined": (True, (128,), True, SHIPPED_WS_APPLIES),
    "det shipped": (True, (), False, SHIPPED_WS_APPLIES),
    "det ws pipelined": (True, (128,), True, ws_everywhere),
    "det ws shipped": (True, (), False, ws_everywhere),
}


def use(name):
    det, one_pass, ws, applies = VARIANTS[name]
    hopper.ONE_PASS_PIPELINED, hopper.WS_DKDV_PIPELINED, hopper.ws_dkdv_applies = one_pass, ws, applies
    backend._deterministic_attention = det  # what ``fl.use_deterministic_attention`` sets, for the whole call


def grads(fn, q, k, v, g):
    for t in (q, k, v):
        t.grad = None
    fn(q, k, v).backward(g)
    return [t.grad.clone() for t in (q, k, v)]


def rel_err(got, ref):
    return max(((x.double() - r).abs().max() / r.abs().max()).item() for x, r in zip(got, ref, strict=True))


SHAPES = [(2, 4, 2, 1030, 1030, 128, True, 0.0), (1, 4, 4, 130, 4100, 128, False, 0.0),
          (2, 2, 1, 2048, 2048, 128, True, 0.0), (1, 8, 2, 3001, 3001, 128, False, 0.0),
          (1, 4, 4, 2100, 2100, 128, False, 0.0), (1, 4, 2, 2500, 2500, 64, False, 30.0)]
for B, H, H_kv, L, S, D, causal, cap in SHAPES:
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def ref_attn(a, b, c):
        if cap:
            s = (a @ b.repeat_interleave(H // H_kv, 1).transpose(-1, -2)) * D**-0.5
            s = cap * torch.tanh(s / cap)
            if causal:
                s = s.masked_fill(torch.ones(L, S, dtype=torch.bool, device="cuda").tril().logical_not(), -float("inf"))
            return s.softmax(-1) @ c.repeat_interleave(H // H_kv, 1)
        return F.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True)

    ref = grads(lambda a, b, c: ref_attn(a.double(), b.double(), c.double()), q, k, v, g.double())
    line = []
    for name in VARIANTS:
        use(name)

        def ours(a, b, c):
            return fl.scaled_dot_product_attention(a, b, c, is_causal=causal, enable_gqa=True,
                                                   **({"softcap": cap} if cap else {}))
        first = grads(ours, q, k, v, g)
        again = "" if not VARIANTS[name][0] else (
            " (repeat equal)" if all(torch.equal(x, y) for x, y in zip(first, grads(ours, q, k, v, g), strict=True))
            else " (REPEAT DIFFERS)")
        line.append(f"{name}={rel_err(first, ref):.2e}{again}")
    print(f"B{B} H{H}/{H_kv} L{L} S{S} D{D} causal={causal} cap={cap}: error vs float64 " + ", ".join(line), flush=True)


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


def row(label, res, flops, pairs):
    print(f"{label}: " + " ".join(f"{n}={flops / ms * 1e-9:.0f}" for n, ms in sorted(res.items()))
          + " | " + " ".join(f"{a}/{b}={res[b] / res[a]:.3f}" for a, b in pairs), flush=True)


for D, L, causal in itertools.product((128, 64), (2048, 4096, 16384), (False, True)):
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    cap = 30.0 if D == 64 else 0.0

    def cudnn(q=q, k=k, v=v, g=g, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)

    def fused(q=q, k=k, v=v, g=g, causal=causal, cap=cap):
        fl.scaled_dot_product_attention(q, k, v, is_causal=causal, **({"softcap": cap} if cap else {})).backward(g)
    flops = 3.5 * 4 * B * H * L * L * D / (2 if causal else 1)
    if D == 128:
        names = ["pipelined", "shipped", "det pipelined", "det shipped"] + (["det ws pipelined"] if causal else [])
        res = best({n: variant(n, fused) for n in names} | {"cudnn": cudnn}, [q, k, v])
        row(f"D128 L{L} {'causal' if causal else 'full'}", res, flops,
            [("pipelined", "shipped"), ("pipelined", "cudnn"), ("shipped", "cudnn"), ("det pipelined", "det shipped"),
             ("det pipelined", "cudnn"), ("det shipped", "cudnn")]
            + ([("det ws pipelined", "det shipped")] if causal else []))
    else:  # soft-capped D64, deterministic: the single-step dK/dV pass
        res = best({n: variant(n, fused) for n in ("det pipelined", "det shipped")}, [q, k, v])
        row(f"D64 soft-cap 30 L{L} {'causal' if causal else 'full'}", res, flops,
            [("det pipelined", "det shipped")])

# 16K tokens, D128: a causal 1024-key window (B 1, H 16), and packed documents (varlen, causal)
q, k, v = (torch.randn(1, 16, 16384, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(1, 16, 16384, 128, device="cuda", dtype=torch.bfloat16)


def window(q=q, k=k, v=v, g=g):
    fl.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=(1024, 0)).backward(g)


res = best({n: variant(n, window) for n in ("pipelined", "shipped")}, [q, k, v])
print(f"D128 16K window 1024 causal: pipelined/shipped={res['shipped'] / res['pipelined']:.3f} "
      f"(pipelined {res['pipelined']:.3f} ms, shipped {res['shipped']:.3f} ms)", flush=True)
lens = document_lengths(16384)
cu = torch.tensor([0] + list(itertools.accumulate(lens)), device="cuda", dtype=torch.int32)
qp, kp, vp = (torch.randn(16384, 16, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
gp = torch.randn(16384, 16, 128, device="cuda", dtype=torch.bfloat16)


def packed():
    fl.varlen_attention(qp, kp, vp, cu, cu, max(lens), max(lens), is_causal=True).backward(gp)


res = best({n: variant(n, packed) for n in ("pipelined", "shipped")}, [qp, kp, vp])
print(f"D128 16K packed documents ({len(lens)}) causal: pipelined/shipped={res['shipped'] / res['pipelined']:.3f} "
      f"(pipelined {res['pipelined']:.3f} ms, shipped {res['shipped']:.3f} ms)", flush=True)
use("shipped")
backend._deterministic_attention = None
