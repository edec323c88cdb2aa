"""Experiment (H200, run from the repo root at 5c71b0b): deterministic-mode forward+backward with the one-warpgroup
dK/dV pass ("owg") against the warp-specialized one ("ws": WS_DKDV_STAGES as routed; "ws3"/"ws4": 3 or 4 stages),
dense (B, H, L, D) bf16 inputs, B*L = 16384, H*D = 2048, best of 3 shuffled rounds of triton.testing.do_bench;
prints MISMATCH where a variant's gradients differ from the first by more than 2e-2 of the largest.

    python benchmarks/experiments/attention_deterministic_dkdv_dense.py
"""
import itertools
import random

import torch
import triton

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

torch.backends.cuda.matmul.allow_tf32 = True
rows = []
variants = {"owg": (False, None), "ws": (True, None), "ws4": (True, 4), "ws3": (True, 3)}
results = {}
_orig = hopper.ws_dkdv_applies
for D, L, causal in itertools.product((64, 128), (2048, 4096, 16384), (False, True)):
    if D == 128 and causal:
        vs = ["owg", "ws3", "ws4"]
    elif D == 128:
        vs = ["owg", "ws3", "ws4"]
    else:
        vs = ["owg", "ws", "ws3"]
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    def step():
        out = fl.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(g)
    ref = None
    for r in range(3):
        order = list(vs); random.shuffle(order)
        for name in order:
            on, st = variants[name]
            hopper.ws_dkdv_applies = (lambda q_, k_, c, dense: dense) if on else (lambda *a: False)
            if st:
                hopper.WS_DKDV_STAGES = {64: st, 128: st}
            else:
                hopper.WS_DKDV_STAGES = {64: 4, 128: 3}
            with fl.use_deterministic_attention(True):
                q.grad = k.grad = v.grad = None
                step()
                if r == 0:
                    grads = [t.grad.clone() for t in (q, k, v)]
                    step_grads = grads
                    if ref is None:
                        ref = grads
                    else:
                        err = max(((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(grads, ref))
                        if err > 2e-2:
                            print("MISMATCH", D, L, causal, name, err)
                ms = triton.testing.do_bench(step, warmup=25, rep=100, grad_to_none=[q, k, v])
            key = (D, L, causal, name)
            results[key] = min(results.get(key, 1e9), ms)
    line = f"D{D} L{L} {'causal' if causal else 'full  '} " + " ".join(f"{n}={results[(D, L, causal, n)]:.3f}" for n in vs)
    base = results[(D, L, causal, 'owg')]
    line += "  | " + " ".join(f"{n}/owg={base / results[(D, L, causal, n)]:.3f}" for n in vs[1:])
    print(line, flush=True)
