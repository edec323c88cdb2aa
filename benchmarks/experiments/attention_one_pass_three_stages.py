"""Experiment, not routed: the D128 one-pass backward with a 3-deep Q/dO ring and one dS^T buffer (freed by a barrier
once both warpgroups' dQ_part products have read it) against the kept 2-deep ring and two dS^T buffers, which is
what fits in shared memory with 3 stages (231 KB). Backward kernels alone (statistics pass, one pass, dQ's
conversion), do_bench medians, best of 3 shuffled rounds; gradients compared with the kept kernel's.

    python benchmarks/experiments/attention_one_pass_three_stages.py     # GPU (Hopper)
"""
import random

import torch
from triton.testing import do_bench

from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hk
from fusedlayers.kernels import cdiv, launch
from fusedlayers.kernels import scaled_dot_product_attention as K


def setup(B, H, H_kv, L, D, causal):
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H_kv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    scale = D ** -0.5
    out = torch.empty_like(q)
    lse = torch.empty((B, H, L), device="cuda", dtype=torch.float32)
    K.attention_forward(q, k, v, None, None, causal, scale, out, lse)
    qk_scale = K._exponent_scale(q.dtype, scale)
    l_pad = cdiv(L, 64) * 64

    def backward(stages, ds_buffers):
        stats = torch.empty((2, B * H, l_pad), dtype=torch.float32, device="cuda")
        lse2, delta = stats.unbind()
        dq32 = torch.empty((B * H, L, D), dtype=torch.float32, device="cuda")
        launch(K._bwd_preprocess_kernel, (cdiv(l_pad, 64), B * H), out, do, delta, lse, lse2, dq32, *out.stride(),
               *do.stride(), H, L, D, l_pad, BLOCK_M=64, BLOCK_DV=D, LSE2=True)
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        hk.attention_backward(q, k, v, do, stats, dq32, causal, qk_scale, scale, dq, dk, dv, stages=stages,
                              ds_buffers=ds_buffers)
        return dq, dk, dv

    return backward


def errors(new, ref):
    return [((a.float() - b.float()).abs().max() / b.float().abs().max()).item() for a, b in zip(new, ref, strict=True)]


for B, H, H_kv, L, causal in [(2, 8, 2, 1000, False), (2, 8, 2, 1000, True), (1, 6, 3, 2111, True)]:
    backward = setup(B, H, H_kv, L, 128, causal)
    errs = errors(backward(3, 1), backward(2, 2))
    print(f"check B{B} H{H}/{H_kv} L{L} causal={causal}: dq dk dv {errs[0]:.1e} {errs[1]:.1e} {errs[2]:.1e}",
          flush=True)

for L in (2048, 4096, 16384):
    for causal in (False, True):
        B, H = 16384 // L, 16
        backward = setup(B, H, H, L, 128, causal)
        fns = {"kept": lambda: backward(2, 2), "three": lambda: backward(3, 1)}
        best = {n: float("inf") for n in fns}
        for _ in range(3):
            names = list(fns)
            random.shuffle(names)
            for n in names:
                best[n] = min(best[n], do_bench(fns[n], warmup=25, rep=100))
        flops = 2.5 * 4 * B * H * L * L * 128 * (0.5 if causal else 1.0)
        print(f"D128 L{L} {'causal' if causal else 'dense '}: backward TFLOP/s kept {flops / best['kept'] / 1e9:.0f} "
              f"three {flops / best['three'] / 1e9:.0f} | three/kept {best['kept'] / best['three']:.3f}", flush=True)
        torch.cuda.empty_cache()
