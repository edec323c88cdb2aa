"""Cross-entropy ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, CPU reference.

Ops (2-D logits (rows, C) and 1-D class-index targets; ``fusedlayers.functional`` reshapes and validates):

- ``cross_entropy(logits, target, ignore_index, reduction, label_smoothing, z_loss, out_dtype)
  -> (loss, lse, count)``: the loss reduced as asked ("none" | "mean" over the non-ignored rows | "sum"),
  in ``out_dtype``, the fp32 logsumexp of each row (0 for ignored rows) and the int64 number of
  non-ignored rows (both saved for backward, not differentiable).
- ``cross_entropy_backward(grad, logits, target, lse, count, ignore_index, reduction, label_smoothing,
  z_loss) -> grad_logits``: an op of its own so torch.compile traces forward and backward without a graph break;
  differentiable itself (double backward, in PyTorch ops).

Saved for backward: the logits (a view of the caller's tensor, never written), the targets, the
logsumexp (4 bytes a row) and the count -- not the probabilities. The backward writes a new tensor.
On the Triton path forward and backward are two kernel launches each plus the reduction's one (the
mean divides by the count inside the backward kernel): few launches, so little CPU overhead.

Per row (t = target, L = logsumexp, e = label_smoothing, z = z_loss, C classes):
loss = L - (1 - e) x[t] - (e / C) sum(x) + z L^2, which is F.cross_entropy's value when z = 0.
Ignored rows give 0 and do not count in "mean"; if every row is ignored, "mean" is 0/0 = NaN (as torch).
Targets outside [0, C) that are not ignore_index: a TargetOutOfRangeError on CPU; on CUDA nothing reads
out of bounds and that row's loss and gradient are NaN.

Each op body picks the Triton kernel or the PyTorch reference through ``fusedlayers.backend``;
float64 always runs the reference (the kernels accumulate in fp32).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers import _validate as v
from fusedlayers.backend import use_triton
from fusedlayers.ops._eager import call, custom_op, register_autograd

try:
    from fusedlayers.kernels import cross_entropy as kernels
except ImportError:  # no Triton: the reference runs everywhere
    kernels = None


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run_kernel(x: Tensor) -> bool:
    return x.dtype != torch.float64 and use_triton(x)


def _check_targets(logits: Tensor, target: Tensor, ignore_index: int) -> None:
    """Values are only checked on CPU (reading them on CUDA would synchronise; the kernels stay in bounds)."""
    if target.device.type == "cpu" and target.numel():
        v.check_target_range("target", target, logits.shape[-1], ignore_index)


# ----------------------------------------------------------------------------- reference (PyTorch)


def cross_entropy_rows_reference(
    logits: Tensor, target: Tensor, ignore_index: int, smoothing: float, z_loss: float
) -> tuple[Tensor, Tensor]:
    """Per-row loss and logsumexp in the accumulator dtype (fp32, or fp64 for fp64 logits)."""
    x = logits.to(_accumulator(logits.dtype))
    n_classes = x.shape[-1]
    valid = target != ignore_index
    in_range = (target >= 0) & (target < n_classes)
    safe = torch.where(valid & in_range, target, 0).long()
    lse = torch.logsumexp(x, -1)
    loss = lse - (1.0 - smoothing) * x.gather(-1, safe[:, None]).squeeze(-1)
    if smoothing:
        loss = loss - smoothing / n_classes * x.sum(-1)
    if z_loss:
        loss = loss + z_loss * lse.square()
    loss = torch.where(in_range, loss, float("nan"))
    return torch.where(valid, loss, 0.0), torch.where(valid, lse, 0.0)


def cross_entropy_grad_reference(
    grad_rows: Tensor, logits: Tensor, target: Tensor, lse: Tensor, ignore_index: int, smoothing: float,
    z_loss: float,
) -> Tensor:
    """grad_r * ((1 + 2 z L) softmax(x) - e / C - (1 - e) onehot(t)), zero rows where ignored."""
    acc = _accumulator(logits.dtype)
    x = logits.to(acc)
    n_classes = x.shape[-1]
    valid = target != ignore_index
    in_range = (target >= 0) & (target < n_classes)
    g = torch.where(in_range, grad_rows.to(acc), float("nan"))
    a = g * (1.0 + 2.0 * z_loss * lse.to(acc)) if z_loss else g
    d = a[:, None] * torch.exp(x - lse.to(acc)[:, None]) - (g * (smoothing / n_classes))[:, None]
    onehot = torch.arange(n_classes, device=x.device)[None, :] == target[:, None]
    d = d - onehot * (g * (1.0 - smoothing))[:, None]
    return torch.where(valid[:, None], d, 0.0)


def _reduce(loss_rows: Tensor, target: Tensor, ignore_index: int, reduction: str,
            out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """(the reduced loss in ``out_dtype``, the 0-d int64 count of non-ignored rows), in PyTorch."""
    count = (target != ignore_index).sum()
    if reduction == "none":
        return loss_rows.to(out_dtype), count
    total = loss_rows.sum()
    if reduction == "mean":
        total = total / count
    return total.to(out_dtype), count


def grad_per_row(grad: Tensor, target: Tensor, ignore_index: int, reduction: str, acc: torch.dtype) -> Tensor:
    """The factor each row's gradient is scaled by, in ``acc``: 0-d for "mean" (grad / count) and "sum",
    (rows,) for "none"."""
    if reduction == "mean":
        return grad.to(acc) / (target != ignore_index).sum()
    return grad.to(acc)


# ----------------------------------------------------------------------------- forward


@custom_op("fusedlayers::cross_entropy")
def cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int, reduction: str, label_smoothing: float, z_loss: float,
    out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_targets(logits, target, ignore_index)
    if _run_kernel(logits):
        loss_rows, lse = kernels.cross_entropy_forward(logits, target, ignore_index, label_smoothing, z_loss)
        loss, count = kernels.cross_entropy_reduce(loss_rows, target, ignore_index, reduction == "mean",
                                                   loss_rows.dtype if reduction == "none" else out_dtype)
        if reduction == "none":
            loss = loss_rows.to(out_dtype)
        return loss, lse, count
    loss_rows, lse = cross_entropy_rows_reference(logits, target, ignore_index, label_smoothing, z_loss)
    loss, count = _reduce(loss_rows, target, ignore_index, reduction, out_dtype)
    return loss, lse.contiguous(), count


@cross_entropy.register_fake
def _(logits, target, ignore_index, reduction, label_smoothing, z_loss, out_dtype):
    rows = logits.shape[0]
    loss = logits.new_empty((rows,) if reduction == "none" else (), dtype=out_dtype)
    return (loss, logits.new_empty((rows,), dtype=_accumulator(logits.dtype)),
            logits.new_empty((), dtype=torch.int64))


def _setup_context(ctx, inputs, output):
    logits, target, ignore_index, reduction, label_smoothing, z_loss, _ = inputs
    _, lse, count = output
    ctx.args = (ignore_index, reduction, label_smoothing, z_loss)
    ctx.mark_non_differentiable(lse, count)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for lse and count
    ctx.save_for_backward(logits, target, lse, count)


def _autograd(ctx, grad, _grad_lse, _grad_count):
    logits, target, lse, count = ctx.saved_tensors
    grad_logits = None
    if ctx.needs_input_grad[0] and grad is not None:
        grad_logits = call(cross_entropy_backward, grad, logits, target, lse, count, *ctx.args)
    return grad_logits, None, None, None, None, None, None


register_autograd(cross_entropy, _autograd, _setup_context)


# ----------------------------------------------------------------------------- backward


@custom_op("fusedlayers::cross_entropy_backward")
def cross_entropy_backward(
    grad: Tensor, logits: Tensor, target: Tensor, lse: Tensor, count: Tensor, ignore_index: int, reduction: str,
    label_smoothing: float, z_loss: float,
) -> Tensor:
    """``count``: the forward's number of non-ignored rows ("mean" divides by it)."""
    if _run_kernel(logits):
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        return kernels.cross_entropy_backward(grad, logits, target, lse, ignore_index, label_smoothing, z_loss, out,
                                              count if reduction == "mean" else None)
    acc = _accumulator(logits.dtype)
    g = grad.to(acc) / count if reduction == "mean" else grad.to(acc)
    g_rows = g.expand(logits.shape[0]) if g.dim() == 0 else g
    d = cross_entropy_grad_reference(g_rows, logits, target, lse, ignore_index, label_smoothing, z_loss)
    return d.to(logits.dtype).contiguous()


