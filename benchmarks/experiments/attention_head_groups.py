"""Experiment (H200, run from the repo root): causal one-pass and deterministic dK/dV programs dealt G heads at a time,
key block by key block (``head_groups_enabled``, G from ``_head_group``) against head by head. First dK and dV
bitwise equal both ways at odd shapes in both modes (dQ too in the deterministic mode); then forward+backward TFLOP/s,
best of 3 shuffled rounds of triton.testing.do_bench with cuDNN, (B, H, L, D) bf16, B*L = 16384, H*D = 2048.

    python benchmarks/experiments/attention_head_groups.py
"""
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper


def grads(q, k, v, g, grouped, det):
    hopper.head_groups_enabled = grouped
    with fl.use_deterministic_attention(det):
        out = torch.autograd.grad(fl.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
                                  (q, k, v), g)
    hopper.head_groups_enabled = True
    return out


torch.manual_seed(0)
for D, B, H, H_kv, L in [(128, 3, 20, 5, 3001), (128, 2, 8, 2, 4500), (64, 3, 7, 7, 2111), (64, 2, 12, 3, 4097)]:
    q = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(B, H_kv, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    group = hopper._head_group(q, L, True, None)
    for det in (False, True):
        a, b = grads(q, k, v, g, False, det), grads(q, k, v, g, True, det)
        same_kv = torch.equal(a[1], b[1]) and torch.equal(a[2], b[2])
        dq = "bitwise equal" if torch.equal(a[0], b[0]) else (
            f"max diff {float((a[0].float() - b[0].float()).abs().max()):.1e} of {float(a[0].float().abs().max()):.1e}")
        print(f"D{D} B{B} H{H}/{H_kv} L{L} G{group} det={det}: dK, dV bitwise equal {same_kv}; dQ {dq}", flush=True)
        assert same_kv and (not det or torch.equal(a[0], b[0]))

for dev_cache in hopper._attn_bwd_hopper.device_caches.values():
    for kern in dev_cache[0].values():
        print(f"_attn_bwd_hopper: {kern.n_regs} registers, {kern.n_spills} bytes spilled", flush=True)


def best(steps, args):
    res = {}
    for _ in range(3):
        names = list(steps)
        random.shuffle(names)
        for name in names:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


for D, L in [(128, 1024), (128, 2048), (128, 4096), (128, 8192), (128, 16384), (64, 2048), (64, 4096), (64, 16384)]:
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    g = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)

    def step(grouped, det=False, cudnn=False, q=q, k=k, v=v, g=g):
        def run():
            hopper.head_groups_enabled = grouped
            with fl.use_deterministic_attention(det), sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                attention = F.scaled_dot_product_attention if cudnn else fl.scaled_dot_product_attention
                out = attention(q, k, v, is_causal=True)
                out.backward(g)
            hopper.head_groups_enabled = True
        return run
    res = best({"grouped": step(True), "heads": step(False), "grouped det": step(True, True),
                "heads det": step(False, True), "cudnn": step(False, False, True)}, [q, k, v])
    tf = {n: 3.5 * 2 * B * H * L * L * D / ms * 1e-9 for n, ms in res.items()}
    print(f"D{D} L{L} causal G{hopper._head_group(q, L, True, None)}: grouped/heads {tf['grouped'] / tf['heads']:.3f}, "
          f"det {tf['grouped det'] / tf['heads det']:.3f}; /cuDNN grouped {tf['grouped'] / tf['cudnn']:.3f} heads "
          f"{tf['heads'] / tf['cudnn']:.3f} grouped det {tf['grouped det'] / tf['cudnn']:.3f} heads det "
          f"{tf['heads det'] / tf['cudnn']:.3f} | " + " ".join(f"{n}={t:.0f}" for n, t in tf.items()), flush=True)
