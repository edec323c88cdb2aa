"""Experiment (H200, run from the repo root): the attention kernels with the head-group dealing spelt once
(``_head_group_order``) against their previous source (``fusedlayers/kernels/_hopper_before.py``, the module at
417c15a), both in one process: gradients bitwise equal at odd causal shapes in both modes, then forward+backward
TFLOP/s, best of 3 shuffled rounds of triton.testing.do_bench, (B, H, L, D) bf16, B*L = 16384, H*D = 2048.

    python benchmarks/experiments/attention_head_group_order.py
"""
import random

import torch
import triton

import fusedlayers as fl
from fusedlayers.kernels import _hopper_before as before
from fusedlayers.kernels import scaled_dot_product_attention as K

after = K.hopper


def use(module):
    K.hopper = module


def grads(q, k, v, g, module, det, causal=True):
    use(module)
    with fl.use_deterministic_attention(det):
        out = fl.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True)
        res = (out, *torch.autograd.grad(out, (q, k, v), g))
    use(after)
    return res


torch.manual_seed(0)
for D, B, H, H_kv, L in [(128, 3, 20, 5, 3001), (128, 2, 16, 16, 8192), (64, 2, 12, 3, 4097)]:
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    for det in (False, True):
        a, b = grads(q, k, v, g, before, det), grads(q, k, v, g, after, det)
        same = [torch.equal(x, y) for x, y in zip(a, b, strict=True)]
        print(f"D{D} B{B} H{H}/{H_kv} L{L} det={det}: out, dQ, dK, dV bitwise equal {same}", flush=True)
        assert all(same[:1] + same[2:]) and (same[1] or not det)


def best(steps, args):
    res = {}
    for _ in range(3):
        names = list(steps)
        random.shuffle(names)
        for name in names:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


for D, L, causal in [(128, 2048, True), (128, 4096, True), (64, 4096, True), (128, 4096, False), (64, 4096, False)]:
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def step(module, det=False, q=q, k=k, v=v, g=g, causal=causal):
        def run():
            use(module)
            with fl.use_deterministic_attention(det):
                fl.scaled_dot_product_attention(q, k, v, is_causal=causal).backward(g)
            use(after)
        return run
    res = best({"after": step(after), "before": step(before), "after det": step(after, True),
                "before det": step(before, True)}, [q, k, v])
    print(f"D{D} L{L} causal={causal}: after/before {res['before'] / res['after']:.3f}, det "
          f"{res['before det'] / res['after det']:.3f}", flush=True)
