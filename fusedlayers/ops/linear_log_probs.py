"""Per-token log-probabilities of a linear head, chunked over the tokens: the ``torch.ops.fusedlayers`` ops.

``log_probs[i] = log_softmax(z_i)[target_i]`` with ``z = transform(input @ linear_weight.T + linear_bias)`` (scale,
optional soft-cap, temperature; see ``fusedlayers.kernels.linear_log_probs``), optionally the entropy of softmax(z)
and TRL's logged statistics, without the (N, V) logits ever existing: rows go ``chunk_size`` at a time through one
reused (chunk_size, V) buffer, as in ``fusedlayers.ops.linear_cross_entropy`` (cuBLAS products, Triton row passes).

Ops (2-D input (N, H), linear_weight (V, H), linear_bias (V,) or None, target (N,) class indices):

- ``linear_log_probs(input, linear_weight, target, linear_bias, ignore_index, scale, softcap, temperature,
  chunk_size, compute_dtype, entropy, stats) -> (log_probs, entropy, lse, stats)``: log_probs (N,) and entropy
  (N,) in fp32 (fp64 for fp64), both 0 where the target is ``ignore_index``; lse (2, N) the row's logsumexp as the
  pair (max, log sum) saved for backward; stats (3, N) (mean z, log sum_j p_j^2, target is the argmax) without
  gradient. ``entropy`` / ``stats`` False: those outputs are empty. log_probs and entropy are differentiable.
- ``linear_log_probs_backward(grad_log_probs, grad_entropy, input, linear_weight, target, linear_bias, lse,
  entropy, ...) -> (gx, gw, gb)``: each row has its own upstream gradient, so backward recomputes the logits chunk
  by chunk (one more product than the forward's) and writes dloss/dlogits over the chunk, then the two gradient
  products. A loss that knows each row's gradient while the logits are at hand skips the recomputation: that is
  :func:`chunked_linear_log_probs` with a ``row_grads`` callback (``fusedlayers.post_training``).

Saved for backward: the inputs, lse and entropy (N-sized); the logits buffer lives only inside an op call.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from fusedlayers import _validate as v
from fusedlayers.backend import use_triton
from fusedlayers.ops._eager import call, custom_op, register_autograd
from fusedlayers.ops.linear_cross_entropy import (
    _accumulator,
    _addmm_acc_,
    chunk_logits_,
    default_chunk_size,
    matmul_dtype,
    transform_reference,
)

try:
    from fusedlayers.kernels import linear_log_probs as kernels
except ImportError:  # no Triton: the reference runs everywhere
    kernels = None

STATS = ("mean_logits", "log_sum_sq_probs", "is_top1")


# ----------------------------------------------------------------------------- the PyTorch reference, per chunk


def log_probs_rows_reference(logits: Tensor, target: Tensor, ignore_index: int, scale: float, softcap: float | None,
                             temperature: float, acc: torch.dtype, lp: Tensor, lse: Tensor, entropy: Tensor | None,
                             stats: Tensor | None) -> None:
    """The forward kernel's outputs, written out in PyTorch (targets already checked to be in range)."""
    z, _ = transform_reference(logits.to(acc), scale, softcap, temperature)
    valid = target != ignore_index
    m = z.amax(1).clamp_min(torch.finfo(acc).min)  # a finite shift, as the kernel's
    log_s = torch.logsumexp(z - m[:, None], 1)
    rel = (z - m[:, None]) - log_s[:, None]  # log p
    z_t = z.gather(1, target.where(valid, 0)[:, None]).squeeze(1)
    zero = torch.zeros((), dtype=acc, device=z.device)
    lp.copy_(torch.where(valid, (z_t - m) - log_s, zero))
    lse.copy_(torch.stack([m, log_s]).where(valid, zero))
    p = rel.exp()
    if entropy is not None:
        entropy.copy_(torch.where(valid, -torch.where(p > 0, p * rel, zero).sum(1), zero))
    if stats is not None:
        before = torch.arange(z.shape[1], device=z.device)[None, :] < target[:, None]
        top1 = (z_t >= z.amax(1)) & (z_t > z.masked_fill(~before, -torch.inf).amax(1))
        values = torch.stack([z.mean(1), torch.logsumexp(2 * rel, 1), top1.to(acc)])
        stats.copy_(values.where(valid, zero))


