"""Experiment, not routed: the one-pass backward without its dQ product and reduction (``no_dq=True``: a
warp-specialized dK/dV pass, TMA producer and two consumer warpgroups) against the deterministic mode's Gluon dK/dV
pass, backward kernels alone (do_bench medians, best of 3 shuffled rounds), dK and dV compared.

    python benchmarks/experiments/attention_dkdv_warp_specialized.py     # GPU (Hopper)
"""
import random

import torch
from triton.testing import do_bench

from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hk
from fusedlayers.kernels import cdiv, launch
from fusedlayers.kernels import scaled_dot_product_attention as K


def setup(D, L, causal):
    B, H = 16384 // L, 2048 // D
    q, k, v, do = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = D ** -0.5
    out = torch.empty_like(q)
    lse = torch.empty((B, H, L), device="cuda", dtype=torch.float32)
    K.attention_forward(q, k, v, None, None, causal, scale, out, lse)
    delta = (do.float() * out.float()).sum(-1).contiguous()
    qk_scale = K._exponent_scale(q.dtype, scale)
    l_pad = cdiv(L, 64) * 64
    stats = torch.empty((2, B * H, l_pad), dtype=torch.float32, device="cuda")
    lse2, delta2 = stats.unbind()
    dq32 = torch.empty((B * H, L, D), dtype=torch.float32, device="cuda")
    launch(K._bwd_preprocess_kernel, (cdiv(l_pad, 64), B * H), out, do, delta2, lse, lse2, dq32, *out.stride(),
           *do.stride(), H, L, D, l_pad, BLOCK_M=64, BLOCK_DV=D, LSE2=True)
    dk, dv, dk2, dv2, dq = (torch.empty_like(q) for _ in range(5))

    def shipped():
        hk.attention_backward_dkdv(q, k, v, do, lse, delta, causal, qk_scale, scale, dk, dv)

    def nodq(stages=None):
        def f():
            hk.STAGES_OVERRIDE = stages
            hk.attention_backward(q, k, v, do, stats, dq32, causal, qk_scale, scale, dq, dk2, dv2, no_dq=True)
        return f

    flops = 4 * 2 * B * H * L * L * D * (0.5 if causal else 1.0)
    return shipped, nodq, (dk, dv, dk2, dv2), flops


rows = [(D, L, c) for D in (64, 128) for L in (2048, 4096, 16384) for c in (False, True)]
for D, L, c in rows:
    shipped, nodq, (dk, dv, dk2, dv2), flops = setup(D, L, c)
    fns = {"shipped": shipped, "nodq": nodq()}
    fns["nodq3"] = nodq(3)
    for f in fns.values():
        f()
    torch.cuda.synchronize()
    shipped()
    ref = (dk.clone(), dv.clone())
    fns["nodq"]()
    errs = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
            for a, b in zip((dk2, dv2), ref, strict=True)]
    best = {n: float("inf") for n in fns}
    for _ in range(3):
        names = list(fns)
        random.shuffle(names)
        for n in names:
            best[n] = min(best[n], do_bench(fns[n], warmup=25, rep=100))
    cells = " ".join(f"{n} {flops / best[n] / 1e9:.0f}" for n in fns)
    print(f"D{D} L{L} {'causal' if c else 'dense '}: TFLOP/s {cells} | "
          f"nodq/shipped {best['shipped'] / best['nodq']:.3f} nodq3/shipped {best['shipped'] / best['nodq3']:.3f} | "
          f"err dk dv {errs[0]:.1e} {errs[1]:.1e}", flush=True)
    torch.cuda.empty_cache()
