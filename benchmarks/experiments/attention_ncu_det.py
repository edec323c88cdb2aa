"""Experiment (H200, under Nsight Compute): the deterministic mode's two backward passes at D128 L 4096 (not causal,
B 4, H 16, bf16): the dQ pass (`_attn_bwd_dq_hopper`, one query block a program) and the warp-specialized dK/dV pass
(`_attn_bwd_hopper` without dQ), whose tile products run about 20% slower than the dQ pass's (`--kernels`), to see
where. One warm-up call first, then the profiled one.

    ncu --kernel-name regex:"_attn_bwd_hopper|_attn_bwd_dq_hopper" --launch-skip 2 --launch-count 2 --set full \\
        -o report python benchmarks/experiments/attention_ncu_det.py
"""
import torch

import fusedlayers as fl

q, k, v = (torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(4, 16, 4096, 128, device="cuda", dtype=torch.bfloat16)
with fl.use_deterministic_attention(True):
    for _ in range(2):
        fl.scaled_dot_product_attention(q, k, v).backward(g)
torch.cuda.synchronize()