def log_probs_grad_reference(logits: Tensor, target: Tensor, ignore_index: int, scale: float, softcap: float | None,
                             temperature: float, acc: torch.dtype, lse: Tensor, entropy: Tensor | None,
                             g: Tensor | None, h: Tensor | None) -> Tensor:
    """dloss/dlogits of a chunk for per-row gradients g (of the log-prob) and h (of the entropy), in ``acc``."""
    z, dz_dx = transform_reference(logits.to(acc), scale, softcap, temperature)
    rel = (z - lse[0][:, None]) - lse[1][:, None]
    p = rel.exp()
    valid = target != ignore_index
    g = torch.zeros(z.shape[0], dtype=acc, device=z.device) if g is None else g.to(acc)
    coef = g[:, None].expand_as(z)
    if h is not None:
        coef = coef + h.to(acc)[:, None] * (rel + entropy[:, None])
    dz = -p * coef
    dz.scatter_add_(1, target.where(valid, 0)[:, None], g[:, None])
    return (dz * dz_dx).where(valid[:, None], 0)


# ----------------------------------------------------------------------------- the chunk loop


RowGrads = Callable[[int, int, Tensor, Tensor | None], tuple[Tensor | None, Tensor | None]]


def chunked_linear_log_probs(
    x: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Tensor | None, ignore_index: int, scale: float,
    softcap: float | None, temperature: float, chunk_size: int, compute_dtype: torch.dtype, want_entropy: bool,
    want_stats: bool, row_grads: RowGrads | tuple[Tensor | None, Tensor | None] | None = None,
    need_gx: bool = False, need_gw: bool = False, need_gb: bool = False, lse_in: Tensor | None = None,
    entropy_in: Tensor | None = None, bounds: list[int] | None = None, accumulation_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """The loop over row chunks shared by the ops here and the fused losses.

    Returns (log_probs, entropy, lse, stats, gx, gw, gb). ``row_grads``:

    - None: the forward only (log_probs, entropy, lse, stats).
    - a pair (g, h) of (N,) upstream gradients (either None): backward from the saved ``lse_in`` / ``entropy_in``;
      the logits are recomputed.
    - a callable ``(start, stop, log_probs[start:stop], entropy[start:stop]) -> (g, h)`` called once per chunk after
      its forward: the rows' gradients are known while the logits are at hand, so the gradients are computed in the
      same pass (three products in all, as linear_cross_entropy's). ``bounds`` (optional) are the chunk
      boundaries, e.g. whole sequences for a loss of sequences.

    gx in the input's dtype, gw in ``accumulation_dtype`` (default fp32, fp64 for fp64: the weight's own 16-bit dtype
    saves the accumulator and its final cast, at a rounding per chunk), gb in fp32 (fp64). Runs with autocast off:
    the dtypes are chosen.
    """
    with torch.autocast(x.device.type, enabled=False):
        n_rows, n_classes = x.shape[0], linear_weight.shape[0]
        acc = _accumulator(compute_dtype)
        compute_dtype = matmul_dtype(compute_dtype, x.device)
        use_kernels = compute_dtype != torch.float64 and use_triton(x)
        backward_only = isinstance(row_grads, tuple)
        fused = callable(row_grads)
        lp = torch.zeros(n_rows, dtype=acc, device=x.device)
        lse = lse_in if backward_only else torch.zeros(2, n_rows, dtype=acc, device=x.device)
        entropy = entropy_in if backward_only else (
            torch.zeros(n_rows, dtype=acc, device=x.device) if want_entropy else None)
        stats = torch.zeros(3, n_rows, dtype=acc, device=x.device) if want_stats and not backward_only else None
        gx = gw = gb = None
        if row_grads is not None:
            gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_gx else None
            gw_dtype = accumulation_dtype or acc
            gw = torch.empty(linear_weight.shape, dtype=gw_dtype, device=x.device) if need_gw else None
            gb = torch.zeros(n_classes, dtype=acc, device=x.device) if need_gb and linear_bias is not None else None
        if bounds is None:
            chunk_size = max(1, min(chunk_size, n_rows))
            bounds = list(range(0, n_rows, chunk_size)) + [n_rows]
        widest = max((b - a for a, b in zip(bounds, bounds[1:], strict=False)), default=0)
        w = linear_weight.to(compute_dtype)  # no copy when it already is (a cast once under autocast)
        b = linear_bias.to(compute_dtype) if linear_bias is not None else None
        buffer = torch.empty(widest, n_classes, dtype=compute_dtype, device=x.device)
        weight_t = w.t()
        transform = (scale, softcap, temperature)
        first = True
        for start, stop in zip(bounds, bounds[1:], strict=False):
            ent_c = entropy[start:stop] if entropy is not None else None
            if stop == start:  # a loss still sees its chunk (its groups may count without rows)
                if fused:
                    row_grads(start, stop, lp[start:stop], ent_c)
                continue
            x_c, t_c = x[start:stop].to(compute_dtype), target[start:stop]
            logits = chunk_logits_(buffer[: stop - start], x_c, weight_t, b)
            if not backward_only:
                _forward_rows(use_kernels, logits, t_c, ignore_index, transform, acc, lp[start:stop],
                              lse[:, start:stop], ent_c, stats[:, start:stop] if stats is not None else None)
            if row_grads is None:
                continue
            if fused:
                g, h = row_grads(start, stop, lp[start:stop], ent_c)
            else:
                g, h = (r[start:stop] if r is not None else None for r in row_grads)
            _backward_rows_(use_kernels, logits, t_c, ignore_index, transform, acc, lse[:, start:stop], ent_c, g, h)
            if gx is not None:
                if gx.dtype == compute_dtype:
                    torch.mm(logits, w, out=gx[start:stop])
                else:
                    gx[start:stop] = torch.mm(logits, w)
            if gw is not None:
                _addmm_acc_(gw, logits.t(), x_c, first)
            if gb is not None:
                gb += logits.sum(0, dtype=acc)
            first = False
        if gw is not None and first:
            gw.zero_()
        return lp, entropy, lse, stats, gx, gw, gb


def _forward_rows(use_kernels, logits, target, ignore_index, transform, acc, lp, lse, entropy, stats):
    if use_kernels:
        kernels.log_probs_forward(logits, target, ignore_index, *transform, lp, lse, entropy, stats)
    else:
        log_probs_rows_reference(logits, target, ignore_index, *transform, acc, lp, lse, entropy, stats)


def _backward_rows_(use_kernels, logits, target, ignore_index, transform, acc, lse, entropy, g, h):
    """g, h: the rows' upstream gradients (or None); the gradient of the logits written over them."""
    g = g.to(acc).contiguous() if g is not None else None
    h = h.to(acc).contiguous() if h is not None else None
    if use_kernels:
        kernels.log_probs_backward_(logits, target, ignore_index, *transform, lse, entropy, g, h)
    else:
        logits.copy_(log_probs_grad_reference(logits, target, ignore_index, *transform, acc, lse, entropy, g, h))


def chunk_rows(chunk_size: int, input: Tensor, linear_weight: Tensor, compute_dtype: torch.dtype) -> int:
    """Rows per chunk: ``chunk_size`` if positive, else as linear_cross_entropy's default."""
    if chunk_size > 0:
        return chunk_size
    return default_chunk_size(input.shape[0], linear_weight.shape[0], matmul_dtype(compute_dtype, input.device),
                              input.device)


# ----------------------------------------------------------------------------- ops


def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    return like.new_empty((0,), dtype=dtype)


@custom_op("fusedlayers::linear_log_probs")
def linear_log_probs(
    input: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Tensor | None, ignore_index: int,
    scale: float, softcap: float | None, temperature: float, chunk_size: int, compute_dtype: torch.dtype,
    entropy: bool, stats: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if target.device.type == "cpu":  # in the op: it reads the values, which torch.compile cannot trace
        v.check_target_range("target", target, linear_weight.shape[0], ignore_index)
    chunk = chunk_rows(chunk_size, input, linear_weight, compute_dtype)
    lp, ent, lse, st, *_ = chunked_linear_log_probs(input, linear_weight, target, linear_bias, ignore_index, scale,
                                                    softcap, temperature, chunk, compute_dtype, entropy, stats)
    acc = lp.dtype
    return lp, ent if ent is not None else _empty(lp, acc), lse, st if st is not None else _empty(lp, acc)


@linear_log_probs.register_fake
def _(input, linear_weight, target, linear_bias, ignore_index, scale, softcap, temperature, chunk_size,
      compute_dtype, entropy, stats):
    n, acc = input.shape[0], _accumulator(compute_dtype)
    return (input.new_empty((n,), dtype=acc), input.new_empty((n if entropy else 0,), dtype=acc),
            input.new_empty((2, n), dtype=acc), input.new_empty((3, n) if stats else (0,), dtype=acc))


def _setup_context(ctx, inputs, output):
    input, linear_weight, target, linear_bias, *ctx.args = inputs
    _, entropy, lse, stats = output
    ctx.mark_non_differentiable(lse, stats)
    ctx.set_materialize_grads(False)  # an entropy computed for logging only costs no backward work
    ctx.has_bias = linear_bias is not None
    ctx.save_for_backward(input, linear_weight, target, linear_bias, lse, entropy)


def _autograd(ctx, grad_log_probs, grad_entropy, *_unused):
    needs = ctx.needs_input_grad
    want = (needs[0], needs[1], ctx.has_bias and needs[3])
    outs = [None] * 3
    if any(want) and (grad_log_probs is not None or grad_entropy is not None):
        input, linear_weight, target, linear_bias, lse, entropy = ctx.saved_tensors
        grads = call(linear_log_probs_backward, grad_log_probs, grad_entropy, input, linear_weight, target,
                     linear_bias, lse, entropy, *ctx.args[:6], *want)
        outs = [g if w else None for g, w in zip(grads, want, strict=True)]
    # inputs: input, linear_weight, target, linear_bias, then 8 non-tensor arguments
    return outs[0], outs[1], None, outs[2], *(None,) * 8


register_autograd(linear_log_probs, _autograd, _setup_context)


@custom_op("fusedlayers::linear_log_probs_backward")
def linear_log_probs_backward(
    grad_log_probs: Tensor | None, grad_entropy: Tensor | None, input: Tensor, linear_weight: Tensor, target: Tensor,
    linear_bias: Tensor | None, lse: Tensor, entropy: Tensor, ignore_index: int, scale: float, softcap: float | None,
    temperature: float, chunk_size: int, compute_dtype: torch.dtype, grad_input: bool, grad_weight: bool,
    grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    chunk = chunk_rows(chunk_size, input, linear_weight, compute_dtype)
    *_, gx, gw, gb = chunked_linear_log_probs(
        input, linear_weight, target, linear_bias, ignore_index, scale, softcap, temperature, chunk, compute_dtype,
        False, False, (grad_log_probs, grad_entropy if entropy.numel() else None), grad_input, grad_weight,
        grad_bias, lse_in=lse, entropy_in=entropy if entropy.numel() else None,
    )
    return (gx if gx is not None else input.new_empty((0,)),
            gw.to(linear_weight.dtype) if gw is not None else linear_weight.new_empty((0,)),
            gb.to(linear_bias.dtype) if gb is not None else linear_weight.new_empty((0,)))


@linear_log_probs_backward.register_fake
def _(grad_log_probs, grad_entropy, input, linear_weight, target, linear_bias, lse, entropy, ignore_index, scale,
      softcap, temperature, chunk_size, compute_dtype, grad_input, grad_weight, grad_bias):
    has_gb = grad_bias and linear_bias is not None
    return (input.new_empty(input.shape if grad_input else (0,)),
            linear_weight.new_empty(linear_weight.shape if grad_weight else (0,)),
            linear_bias.new_empty(linear_bias.shape) if has_gb else linear_weight.new_empty((0,)))
