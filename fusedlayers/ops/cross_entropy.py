"""Cross-entropy ops in the ``torch.ops.fusedlayers`` namespace: registration, autograd, CPU reference.

Ops (2-D logits (rows, C); ``target`` either 1-D class indices (rows,) or 2-D class probabilities (rows, C);
``weight`` None or per-class weights (C,); ``fusedlayers.functional`` reshapes and validates):

- ``cross_entropy(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype)
  -> (loss, lse, aux, denom)``: the loss reduced as asked ("none" | "mean" | "sum"), in ``out_dtype``; the
  fp32 logsumexp of each row as (2, rows), hi + lo (0 for ignored rows); ``aux``, a per-row fp32 coefficient
  the backward needs with probability targets (sum_c w_c q'_c) or with weights and smoothing
  ((1 - e) w_t + (e / C) sum(w)), else an empty tensor; ``denom``, the fp32 denominator of "mean" (the sum
  of weight[t] over the non-ignored rows, their count without weights, the number of rows for probabilities;
  0 for "none"). All but ``loss`` are saved for backward and not differentiable.
- ``cross_entropy_backward(grad, logits, target, weight, lse, aux, denom, ignore_index, reduction,
  label_smoothing, z_loss, target_grad) -> (grad_logits, grad_target)``: an op of its own so torch.compile
  traces forward and backward without a graph break; ``grad_target`` (probability targets, when asked) or an
  empty tensor. Differentiable itself (double backward, through :func:`cross_entropy_composite`).

Saved for backward: the logits (a view of the caller's tensor, never written), the targets, the weights, the
logsumexp (8 bytes a row), aux and the denominator -- not the probabilities. The backward writes new tensors.
On the Triton path forward and backward are one kernel launch each plus the reduction's one (the mean divides
by the denominator inside the backward kernel): few launches, so little CPU overhead.

The math (torch's, LossNLL.cpp, plus the z-loss) is written out in ``fusedlayers.kernels.cross_entropy``.
Ignored rows give 0 and do not count in "mean"; if every row is ignored, "mean" is 0/0 = NaN (as torch).
Class indices outside [0, C) that are not ignore_index: a TargetOutOfRangeError on CPU; on CUDA nothing reads
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


def needs_aux(soft: bool, has_weight: bool, smoothing: float) -> bool:
    """Whether the forward returns a per-row coefficient for the backward (see the module docstring)."""
    return soft or (has_weight and smoothing != 0.0)


def check_targets(target: Tensor, n_classes: int, ignore_index: int) -> None:
    """Class-index values are only checked on CPU (reading them on CUDA would synchronise; the kernels stay in
    bounds)."""
    if not target.is_floating_point() and target.device.type == "cpu" and target.numel():
        v.check_target_range("target", target, n_classes, ignore_index)


def kernel_weight(weight: Tensor | None) -> Tensor | None:
    """The class weights as the kernels read them: contiguous fp32 (no copy when they already are)."""
    return None if weight is None else weight.to(torch.float32).contiguous()


# ----------------------------------------------------------------------------- reference (PyTorch)


def _index_parts(target: Tensor, n_classes: int, ignore_index: int):
    valid = target != ignore_index
    in_range = (target >= 0) & (target < n_classes)
    safe = torch.where(valid & in_range, target, 0).long()
    return valid, in_range, safe


def _smoothed(target: Tensor, w: Tensor | None, smoothing: float, acc: torch.dtype) -> Tensor:
    """w_c q'_c of probability targets, q' = (1 - e) q + e / C."""
    q = target.to(acc)
    if smoothing:
        q = q * (1.0 - smoothing) + smoothing / q.shape[-1]
    return q * w if w is not None else q


def split_logsumexp(x: Tensor) -> Tensor:
    """logsumexp of the rows of ``x`` as (2, rows): hi (its rounding to x's dtype) and lo (the rest), as the
    kernels keep it (``fusedlayers.kernels.cross_entropy._split_lse``). Not differentiable."""
    with torch.no_grad():
        m = x.amax(-1)
        finite = torch.isfinite(m)
        m = torch.where(finite, m, 0.0)
        log_s = torch.log(torch.exp(x - m[:, None]).sum(-1))
        hi = m + log_s
        lo = torch.where(finite, (m - hi) + log_s, 0.0)
        return torch.stack((torch.where(finite, hi, torch.logsumexp(x, -1)), lo))


def cross_entropy_rows_reference(
    logits: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, smoothing: float, z_loss: float,
) -> tuple[Tensor, Tensor, Tensor | None]:
    """Per-row loss, logsumexp ((2, rows): hi + lo, see :func:`split_logsumexp`) and aux (or None) in the
    accumulator dtype (fp32, or fp64 for fp64 logits).

    Plain PyTorch ops, differentiable in ``logits`` and (probabilities) ``target`` when called with grad on
    (:func:`cross_entropy_composite` relies on that).
    """
    acc = _accumulator(logits.dtype)
    x = logits.to(acc)
    n_classes = x.shape[-1]
    logp = torch.log_softmax(x, -1)
    lse2 = split_logsumexp(x)
    lse = torch.logsumexp(x, -1) if z_loss else None
    w = weight.to(acc) if weight is not None else None
    if target.is_floating_point():
        wq = _smoothed(target, w, smoothing, acc)
        loss = -(wq * logp).sum(-1)
        if z_loss:
            loss = loss + z_loss * lse.square()
        return loss, lse2, wq.sum(-1)
    valid, in_range, safe = _index_parts(target, n_classes, ignore_index)
    w_t = torch.where(valid & in_range, w.gather(0, safe), 0.0) if w is not None else None
    loss = -logp.gather(-1, safe[:, None]).squeeze(-1)
    if w_t is not None:
        loss = w_t * loss
    if smoothing:
        smooth = -(logp * w).sum(-1) if w is not None else -logp.sum(-1)
        loss = (1.0 - smoothing) * loss + smoothing / n_classes * smooth
    aux = None
    if w is not None and smoothing:
        aux = (1.0 - smoothing) * w_t + smoothing / n_classes * w.sum()
    if z_loss:
        z = z_loss * lse.square()
        loss = loss + (w_t * z if w_t is not None else z)
    loss = torch.where(in_range, loss, float("nan"))
    return torch.where(valid, loss, 0.0), torch.where(valid, lse2, 0.0), aux


def denominator_reference(target: Tensor, weight: Tensor | None, ignore_index: int, n_classes: int,
                          acc: torch.dtype) -> Tensor:
    """The 0-d denominator of "mean" (see the module docstring), in ``acc``."""
    if target.is_floating_point():
        return torch.tensor(float(target.shape[0]), dtype=acc, device=target.device)
    valid, in_range, safe = _index_parts(target, n_classes, ignore_index)
    if weight is None:
        return valid.sum().to(acc)
    return torch.where(valid & in_range, weight.to(acc).gather(0, safe), 0.0).sum()


def cross_entropy_grad_reference(
    grad_rows: Tensor, logits: Tensor, target: Tensor, weight: Tensor | None, lse: Tensor, aux: Tensor | None,
    ignore_index: int, smoothing: float, z_loss: float, target_grad: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """(grad_r * dloss_r/dlogits, grad_r * dloss_r/dtarget or None) in the accumulator dtype, the closed forms of
    ``fusedlayers.kernels.cross_entropy``; zero rows where ignored. ``lse``: (2, rows), hi + lo."""
    acc = _accumulator(logits.dtype)
    x = logits.to(acc)
    n_classes = x.shape[-1]
    hi, lo = lse.to(acc)
    L = hi + lo
    g = grad_rows.to(acc)
    w = weight.to(acc) if weight is not None else None
    p = torch.exp((x - hi[:, None]) - lo[:, None])
    if target.is_floating_point():
        wq = _smoothed(target, w, smoothing, acc)
        s = aux.to(acc) if aux is not None else wq.sum(-1)
        a = g * (s + 2.0 * z_loss * L) if z_loss else g * s
        d = a[:, None] * p - g[:, None] * wq
        dq = None
        if target_grad:
            dq = (g * (1.0 - smoothing))[:, None] * ((hi[:, None] - x) + lo[:, None])
            if w is not None:
                dq = dq * w
        return d, dq
    valid, in_range, safe = _index_parts(target, n_classes, ignore_index)
    g = torch.where(in_range, g, float("nan"))
    if w is not None:
        w_t = torch.where(valid & in_range, w.gather(0, safe), 0.0)
        coef = aux.to(acc) if smoothing else w_t
    else:
        w_t = coef = 1.0
    a = g * (coef + 2.0 * z_loss * w_t * L) if z_loss else g * coef
    d = a[:, None] * p
    if smoothing:
        d = d - (g * (smoothing / n_classes))[:, None] * (w[None, :] if w is not None else 1.0)
    onehot = torch.arange(n_classes, device=x.device)[None, :] == target[:, None]
    d = d - onehot * (g * (1.0 - smoothing) * w_t)[:, None]
    return torch.where(valid[:, None], d, 0.0), None


def reduce_rows(loss_rows: Tensor, denom: Tensor, reduction: str, out_dtype: torch.dtype) -> Tensor:
    """The row losses reduced as asked, in ``out_dtype``; sums in fp64 (as the reduction kernel)."""
    if reduction == "none":
        return loss_rows.to(out_dtype)
    total = loss_rows.sum(dtype=torch.float64)
    if reduction == "mean":
        total = total / denom
    return total.to(out_dtype)


def cross_entropy_composite(logits: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int,
                            reduction: str, label_smoothing: float, z_loss: float) -> Tensor:
    """The loss in plain differentiable PyTorch ops (accumulator dtype): the path for class weights that require
    grad, and the double backward. Same semantics as the op."""
    loss_rows, _, _ = cross_entropy_rows_reference(logits, target, weight, ignore_index, label_smoothing, z_loss)
    denom = denominator_reference(target, weight.detach() if weight is not None else None, ignore_index,
                                  logits.shape[-1], loss_rows.dtype)
    if reduction == "mean" and weight is not None and weight.requires_grad and not target.is_floating_point():
        # the weights' gradient flows through the denominator too
        valid, in_range, safe = _index_parts(target, logits.shape[-1], ignore_index)
        denom = torch.where(valid & in_range, weight.to(loss_rows.dtype).gather(0, safe), 0.0).sum()
    return reduce_rows(loss_rows, denom, reduction, loss_rows.dtype)


# ----------------------------------------------------------------------------- forward


@custom_op("fusedlayers::cross_entropy")
def cross_entropy(
    logits: Tensor, target: Tensor, weight: Tensor | None, ignore_index: int, reduction: str,
    label_smoothing: float, z_loss: float, out_dtype: torch.dtype,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    check_targets(target, logits.shape[-1], ignore_index)
    if _run_kernel(logits):
        w = kernel_weight(weight)
        loss_rows, lse, aux = kernels.cross_entropy_forward(logits, target, ignore_index, label_smoothing, z_loss,
                                                            weight=w)
        if reduction == "none":
            loss, denom = loss_rows.to(out_dtype), torch.zeros((), dtype=torch.float32, device=logits.device)
        else:
            loss, denom = kernels.cross_entropy_reduce(loss_rows, target, ignore_index, reduction == "mean",
                                                       out_dtype, weight=w)
        return loss, lse, aux if aux is not None else lse.new_empty((0,)), denom
    loss_rows, lse, aux = cross_entropy_rows_reference(logits, target, weight, ignore_index, label_smoothing,
                                                       z_loss)
    acc = loss_rows.dtype
    if reduction == "none":
        denom = torch.zeros((), dtype=acc, device=logits.device)
    else:
        denom = denominator_reference(target, weight, ignore_index, logits.shape[-1], acc)
    aux = aux.contiguous() if aux is not None else lse.new_empty((0,))
    return reduce_rows(loss_rows, denom, reduction, out_dtype), lse.contiguous(), aux, denom


@cross_entropy.register_fake
def _(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype):
    rows = logits.shape[0]
    acc = _accumulator(logits.dtype)
    loss = logits.new_empty((rows,) if reduction == "none" else (), dtype=out_dtype)
    aux_rows = rows if needs_aux(target.is_floating_point(), weight is not None, label_smoothing) else 0
    return (loss, logits.new_empty((2, rows), dtype=acc), logits.new_empty((aux_rows,), dtype=acc),
            logits.new_empty((), dtype=acc))


def _setup_context(ctx, inputs, output):
    logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, _ = inputs
    _, lse, aux, denom = output
    ctx.args = (ignore_index, reduction, label_smoothing, z_loss)
    ctx.mark_non_differentiable(lse, aux, denom)
    ctx.set_materialize_grads(False)  # no zero-filled gradients for lse, aux and denom
    ctx.save_for_backward(logits, target, weight, lse, aux, denom)


def _autograd(ctx, grad, *_unused):
    logits, target, weight, lse, aux, denom = ctx.saved_tensors
    need_x, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1] and target.is_floating_point()
    grad_logits = grad_target = None
    if grad is not None and (need_x or need_t):
        gx, gt = call(cross_entropy_backward, grad, logits, target, weight, lse, aux, denom, *ctx.args, need_t)
        grad_logits = gx if need_x else None
        grad_target = gt if need_t else None
    return grad_logits, grad_target, None, None, None, None, None, None


register_autograd(cross_entropy, _autograd, _setup_context)


# ----------------------------------------------------------------------------- backward


@custom_op("fusedlayers::cross_entropy_backward")
def cross_entropy_backward(
    grad: Tensor, logits: Tensor, target: Tensor, weight: Tensor | None, lse: Tensor, aux: Tensor, denom: Tensor,
    ignore_index: int, reduction: str, label_smoothing: float, z_loss: float, target_grad: bool,
) -> tuple[Tensor, Tensor]:
    """``denom``: the forward's denominator ("mean" divides by it); ``target_grad``: also the gradient of
    probability targets (else an empty second output)."""
    soft = target.is_floating_point()
    target_grad = target_grad and soft
    has_aux = needs_aux(soft, weight is not None, label_smoothing)
    if _run_kernel(logits):
        out = torch.empty(logits.shape, dtype=logits.dtype, device=logits.device)
        gt = torch.empty(target.shape, dtype=target.dtype, device=target.device) if target_grad else None
        kernels.cross_entropy_backward(grad, logits, target, lse, ignore_index, label_smoothing, z_loss, out,
                                       denom if reduction == "mean" else None, weight=kernel_weight(weight),
                                       aux=aux if has_aux else None, grad_target=gt)
        return out, gt if gt is not None else logits.new_empty((0,))
    acc = _accumulator(logits.dtype)
    g = grad.to(acc) / denom if reduction == "mean" else grad.to(acc)
    g_rows = g.expand(logits.shape[0]) if g.dim() == 0 else g
    d, dq = cross_entropy_grad_reference(g_rows, logits, target, weight, lse, aux if has_aux else None,
                                         ignore_index, label_smoothing, z_loss, target_grad)
    return (d.to(logits.dtype).contiguous(),
            dq.to(target.dtype).contiguous() if dq is not None else logits.new_empty((0,)))


@cross_entropy_backward.register_fake
def _(grad, logits, target, weight, lse, aux, denom, ignore_index, reduction, label_smoothing, z_loss, target_grad):
    gt = (torch.empty_like(target, memory_format=torch.contiguous_format)
          if target_grad and target.is_floating_point() else logits.new_empty((0,)))
    return torch.empty_like(logits, memory_format=torch.contiguous_format), gt


def _backward_setup_context(ctx, inputs, output):
    grad, logits, target, weight, *_, ignore_index, reduction, label_smoothing, z_loss, target_grad = inputs
    ctx.args = (ignore_index, reduction, label_smoothing, z_loss)
    ctx.target_grad = target_grad and target.is_floating_point()
    ctx.save_for_backward(grad, logits, target, weight)


def _backward_autograd(ctx, v_logits, v_target):
    """Double backward (PyTorch ops; not a hot path): the vector-Jacobian product of the backward, taken by
    autograd through :func:`cross_entropy_composite` with ``create_graph``."""
    grad, logits, target, weight = ctx.saved_tensors
    needs = ctx.needs_input_grad
    soft = target.is_floating_point()
    want = [needs[0], needs[1], soft and needs[2]]
    outputs = [None] * 12
    if not any(want):
        return tuple(outputs)
    with torch.enable_grad():
        acc = _accumulator(logits.dtype)
        g = grad.detach().to(acc).requires_grad_()
        x = logits.detach().requires_grad_()
        t = target.detach().requires_grad_() if soft else target
        loss = cross_entropy_composite(x, t, weight.detach() if weight is not None else None, *ctx.args)
        wrt = [x, t] if ctx.target_grad else [x]
        first = torch.autograd.grad(loss, wrt, g, create_graph=True)
        vs = [v_logits, v_target][: len(first)]
        leaves = [a for a, w in zip((g, x, t), want, strict=True) if w]
        seconds = iter(torch.autograd.grad(first, leaves, vs, allow_unused=True))
    for i, (w, like) in enumerate(zip(want, (grad, logits, target), strict=True)):
        if w:
            s = next(seconds)
            outputs[i] = torch.zeros_like(like) if s is None else s.to(like.dtype)
    return tuple(outputs)


register_autograd(cross_entropy_backward, _backward_autograd, _backward_setup_context)