@cross_entropy_backward.register_fake
def _(grad, logits, target, lse, count, ignore_index, reduction, label_smoothing, z_loss):
    return torch.empty_like(logits, memory_format=torch.contiguous_format)


def _backward_setup_context(ctx, inputs, output):
    grad, logits, target, lse, count, ignore_index, reduction, label_smoothing, z_loss = inputs
    ctx.args = (ignore_index, reduction, label_smoothing, z_loss)
    ctx.save_for_backward(grad, logits, target, lse, count)


def _backward_autograd(ctx, v):
    """Double backward (PyTorch ops; not a hot path). With p = softmax(x), a = 1 + 2 z L and the row factor g,
    the backward is d = g (a p - e / C - (1 - e) onehot); for an upstream v:
    d/dg = sum_c v_c (a p_c - e / C - (1 - e) onehot_c) and d/dx = g p (a v - (a - 2 z) (v . p)),
    counting L = logsumexp(x) (the lse input is the forward's, not differentiable on its own)."""
    grad, logits, target, lse, count = ctx.saved_tensors
    ignore_index, reduction, smoothing, z_loss = ctx.args
    acc = _accumulator(logits.dtype)
    x, L, vv = logits.to(acc), lse.to(acc), v.to(acc)
    n_classes = x.shape[-1]
    valid = target != ignore_index
    in_range = (target >= 0) & (target < n_classes)
    p = torch.exp(x - L[:, None])
    a = 1.0 + 2.0 * z_loss * L
    vp = (vv * p).sum(-1)
    d_grad = d_logits = None
    if ctx.needs_input_grad[0]:
        safe = torch.where(valid & in_range, target, 0).long()
        s = a * vp - smoothing / n_classes * vv.sum(-1) - (1.0 - smoothing) * vv.gather(-1, safe[:, None])[:, 0]
        s = torch.where(valid, torch.where(in_range, s, float("nan")), 0.0)
        if reduction == "none":
            d_grad = s
        else:
            d_grad = s.sum() / count if reduction == "mean" else s.sum()
        d_grad = d_grad.to(grad.dtype)
    if ctx.needs_input_grad[1]:
        g = grad.to(acc) / count if reduction == "mean" else grad.to(acc)
        g = torch.where(in_range, g.expand(x.shape[0]), float("nan"))
        d = g[:, None] * p * (a[:, None] * vv - (a - 2.0 * z_loss)[:, None] * vp[:, None])
        d_logits = torch.where(valid[:, None], d, 0.0).to(logits.dtype)
    return d_grad, d_logits, None, None, None, None, None, None, None


register_autograd(cross_entropy_backward, _backward_autograd, _backward_setup_context)
