"""Rotary position embedding ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, CPU reference.

- ``rotary_embedding(q, k, cos, sin) -> (q_out, k_out)``: transformers' ``apply_rotary_pos_emb`` (rotate-half
  convention) of q (B, H, T, D) and k (B, H_kv, T, D), cos/sin (T, D) or (B or 1, T, D) broadcast over the heads:
  ``x * cos + rotate_half(x) * sin``, rotate_half(x) = cat(-x2, x1). Outputs are new tensors laid out as q/k
  (``torch.empty_like``), in promote_types(x.dtype, cos.dtype) as transformers' result; fp32 math (fp64 -> reference).
- ``rotary_embedding_backward(grad_q, grad_k, cos, sin, dq_dtype, dk_dtype) -> (dq, dk)``: the inverse rotation
  (by -theta) of both gradients in one launch; its own backward (double backward) is the forward rotation.

cos/sin get no gradient: the backward raises if they require one (``fusedlayers.functional.rotary_embedding`` checks
that up front). ``fusedlayers.functional.rotary_embedding`` validates the arguments.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers.backend import use_triton
from fusedlayers.ops._eager import call, custom_op, register_autograd

try:
    from fusedlayers.kernels import rotary_embedding as kernels
except ImportError:  # no Triton (macOS, Windows): the reference runs everywhere
    kernels = None


def _run_kernel(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> bool:
    """Triton (fp32 math) for fp16/bf16/fp32 on the triton backend; fp64 and empty tensors run the reference. (No
    generators: this runs on every call, forward and backward, and short-sequence calls are bound by the host.)"""
    return (q.numel() > 0 and k.numel() > 0 and cos.numel() > 0 and sin.numel() > 0
            and torch.float64 not in (q.dtype, k.dtype, cos.dtype, sin.dtype) and use_triton(q))


def _rotate_reference(x: Tensor, cos: Tensor, sin: Tensor, out_dtype: torch.dtype, backward: bool) -> Tensor:
    acc = torch.float64 if torch.float64 in (x.dtype, cos.dtype, sin.dtype) else torch.float32
    c = (cos[None, None] if cos.dim() == 2 else cos[:, None]).to(acc)
    s = (sin[None, None] if sin.dim() == 2 else sin[:, None]).to(acc)
    half = x.shape[-1] // 2
    if backward:  # rotation by -theta: sin' = -cat(sin2, sin1)
        s = -torch.cat((s[..., half:], s[..., :half]), dim=-1)
    xf = x.to(acc)
    rotated = torch.cat((-xf[..., half:], xf[..., :half]), dim=-1)
    out = torch.empty_like(x, dtype=out_dtype)
    out.copy_(xf * c + rotated * s)
    return out


def _rotate(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor, q_dtype: torch.dtype, k_dtype: torch.dtype,
            backward: bool) -> tuple[Tensor, Tensor]:
    if _run_kernel(q, k, cos, sin):
        return kernels.rotate(q, k, cos, sin, q_dtype, k_dtype, backward)
    return (_rotate_reference(q, cos, sin, q_dtype, backward), _rotate_reference(k, cos, sin, k_dtype, backward))


def out_dtype(x: Tensor, cos: Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, cos.dtype)


@custom_op("fusedlayers::rotary_embedding")
def rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    return _rotate(q, k, cos, sin, out_dtype(q, cos), out_dtype(k, cos), False)


@rotary_embedding.register_fake
def _(q, k, cos, sin):
    return torch.empty_like(q, dtype=out_dtype(q, cos)), torch.empty_like(k, dtype=out_dtype(k, cos))


def _setup_context(ctx, inputs, output):
    q, k, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dtypes = (q.dtype, k.dtype)


def _autograd(ctx, grad_q, grad_k):
    if ctx.needs_input_grad[2] or ctx.needs_input_grad[3]:
        raise RuntimeError("fusedlayers rotary_embedding computes no gradient for cos/sin; detach them (or use "
                           "transformers' apply_rotary_pos_emb where a gradient of cos/sin is needed)")
    if not (ctx.needs_input_grad[0] or ctx.needs_input_grad[1]):
        return None, None, None, None
    cos, sin = ctx.saved_tensors
    dq, dk = call(rotary_embedding_backward, grad_q, grad_k, cos, sin, *ctx.dtypes)
    return (dq if ctx.needs_input_grad[0] else None), (dk if ctx.needs_input_grad[1] else None), None, None


register_autograd(rotary_embedding, _autograd, _setup_context)


@custom_op("fusedlayers::rotary_embedding_backward")
def rotary_embedding_backward(grad_q: Tensor, grad_k: Tensor, cos: Tensor, sin: Tensor, dq_dtype: torch.dtype,
                              dk_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    return _rotate(grad_q, grad_k, cos, sin, dq_dtype, dk_dtype, True)


@rotary_embedding_backward.register_fake
def _(grad_q, grad_k, cos, sin, dq_dtype, dk_dtype):
    return torch.empty_like(grad_q, dtype=dq_dtype), torch.empty_like(grad_k, dtype=dk_dtype)


def _setup_backward_context(ctx, inputs, output):
    grad_q, grad_k, cos, sin, _, _ = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dtypes = (grad_q.dtype, grad_k.dtype)


def _backward_autograd(ctx, grad_dq, grad_dk):
    """Double backward: the backward is linear in the gradients, its transpose is the forward rotation."""
    cos, sin = ctx.saved_tensors
    gq, gk = call(rotary_embedding, grad_dq, grad_dk, cos, sin)
    return gq.to(ctx.dtypes[0]), gk.to(ctx.dtypes[1]), None, None, None, None


register_autograd(rotary_embedding_backward, _backward_autograd, _setup_backward_context)
