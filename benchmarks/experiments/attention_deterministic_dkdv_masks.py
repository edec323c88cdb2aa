"""Experiment (H200, run from the repo root): as attention_deterministic_dkdv_dense.py on the masks of
bench_varlen_attention.py (16384 tokens, H*D = 2048: packed documents, windows of 1024 and 4096 keys, soft-cap 50
causal and not; "ws2"/"ws3"/"ws4": the warp-specialized dK/dV with that many stages, routed to every call) and on
dense causal D128 at L 2K-16K.

    python benchmarks/experiments/attention_deterministic_dkdv_masks.py
"""
import itertools
import random
import sys

import torch
import triton

sys.path.insert(0, "benchmarks")
from bench_varlen_attention import SOFTCAP, document_lengths

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

n = 16384
lens = document_lengths(n)
cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
longest = max(lens)
CASES = [("packed", dict(causal=True, docs=True)), ("window1024", dict(causal=True, left=1024)),
         ("window4096", dict(causal=True, left=4096)), ("softcap causal", dict(causal=True, cap=SOFTCAP)),
         ("softcap", dict(causal=False, cap=SOFTCAP))]
VARIANTS = {64: ["owg", "ws2", "ws4"], 128: ["owg", "ws2", "ws3"]}


def run_case(D, name, fn, inputs, vs):
    g = torch.randn_like(fn(*inputs))
    def step():
        fn(*inputs).backward(g)
    res, ref = {}, None
    for r in range(3):
        order = list(vs); random.shuffle(order)
        for v in order:
            on = v != "owg"
            hopper.ws_dkdv_applies = (lambda *a: True) if on else (lambda *a: False)
            if on:
                st = int(v[2:]); hopper.WS_DKDV_STAGES = {64: st, 128: st}
            with fl.use_deterministic_attention(True):
                if r == 0:
                    for t in inputs: t.grad = None
                    step()
                    grads = [t.grad.float().clone() for t in inputs]
                    if ref is None: ref = grads
                    else:
                        err = max(((a - b).abs().max() / b.abs().max()).item() for a, b in zip(grads, ref))
                        if err > 1e-2: print("MISMATCH", D, name, v, err)
                ms = triton.testing.do_bench(step, warmup=20, rep=100, grad_to_none=list(inputs))
            res[v] = min(res.get(v, 1e9), ms)
    base = res["owg"]
    print(f"D{D} {name:16s} " + " ".join(f"{v}={res[v]:.3f}" for v in vs) + "  | "
          + " ".join(f"{v}/owg={base / res[v]:.3f}" for v in vs[1:]), flush=True)


for D in (64, 128):
    h = 2048 // D
    for name, c in CASES:
        q, k, v = (torch.randn(n, h, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
        window = (c["left"], 0) if "left" in c else (-1, -1)
        cu_, lo = (cu, longest) if c.get("docs") else (torch.tensor([0, n], dtype=torch.int32, device="cuda"), n)
        fn = lambda a, b, cc, cu_=cu_, lo=lo, c=c, window=window: fl.varlen_attention(
            a, b, cc, cu_, cu_, lo, lo, is_causal=c["causal"], window_size=window, softcap=c.get("cap", 0.0))
        run_case(D, name, fn, (q, k, v), VARIANTS[D])
for L in (2048, 4096, 16384):
    D, B, H = 128, 16384 // L, 16
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    run_case(D, f"dense causal {L}", lambda a, b, c: fl.scaled_dot_product_attention(a, b, c, is_causal=True),
             (q, k, v), ["owg", "ws2", "ws3"])
