"""Experiment (H200, under Nsight Compute): one D128 forward+backward at L 2048 (not causal, B 8, H 16, bf16), ours
then cuDNN's, for `ncu --kernel-name regex:"_attn_bwd_hopper|bprop"` to profile the two backward kernels.

    ncu --kernel-name regex:"_attn_bwd_hopper|bprop" --section SpeedOfLight --section WarpStateStats \\
        python benchmarks/experiments/attention_ncu.py
"""
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import fusedlayers as fl

q, k, v = (torch.randn(8, 16, 2048, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
g = torch.randn(8, 16, 2048, 128, device="cuda", dtype=torch.bfloat16)
fl.scaled_dot_product_attention(q, k, v).backward(g)
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    F.scaled_dot_product_attention(q, k, v).backward(g)
torch.cuda.synchronize()
