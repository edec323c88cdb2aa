"""Experiment (H200, run from the repo root): the one pass adding dQ_part as int64 fixed point (a fixed 2^32 scale,
for timing: integer sums are bitwise the same in any order) against its fp32 atomics, on the calls that add dQ_part by
fragment-order atomics (D128 not causal, D64 causal). Gradients of the int64 form against the fp32 one and three of its
calls against each other; then forward+backward TFLOP/s, best of 3 shuffled rounds of triton.testing.do_bench: fp32
one pass, int64 one pass, the deterministic mode's two passes, cuDNN; (B, H, L, D) bf16, B*L = 16384, H*D = 2048.

    python benchmarks/experiments/attention_int_dq_probe.py
"""
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper

torch.manual_seed(0)


def grads(q, k, v, g, causal, int_dq, det=False):
    hopper.one_pass_int_dq = int_dq
    with fl.use_deterministic_attention(det):
        q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
        fl.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True).backward(g)
    hopper.one_pass_int_dq = False
    return q.grad, k.grad, v.grad


for D, B, H, H_kv, L, causal in [(128, 2, 8, 2, 4097, False), (128, 3, 4, 4, 2111, False), (64, 2, 6, 3, 3001, True)]:
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, H_kv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    ref = grads(q, k, v, g, causal, False, det=True)
    runs = [grads(q, k, v, g, causal, True) for _ in range(3)]
    same = all(torch.equal(a, b) for r in runs[1:] for a, b in zip(runs[0], r, strict=True))
    err = [((a.float() - b.float()).abs().max() / b.float().abs().max()).item()
           for a, b in zip(runs[0], ref, strict=True)]
    print(f"D{D} B{B} H{H}/{H_kv} L{L} causal={causal}: int64 runs bitwise equal: {same}; "
          f"max rel diff to det dq/dk/dv {err[0]:.2e} {err[1]:.2e} {err[2]:.2e}", flush=True)

for fn in (hopper._attn_bwd_hopper,):
    for dev_cache in fn.device_caches.values():
        for key, kern in dev_cache[0].items():
            print("compiled", fn.__name__, getattr(kern, "n_regs", None), "regs", getattr(kern, "n_spills", None),
                  "spills", str(key)[:160], flush=True)


def best(steps, args):
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


for D, causal, L in [(128, False, 2048), (128, False, 4096), (128, False, 16384), (64, True, 2048), (64, True, 4096),
                     (64, True, 16384)]:
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def step(int_dq, det=False, cudnn=False, q=q, k=k, v=v, g=g, causal=causal):
        def run():
            hopper.one_pass_int_dq = int_dq
            with fl.use_deterministic_attention(det), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                attention = F.scaled_dot_product_attention if cudnn else fl.scaled_dot_product_attention
                out = attention(q, k, v, is_causal=causal)
            out.backward(g)
            hopper.one_pass_int_dq = False
        return run
    res = best({"fp32": step(False), "int64": step(True), "det": step(False, True), "cudnn": step(False, False, True)},
               [q, k, v])
    flops = 3.5 * 4 * B * H * L * L * D / (2 if causal else 1)
    tf = {n: flops / ms * 1e-9 for n, ms in res.items()}
    print(f"D{D} L{L} causal={causal}: int64/fp32={tf['int64'] / tf['fp32']:.3f} "
          f"int64/det={tf['int64'] / tf['det']:.3f}"
          f" int64/cudnn={tf['int64'] / tf['cudnn']:.3f} det/cudnn={tf['det'] / tf['cudnn']:.3f} | "
          + " ".join(f"{n}={t:.0f}" for n, t in tf.items()), flush=True)
