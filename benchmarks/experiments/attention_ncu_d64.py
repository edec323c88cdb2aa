"""Experiment (H200, under Nsight Compute): the default mode's D64 one pass not causal (step pairs, dQ_part by TMA
reductions), whose GPU time is level with cuDNN's backward kernel at L 2048 while the causal one pass leads it, against
cuDNN's backward kernel: one bf16 forward+backward of each, B 8, H 32, L 2048, D 64 (the second call of ours and both
of cuDNN's profiled):

    ncu --kernel-name regex:"_attn_bwd_hopper|bprop" --launch-skip 1 --launch-count 3 --set full \
        --import-source yes -o d64 python benchmarks/experiments/attention_ncu_d64.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl

q, k, v = (torch.randn(8, 32, 2048, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(8, 32, 2048, 64, device="cuda", dtype=torch.bfloat16)
for _ in range(2):
    fl.scaled_dot_product_attention(q, k, v).backward(g)
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    for _ in range(2):
        F.scaled_dot_product_attention(q, k, v).backward(g)
torch.cuda.synchronize()
