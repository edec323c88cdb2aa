"""SwiGLU ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, CPU reference.

- ``swiglu(gate, up) -> out``: out = silu(gate) * up = gate * sigmoid(gate) * up, same shapes, in the promoted dtype
  of gate and up (as torch's ``F.silu(gate) * up``), computed in fp32 (fp64 where either is fp64), contiguous.
- ``swiglu_backward(grad, gate, up, need_dgate, need_dup) -> (dgate, dup)``: dgate = grad * up * s * (1 + gate *
  (1 - s)), dup = grad * gate * s with s = sigmoid(gate), in gate's and up's dtypes; gradients not asked for come back
  as empty (0,) tensors and are not computed.

The backward saves gate and up (the inputs, which the caller holds anyway) and nothing else. Autocast: none of its
own, as torch's silu and mul (neither is on an autocast list: both run in their inputs' dtypes); the op falls through
autocast as every custom op without an autocast kernel does. ``fusedlayers.functional.swiglu`` validates the
arguments.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers.backend import use_triton
from fusedlayers.ops._eager import call, custom_op, register_autograd

try:
    from fusedlayers.kernels import swiglu as kernels
except ImportError:  # no Triton (macOS, Windows): the reference runs everywhere
    kernels = None


def _run_kernel(*tensors: Tensor) -> bool:
    """The Triton kernels (fp32 math) for fp16/bf16/fp32 on the triton backend; float64 runs the reference, and so
    do empty tensors (nothing to compute)."""
    return (tensors[0].numel() > 0 and all(t.dtype != torch.float64 for t in tensors)
            and use_triton(tensors[0]))


def _accumulator(*tensors: Tensor) -> torch.dtype:
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    return t if t is not None else like.new_empty((0,))


# ----------------------------------------------------------------------------- reference (PyTorch)


def swiglu_forward_reference(gate: Tensor, up: Tensor) -> Tensor:
    acc = _accumulator(gate, up)
    g = gate.to(acc)
    out = g * torch.sigmoid(g) * up.to(acc)
    return out.to(torch.promote_types(gate.dtype, up.dtype)).contiguous()


def swiglu_backward_reference(grad: Tensor, gate: Tensor, up: Tensor, need_dgate: bool, need_dup: bool
                              ) -> tuple[Tensor | None, Tensor | None]:
    acc = _accumulator(grad, gate, up)
    dy, g = grad.to(acc), gate.to(acc)
    s = torch.sigmoid(g)
    dgate = (dy * up.to(acc) * s * (1 + g * (1 - s))).to(gate.dtype).contiguous() if need_dgate else None
    dup = (dy * g * s).to(up.dtype).contiguous() if need_dup else None
    return dgate, dup


# ----------------------------------------------------------------------------- ops


@custom_op("fusedlayers::swiglu")
def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    if _run_kernel(gate, up):
        return kernels.swiglu_forward(gate, up, torch.promote_types(gate.dtype, up.dtype))
    return swiglu_forward_reference(gate, up)


@swiglu.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


def _setup_context(ctx, inputs, output):
    gate, up = inputs
    ctx.save_for_backward(gate, up)


def _autograd(ctx, grad):
    gate, up = ctx.saved_tensors
    need_dgate, need_dup = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_dgate or need_dup):
        return None, None
    dgate, dup = call(swiglu_backward, grad, gate, up, need_dgate, need_dup)
    return dgate if need_dgate else None, dup if need_dup else None


register_autograd(swiglu, _autograd, _setup_context)


@custom_op("fusedlayers::swiglu_backward")
def swiglu_backward(grad: Tensor, gate: Tensor, up: Tensor, need_dgate: bool, need_dup: bool
                    ) -> tuple[Tensor, Tensor]:
    if _run_kernel(gate, grad, up):
        dgate, dup = kernels.swiglu_backward(grad, gate, up, need_dgate, need_dup)
    else:
        dgate, dup = swiglu_backward_reference(grad, gate, up, need_dgate, need_dup)
    return _or_empty(dgate, gate), _or_empty(dup, up)


@swiglu_backward.register_fake
def _(grad, gate, up, need_dgate, need_dup):
    dgate = gate.new_empty(gate.shape) if need_dgate else gate.new_empty((0,))
    dup = up.new_empty(up.shape) if need_dup else up.new_empty((0,))
    return dgate, dup
