"""GeGLU ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, CPU reference.

- ``geglu(gate, up, approximate) -> out``: out = gelu(gate, approximate) * up (``approximate``: "tanh", GELU's tanh
  form as ``F.gelu(approximate="tanh")``, or "none", exact), same shapes, in the promoted dtype of gate and up (as
  torch's ``F.gelu(gate) * up``), computed in fp32 (fp64 where either is fp64), contiguous.
- ``geglu_backward(grad, gate, up, approximate, need_dgate, need_dup) -> (dgate, dup)``: dgate = grad * up *
  gelu'(gate), dup = grad * gelu(gate), in gate's and up's dtypes; gradients not asked for come back as empty (0,)
  tensors and are not computed.

As ``fusedlayers.ops.swiglu`` (whose kernels these are): the backward saves gate and up only; no autocast rule of its
own. ``fusedlayers.functional.geglu`` validates the arguments.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusedlayers.ops._eager import call, custom_op, register_autograd
from fusedlayers.ops.swiglu import _accumulator, _or_empty, _run_kernel

try:
    from fusedlayers.kernels import geglu as kernels
except ImportError:  # no Triton (macOS, Windows): the reference runs everywhere
    kernels = None

APPROXIMATIONS = ("none", "tanh")


# ----------------------------------------------------------------------------- reference (PyTorch)


def _act_and_slope(g: Tensor, approximate: str) -> tuple[Tensor, Tensor]:
    """(gelu(g), gelu'(g)) in g's dtype: the tanh form as g sigmoid(2a), a = sqrt(2 / pi) (g + 0.044715 g^3) (no 1 +
    tanh to cancel where g is very negative; 1 - s as sigmoid(-2a)); exact: g Phi(g), Phi(g) + g phi(g)."""
    if approximate == "tanh":
        c = math.sqrt(2 / math.pi)
        a2 = 2 * c * (g + 0.044715 * g**3)
        s = torch.sigmoid(a2)
        return g * s, s + g * s * torch.sigmoid(-a2) * 2 * c * (1 + 3 * 0.044715 * g**2)
    cdf = torch.special.ndtr(g)
    return g * cdf, cdf + g * torch.exp(-0.5 * g * g) / math.sqrt(2 * math.pi)


def geglu_forward_reference(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    acc = _accumulator(gate, up)
    act, _ = _act_and_slope(gate.to(acc), approximate)
    return (act * up.to(acc)).to(torch.promote_types(gate.dtype, up.dtype)).contiguous()


def geglu_backward_reference(grad: Tensor, gate: Tensor, up: Tensor, approximate: str, need_dgate: bool,
                             need_dup: bool) -> tuple[Tensor | None, Tensor | None]:
    acc = _accumulator(grad, gate, up)
    dy = grad.to(acc)
    act, slope = _act_and_slope(gate.to(acc), approximate)
    dgate = (dy * up.to(acc) * slope).to(gate.dtype).contiguous() if need_dgate else None
    dup = (dy * act).to(up.dtype).contiguous() if need_dup else None
    return dgate, dup


# ----------------------------------------------------------------------------- ops


@custom_op("fusedlayers::geglu")
def geglu(gate: Tensor, up: Tensor, approximate: str) -> Tensor:
    if _run_kernel(gate, up):
        return kernels.geglu_forward(gate, up, torch.promote_types(gate.dtype, up.dtype), approximate)
    return geglu_forward_reference(gate, up, approximate)


@geglu.register_fake
def _(gate, up, approximate):
    return gate.new_empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype))


def _setup_context(ctx, inputs, output):
    gate, up, ctx.approximate = inputs
    ctx.save_for_backward(gate, up)


def _autograd(ctx, grad):
    gate, up = ctx.saved_tensors
    need_dgate, need_dup = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if not (need_dgate or need_dup):
        return None, None, None
    dgate, dup = call(geglu_backward, grad, gate, up, ctx.approximate, need_dgate, need_dup)
    return dgate if need_dgate else None, dup if need_dup else None, None


register_autograd(geglu, _autograd, _setup_context)


@custom_op("fusedlayers::geglu_backward")
def geglu_backward(grad: Tensor, gate: Tensor, up: Tensor, approximate: str, need_dgate: bool, need_dup: bool
                   ) -> tuple[Tensor, Tensor]:
    if _run_kernel(gate, grad, up):
        dgate, dup = kernels.geglu_backward(grad, gate, up, approximate, need_dgate, need_dup)
    else:
        dgate, dup = geglu_backward_reference(grad, gate, up, approximate, need_dgate, need_dup)
    return _or_empty(dgate, gate), _or_empty(dup, up)


@geglu_backward.register_fake
def _(grad, gate, up, approximate, need_dgate, need_dup):
    dgate = gate.new_empty(gate.shape) if need_dgate else gate.new_empty((0,))
    dup = up.new_empty(up.shape) if need_dup else up.new_empty((0,))
    return dgate, dup
