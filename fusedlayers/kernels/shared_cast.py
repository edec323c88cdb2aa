"""Triton kernel of the shared autocast cast's backward (``fusedlayers.integrations.transformers``, ``cast_once``):
the gradients that a 16-bit input's users gave it, summed in fp32 in the order given, as autograd sums them after
casting each back to fp32. One pass (the 16-bit gradients read once, the fp32 sum written once) where autograd's
casts and additions make 2n - 1 passes over n gradients, each over fp32 where it can.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedlayers.kernels import cdiv, launch

BLOCK = 2048  # elements per program, 4 warps: 16 a thread
WARPS = 4


@triton.jit
def _sum_fp32_kernel(A, B, C, Out, n, HAS_C: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    total = tl.load(A + offs, mask=mask).to(tl.float32) + tl.load(B + offs, mask=mask).to(tl.float32)
    if HAS_C:  # (a + b) + c: the order autograd adds them in
        total = total + tl.load(C + offs, mask=mask).to(tl.float32)
    tl.store(Out + offs, total, mask=mask)


def sum_fp32(grads: list[torch.Tensor]) -> torch.Tensor:
    """``((g0 + g1) + g2) + ...`` in fp32 for two or more contiguous tensors of one shape and device (any float
    dtypes); a new contiguous fp32 tensor."""
    out = torch.empty(grads[0].shape, dtype=torch.float32, device=grads[0].device)
    n = out.numel()
    if n == 0:
        return out
    first, rest = grads[0], grads[1:]
    while rest:  # three at a time, the running sum first after the first launch
        pair, rest = rest[:2], rest[2:]
        third = pair[1] if len(pair) == 2 else first
        launch(_sum_fp32_kernel, (cdiv(n, BLOCK),), first, pair[0], third, out, n, HAS_C=len(pair) == 2,
               BLOCK=BLOCK, num_warps=WARPS)
        first = out
    return out
