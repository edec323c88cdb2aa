"""Kernels and launchers for linear + cross-entropy, chunked over the tokens.

Per chunk of rows, ``fusedlayers.ops.linear_cross_entropy`` runs

    logits = x_c @ W^T (+ b)            cuBLAS (torch.mm / addmm into a reused chunk buffer)
    loss, lse                           Triton CE forward kernel (one read of the chunk)
    dlogits                             Triton CE backward kernel, written over the chunk buffer
    grad_x_c = dlogits @ W              cuBLAS, straight into grad_x's rows
    grad_W  += dlogits^T @ x_c          cuBLAS with bf16/fp16 operands and an fp32 output and
                                        accumulator (``addmm_fp32_``) by default; in the weight's own dtype
                                        (a plain addmm) when the caller opts in to that accumulation
    grad_b  += dlogits.sum(0)           fp32

The matmuls stay on cuBLAS: they are ~90% of the time, cuBLAS runs them at ~700 TFLOP/s on an H200 and
its fp32-output GEMM accumulates grad_W in its epilogue; a Triton matmul would have to match that to
win anything. The CE kernels between them are memory-bound passes over the chunk. This module holds
the pieces that are not plain torch: the fp32-accumulating matmul, ``scale_cast`` (the upstream
gradient applied in backward while casting the fp32 accumulators to the parameter dtype, one pass) and
``scale_`` (the same in place, where a buffer already has its gradient's dtype).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from fusedlayers.kernels import cdiv, launch

_ADDMM_OUT_DTYPE: dict[torch.device, bool] = {}


def _addmm_out_dtype_works(device: torch.device) -> bool:
    """Whether torch.addmm(..., out_dtype=torch.float32, out=acc) accumulates bf16 products into fp32 in place
    (torch >= 2.8 on CUDA). Probed once per device on a small problem against an fp32 matmul, with autocast
    off (the first call may come from inside an autocast region, which would recast the probe itself)."""
    if device not in _ADDMM_OUT_DTYPE:
        ok = False
        try:
            with torch.autocast(device.type, enabled=False):
                a = torch.randn(64, 32, device=device).to(torch.bfloat16)
                b = torch.randn(32, 48, device=device).to(torch.bfloat16)
                acc = torch.randn(64, 48, device=device)
                expected = acc.double() + a.double() @ b.double()  # fp64: immune to allow_tf32
                torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
                ok = bool(torch.allclose(acc.double(), expected, atol=1e-4, rtol=1e-4))
        except (RuntimeError, TypeError, NotImplementedError):
            ok = False
        _ADDMM_OUT_DTYPE[device] = ok
    return _ADDMM_OUT_DTYPE[device]


def addmm_fp32_(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor, beta: float = 1.0) -> torch.Tensor:
    """acc = beta * acc + a @ b with acc in fp32 (or fp64) and a, b in any float dtype, summed in acc's
    dtype. beta = 0 ignores acc's content (it may be uninitialised).

    CUDA bf16/fp16: one cuBLAS call with an fp32 output (no temporary). Elsewhere a, b are upcast first
    (exact), which costs a temporary of their size.
    """
    if a.dtype == acc.dtype:
        return acc.addmm_(a, b, beta=beta)
    if acc.is_cuda and acc.dtype == torch.float32 and _addmm_out_dtype_works(acc.device):
        return torch.addmm(acc, a, b, beta=beta, out_dtype=torch.float32, out=acc)
    return acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


@triton.jit
def _scale_cast_kernel(src_ptr, g_ptr, dst_ptr, numel, IN_PLACE: tl.constexpr, BLOCK: tl.constexpr):
    g = tl.load(g_ptr).to(tl.float32)
    # in place, a factor of exactly 1 (``loss.backward()``) leaves every value as it is: no pass over the buffer
    if not IN_PLACE or g != 1.0:
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < numel
        x = tl.load(src_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(dst_ptr + offs, (x * g).to(dst_ptr.dtype.element_ty), mask=mask)


def scale_cast(src: torch.Tensor, g: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A new contiguous tensor ``(src * g).to(dtype)`` in one pass, computed in fp32; ``g`` is a 0-d tensor."""
    src = src.contiguous()
    out = torch.empty(src.shape, dtype=dtype, device=src.device)
    numel = src.numel()
    if numel:
        block = 4096
        launch(_scale_cast_kernel, (cdiv(numel, block),), src, g, out, numel, IN_PLACE=False, BLOCK=block,
               num_warps=8)
    return out


def scale_(buffer: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """``buffer *= g`` in place (contiguous ``buffer``, 0-d ``g``), computed in fp32; returns ``buffer``. Each element
    is read and written by the same program. Where g is exactly 1 the programs read g and stop: x * 1 is x in
    every dtype (NaN and -0 included), and the pass over a gradient-sized buffer (0.35 ms measured for a 128256 x 2048
    bf16 gradient on an H100, twice the bytes in fp32) is saved without the host reading g."""
    assert buffer.is_contiguous()
    numel = buffer.numel()
    if numel:
        block = 4096
        launch(_scale_cast_kernel, (cdiv(numel, block),), buffer, g, buffer, numel, IN_PLACE=True, BLOCK=block,
               num_warps=8)
    return buffer
