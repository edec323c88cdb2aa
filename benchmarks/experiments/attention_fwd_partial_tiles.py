"""Experiment (H200, run from the repo root): the warp-specialized forward's persistent programs at D64 not causal,
whose last tile of each head is partial (192-row tiles of three consumers): tiles dealt every programs-th (None),
list-scheduled in launch order ("order"), or whole tiles first and the partial ones last ("last")
(``ws_schedule_partial``); and two Q sets against one (``WS_Q_STAGES``) on a causal window. First the outputs and
logsumexps of every dealing, bitwise, at odd shapes; then forward and default-mode forward+backward TFLOP/s, best of 3
shuffled rounds of triton.testing.do_bench, cuDNN in the same rounds, (B, H, L, D) bf16, B*L = 16384, H*D = 2048.

    python benchmarks/experiments/attention_fwd_partial_tiles.py
"""
import random

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl
from fusedlayers.kernels import _scaled_dot_product_attention_hopper as hopper
from fusedlayers.kernels import scaled_dot_product_attention as kernels

DEALINGS = (None, "order", "last")
Q_STAGES = dict(hopper.WS_Q_STAGES)

torch.manual_seed(0)
for B, H, L, Hkv in [(3, 5, 2311, 5), (2, 8, 4097, 2), (1, 16, 16384, 16)]:
    q = torch.randn(B, H, L, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(B, Hkv, L, 64, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    outs = []
    for dealing in DEALINGS:
        hopper.ws_schedule_partial = dealing
        outs.append(kernels.attention_forward(q, k, v, None, None, False, 0.125))
    same = all(torch.equal(a, b) for o in outs[1:] for a, b in zip(outs[0], o, strict=True))
    print(f"D64 B{B} H{H}/{Hkv} L{L}: outputs and logsumexps of every dealing bitwise equal: {same}", flush=True)
    assert same


def best(steps, args):
    res = {}
    for _ in range(3):
        order = list(steps)
        random.shuffle(order)
        for name in order:
            ms = triton.testing.do_bench(steps[name], warmup=25, rep=100, grad_to_none=args)
            res[name] = min(res.get(name, 1e9), ms)
    return res


def inputs(L, D):
    B, H = 16384 // L, 2048 // D
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    return q, k, v, torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)


for L in (2048, 4096, 16384):
    q, k, v, g = inputs(L, 64)

    def ours(dealing, backward, q=q, k=k, v=v, g=g):
        def run():
            hopper.ws_schedule_partial = dealing
            if backward:
                fl.scaled_dot_product_attention(q, k, v).backward(g)
            else:
                with torch.no_grad():
                    fl.scaled_dot_product_attention(q, k, v)
        return run

    def cudnn(backward, q=q, k=k, v=v, g=g):
        def run():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                if backward:
                    F.scaled_dot_product_attention(q, k, v).backward(g)
                else:
                    with torch.no_grad():
                        F.scaled_dot_product_attention(q, k, v)
        return run
    steps = {f"{d} {'f+b' if bw else 'fwd'}": ours(d, bw) for d in DEALINGS for bw in (False, True)}
    steps |= {"cudnn fwd": cudnn(False), "cudnn f+b": cudnn(True)}
    res = best(steps, [q, k, v])
    flops = 4 * q.shape[0] * q.shape[1] * L * L * 64
    ratios = " ".join(f"{d}/None {part}={res[f'None {part}'] / res[f'{d} {part}']:.3f}"
                      for part in ("fwd", "f+b") for d in DEALINGS[1:])
    vs = " ".join(f"{d}/cudnn {part}={res[f'cudnn {part}'] / res[f'{d} {part}']:.3f}"
                  for part in ("fwd", "f+b") for d in DEALINGS)
    print(f"D64 L{L} not causal: {ratios} | {vs} | "
          + " ".join(f"{n}={(3.5 if 'f+b' in n else 1) * flops / ms * 1e-9:.0f}" for n, ms in res.items()), flush=True)
hopper.ws_schedule_partial = "order"

# two Q sets against one on causal windows of 4096 and 8192 keys (key intervals, persistent at D64)
q, k, v, g = inputs(16384, 64)
for window in ((4095, 0), (8191, 0)):
    def windowed(n, backward, q=q, k=k, v=v, g=g, window=window):
        def run():
            hopper.WS_Q_STAGES = Q_STAGES if n == 2 else dict.fromkeys(Q_STAGES, 1)
            with torch.set_grad_enabled(backward):
                out = fl.scaled_dot_product_attention(q, k, v, is_causal=True, window_size=window)
            if backward:
                out.backward(g)
        return run
    res = best({"q2 fwd": windowed(2, False), "q1 fwd": windowed(1, False), "q2 f+b": windowed(2, True),
                "q1 f+b": windowed(1, True)}, [q, k, v])
    print(f"D64 L16384 causal window {window}: fwd q2/q1={res['q1 fwd'] / res['q2 fwd']:.3f} "
          f"f+b q2/q1={res['q1 f+b'] / res['q2 f+b']:.3f}", flush=True)
hopper.WS_Q_STAGES = Q_STAGES
