"""Experiment (H200, run from the repo root): the deterministic mode's D128 dK/dV pass (warp-specialized) with the
two consumer warpgroups taking turns to issue their products (``WS_DKDV_PINGPONG``), against the shipped order, and
for causal and soft-capped calls against the one-warpgroup dK/dV pass they run today; cuDNN in the same rounds.
Forward+backward TFLOP/s, best of 3 shuffled rounds of triton.testing.do_bench, (B, H, L, 128) bf16, B*L = 16384,
H = 16. First, each variant's gradients at odd shapes against the shipped ones, each run twice.

    python benchmarks/experiments/attention_dkdv_pingpong.py
"""
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

shipped_applies = hopper.ws_dkdv_applies
# name: (ping-pong head dims, whether the warp-specialized pass runs wherever it can)
VARIANTS = {"shipped": ((), False), "pingpong": ((128,), False), "pingpong_all": ((128,), True),
            "turns_off_all": ((), True)}


def use(name):
    hopper.WS_DKDV_PINGPONG, everywhere = VARIANTS[name]
    hopper.ws_dkdv_applies = ((lambda q, k, is_causal, intervals, softcap: not intervals and k.shape[2] >= 2048)
                              if everywhere else shipped_applies)


def grads(q, k, v, g, **kw):
    for t in (q, k, v):
        t.grad = None
    fl.scaled_dot_product_attention(q, k, v, enable_gqa=True, **kw).backward(g)
    return [t.grad.clone() for t in (q, k, v)]


for L, S, causal in ((3001, 3001, False), (2100, 4100, False), (3001, 3001, True)):
    q = torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(1, 2, S, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16)
    with fl.use_deterministic_attention(True):
        use("shipped")
        ref = grads(q, k, v, g, is_causal=causal)
        for name in VARIANTS:
            use(name)
            a, b = grads(q, k, v, g, is_causal=causal), grads(q, k, v, g, is_causal=causal)
            diff = max(((x.float() - r.float()).abs().max() / r.float().abs().max()).item()
                       for x, r in zip(a, ref, strict=True))
            print(f"L{L} S{S} causal={causal} {name}: repeat equal "
                  f"{all(torch.equal(x, y) for x, y in zip(a, b, strict=True))}, "
                  f"largest difference from shipped {diff:.2e}", flush=True)

for L, causal, softcap in ((2048, False, 0), (4096, False, 0), (16384, False, 0), (2048, True, 0), (4096, True, 0),
                           (16384, True, 0), (16384, False, 50.0)):
    B, H = 16384 // L, 16
    q, k, v = (torch.randn(B, H, L, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, 128, device="cuda", dtype=torch.bfloat16)
    kw = {"is_causal": causal} | ({"softcap": softcap} if softcap else {})

    def ours(name, q=q, k=k, v=v, g=g, kw=kw):
        def run():
            use(name)
            with fl.use_deterministic_attention(True):
                fl.scaled_dot_product_attention(q, k, v, **kw).backward(g)
        return run

    def cudnn(q=q, k=k, v=v, g=g, causal=causal):
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
    steps = {n: ours(n) for n in VARIANTS} | ({} if softcap else {"cudnn": cudnn})
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            res[name] = min(res.get(name, 1e9), triton.testing.do_bench(steps[name], warmup=25, rep=100,
                                                                        grad_to_none=[q, k, v]))
    flops = 3.5 * 4 * B * H * L * L * 128 / (2 if causal else 1)
    print(f"D128 L{L} causal={causal} softcap={softcap} deterministic: "
          + " ".join(f"{n}={flops / ms * 1e-9:.0f}" for n, ms in res.items())
          + " | " + " ".join(f"{n}/shipped={res['shipped'] / res[n]:.3f}" for n in VARIANTS if n != "shipped")
          + (f" shipped/cudnn={res['cudnn'] / res['shipped']:.3f} pingpong/cudnn={res['cudnn'] / res['pingpong']:.3f}"
             if "cudnn" in res else ""), flush=True)
use("shipped")
