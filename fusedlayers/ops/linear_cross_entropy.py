"""Linear + cross-entropy ops in the ``torch.ops.fusedlayers`` namespace, chunked over the tokens.

``loss = cross_entropy(input @ weight.T + bias, target)`` without the (N, V) logits ever existing: rows
are processed ``chunk_size`` at a time through one reused (chunk_size, V) buffer.

Ops (2-D input (N, H), weight (V, H), bias (V,) or None, target (N,); ``fusedlayers.functional``
reshapes and validates):

- ``linear_cross_entropy(input, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss,
  chunk_size, out_dtype, grad_input, grad_weight, grad_bias) -> (loss, lse, gx, gw, gb)``.
  For "mean"/"sum" with any of the three ``grad_*`` flags set, the same pass over the chunks also
  computes the gradients for an upstream gradient of 1 (the loss is a scalar, so backward only scales
  them): gx in the input dtype, gw and gb accumulated across chunks in fp32 (fp64 for fp64). Otherwise
  (reduction "none", or no gradient wanted) it computes the loss and the fp32 logsumexp per row only.
  Only ``loss`` is differentiable; the buffers not computed are empty tensors.
- ``linear_cross_entropy_scale_grad(buffer, grad, dtype) -> grad_*``: ``(buffer * grad).to(dtype)``, the
  backward of the first case, in one pass.
- ``linear_cross_entropy_backward(grad, input, weight, target, bias, lse, ...) -> (gx, gw, gb)``: the
  backward of the second case ("none": each row has its own upstream gradient, which must be applied
  before the rows are summed into gw): recomputes the logits chunk by chunk from the saved logsumexp
  (one extra matmul), then the same three gradient products.

Saved for backward: the three gradient buffers (first case; not the input or weight), or the inputs and
the logsumexp (second case). The logits buffer lives only inside an op call. Loss semantics, ignored
rows and out-of-range targets are those of ``fusedlayers.ops.cross_entropy``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers import _validate as v
from fusedlayers.backend import use_triton
from fusedlayers.ops import cross_entropy as ce
from fusedlayers.ops._eager import call, custom_op, register_autograd

try:
    from fusedlayers.kernels import cross_entropy as ce_kernels
    from fusedlayers.kernels import linear_cross_entropy as kernels
except ImportError:  # no Triton: the reference runs everywhere
    ce_kernels = kernels = None

# Budget for the (chunk_size, V) logits buffer: a fraction of the free GPU memory, at most MAX_CHUNK_BYTES.
MAX_CHUNK_BYTES = 2**30
CPU_CHUNK_BYTES = 64 * 2**20
FREE_MEMORY_FRACTION = 8


def default_chunk_size(n_rows: int, n_classes: int, dtype: torch.dtype, device: torch.device) -> int:
    """Rows per chunk: as many as fit the buffer budget (min(free memory / 8, 1 GiB) on CUDA, 64 MiB on
    CPU), evened out over the chunks and, past 64 rows, made a multiple of 64 within the budget.

    Bigger chunks mean fewer passes over the fp32 grad_weight accumulator (each chunk after the first
    reads and writes it: 8 * V * H bytes) and bigger, more efficient matmuls; smaller chunks mean less
    memory. On an H200 with N=8192, H=2048, V=128256 (bf16), forward+backward: 4096-row chunks (1 GiB)
    20.9 ms / 2036 MiB peak, 2048 rows 21.5 ms / 1568 MiB, 1024 rows 23.1 ms / 1568 MiB
    (benchmarks/results/h200-linear_cross_entropy.md).
    """
    row_bytes = max(1, n_classes * dtype.itemsize)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(free // FREE_MEMORY_FRACTION, MAX_CHUNK_BYTES)
    else:
        budget = CPU_CHUNK_BYTES
    rows_fit = max(1, budget // row_bytes)
    if rows_fit >= n_rows:
        return max(1, n_rows)
    n_chunks = -(-n_rows // rows_fit)
    rows = -(-n_rows // n_chunks)  # the same work in every chunk
    if rows > 64:  # matmul-friendly: a multiple of 64, within the budget
        rows = -(-rows // 64) * 64
        if rows > rows_fit:
            rows = rows_fit // 64 * 64
    return rows


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run_kernel(x: Tensor) -> bool:
    return x.dtype != torch.float64 and use_triton(x)


# ----------------------------------------------------------------------------- the chunk loop


def _chunk_ce_forward(use_kernels, logits, target, ignore_index, smoothing, z_loss, loss_out, lse_out):
    if use_kernels:
        ce_kernels.cross_entropy_forward(logits, target, ignore_index, smoothing, z_loss, loss_out, lse_out)
        return
    loss, lse = ce.cross_entropy_rows_reference(logits, target, ignore_index, smoothing, z_loss)
    loss_out.copy_(loss)
    lse_out.copy_(lse)


def _chunk_ce_forward_backward_(use_kernels, logits, target, g, ignore_index, smoothing, z_loss, loss_out,
                                lse_out):
    """Loss and lse into the outputs, and g * dloss/dlogits written over ``logits`` (our own buffer).

    Two kernels (a read pass, then a read + write pass): on an H200 0.81 ms on a 4096 x 128256 bf16 chunk
    (92% of a copy for its three passes), slightly faster than a single kernel that re-reads each row for
    its second sweep (0.42 ms per 2048 rows, 59% of a copy for two passes; measured while developing)."""
    if use_kernels:
        ce_kernels.cross_entropy_forward(logits, target, ignore_index, smoothing, z_loss, loss_out, lse_out)
        ce_kernels.cross_entropy_backward(g, logits, target, lse_out, ignore_index, smoothing, z_loss, out=logits)
        return
    loss, lse = ce.cross_entropy_rows_reference(logits, target, ignore_index, smoothing, z_loss)
    loss_out.copy_(loss)
    lse_out.copy_(lse)
    g_rows = g.expand(logits.shape[0]) if g.dim() == 0 else g
    logits.copy_(ce.cross_entropy_grad_reference(g_rows, logits, target, lse, ignore_index, smoothing, z_loss))


def _chunk_ce_backward_(use_kernels, logits, target, lse, g, ignore_index, smoothing, z_loss):
    """g * dloss/dlogits from the saved lse, written over ``logits`` (our own buffer)."""
    if use_kernels:
        ce_kernels.cross_entropy_backward(g, logits, target, lse, ignore_index, smoothing, z_loss, out=logits)
        return
    g_rows = g.expand(logits.shape[0]) if g.dim() == 0 else g
    logits.copy_(ce.cross_entropy_grad_reference(g_rows, logits, target, lse, ignore_index, smoothing, z_loss))


def _addmm_acc_(acc: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """acc += a @ b in acc's dtype; ``first``: acc = a @ b (acc may be uninitialised)."""
    beta = 0.0 if first else 1.0
    if kernels is not None:
        kernels.addmm_fp32_(acc, a, b, beta)
    elif a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
    else:
        acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)


def chunked_linear_cross_entropy(
    x: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int, smoothing: float,
    z_loss: float, chunk_size: int, row_grad: Tensor | None, need_gx: bool, need_gw: bool, need_gb: bool,
    lse_in: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None]:
    """The loop over row chunks shared by every op here (Triton CE kernels or the PyTorch reference).

    ``row_grad``: None -> loss and lse only. Else the factor of each row's gradient (0-d or (N,)), and
    the gradients wanted are computed in the same pass: gx (input dtype), gw and gb (fp32/fp64
    accumulators). ``lse_in``: the saved logsumexp (backward): the loss is not recomputed.

    Runs with autocast off: the op's dtypes are already chosen (``fl.linear_cross_entropy`` casts under
    autocast), and autocast would otherwise recast the matmuls here (the fp32 grad_weight accumulation
    included) when the op is called inside an autocast region.
    """
    with torch.autocast(x.device.type, enabled=False):
        n_rows, _ = x.shape
        n_classes = weight.shape[0]
        acc = _accumulator(x.dtype)
        use_kernels = _run_kernel(x)
        loss = torch.zeros(n_rows, dtype=acc, device=x.device)
        lse = torch.zeros(n_rows, dtype=acc, device=x.device)
        gx = gw = gb = None
        if row_grad is not None:
            gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_gx else None
            gw = torch.empty(weight.shape, dtype=acc, device=x.device) if need_gw else None  # first chunk: beta=0
            gb = torch.zeros(n_classes, dtype=acc, device=x.device) if need_gb and bias is not None else None
        if n_rows == 0:
            return loss, lse, gx, gw, gb
        chunk_size = max(1, min(chunk_size, n_rows))
        buffer = torch.empty(chunk_size, n_classes, dtype=x.dtype, device=x.device)
        weight_t = weight.t()
        for start in range(0, n_rows, chunk_size):
            stop = min(start + chunk_size, n_rows)
            x_c, t_c = x[start:stop], target[start:stop]
            logits = buffer[: stop - start]
            if bias is not None:
                torch.addmm(bias, x_c, weight_t, out=logits)
            else:
                torch.mm(x_c, weight_t, out=logits)
            if row_grad is None:
                _chunk_ce_forward(use_kernels, logits, t_c, ignore_index, smoothing, z_loss, loss[start:stop],
                                  lse[start:stop])
                continue
            g = row_grad if row_grad.dim() == 0 else row_grad[start:stop]
            if lse_in is None:
                _chunk_ce_forward_backward_(use_kernels, logits, t_c, g, ignore_index, smoothing, z_loss,
                                            loss[start:stop], lse[start:stop])
            else:
                _chunk_ce_backward_(use_kernels, logits, t_c, lse_in[start:stop], g, ignore_index, smoothing, z_loss)
            if gx is not None:
                torch.mm(logits, weight, out=gx[start:stop])
            if gw is not None:
                _addmm_acc_(gw, logits.t(), x_c, first=start == 0)
            if gb is not None:
                gb += logits.sum(0, dtype=acc)
        return loss, lse, gx, gw, gb


def _check(x: Tensor, target: Tensor, n_classes: int, ignore_index: int) -> None:
    if target.device.type == "cpu" and target.numel():
        v.check_target_range("target", target, n_classes, ignore_index)


def _empty(x: Tensor) -> Tensor:
    return x.new_empty((0,))


# ----------------------------------------------------------------------------- forward


@custom_op("fusedlayers::linear_cross_entropy")
def linear_cross_entropy(
    input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, ignore_index: int, reduction: str,
    label_smoothing: float, z_loss: float, chunk_size: int, out_dtype: torch.dtype, grad_input: bool,
    grad_weight: bool, grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check(input, target, weight.shape[0], ignore_index)
    if chunk_size <= 0:
        chunk_size = default_chunk_size(input.shape[0], weight.shape[0], input.dtype, input.device)
    acc = _accumulator(input.dtype)
    count = (target != ignore_index).sum()
    precompute = reduction != "none" and (grad_input or grad_weight or (grad_bias and bias is not None))
    row_grad = None
    if precompute:
        one = torch.ones((), dtype=acc, device=input.device)
        row_grad = one / count if reduction == "mean" else one
    loss_rows, lse, gx, gw, gb = chunked_linear_cross_entropy(
        input, weight, target, bias, ignore_index, label_smoothing, z_loss, chunk_size, row_grad,
        grad_input, grad_weight, grad_bias,
    )
    if reduction == "none":
        loss = loss_rows.to(out_dtype)
    elif reduction == "sum":
        loss = loss_rows.sum().to(out_dtype)
    else:
        loss = (loss_rows.sum() / count).to(out_dtype)
    return (loss, lse, gx if gx is not None else _empty(input), gw if gw is not None else _empty(lse),
            gb if gb is not None else _empty(lse))


def _precomputes(reduction: str, grad_input: bool, grad_weight: bool, grad_bias: bool, bias) -> bool:
    return reduction != "none" and (grad_input or grad_weight or (grad_bias and bias is not None))


@linear_cross_entropy.register_fake
def _(input, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, chunk_size, out_dtype,
      grad_input, grad_weight, grad_bias):
    n_rows, n_classes = input.shape[0], weight.shape[0]
    acc = _accumulator(input.dtype)
    loss = input.new_empty((n_rows,) if reduction == "none" else (), dtype=out_dtype)

    def empty():  # a distinct (0,) tensor per output, as the real op returns
        return input.new_empty((0,), dtype=acc)

    lse = input.new_empty((n_rows,), dtype=acc)
    if not _precomputes(reduction, grad_input, grad_weight, grad_bias, bias):
        return loss, lse, input.new_empty((0,)), empty(), empty()
    gx = input.new_empty(input.shape) if grad_input else input.new_empty((0,))
    gw = input.new_empty(weight.shape, dtype=acc) if grad_weight else empty()
    gb = input.new_empty((n_classes,), dtype=acc) if grad_bias and bias is not None else empty()
    return loss, lse, gx, gw, gb


def _setup_context(ctx, inputs, output):
    (input, weight, target, bias, ignore_index, reduction, label_smoothing, z_loss, chunk_size, _,
     grad_input, grad_weight, grad_bias) = inputs
    _, lse, gx, gw, gb = output
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero-filled (V, H) fp32 gradient for the gw output
    ctx.precomputed = _precomputes(reduction, grad_input, grad_weight, grad_bias, bias)
    ctx.flags = (grad_input, grad_weight, grad_bias and bias is not None)
    ctx.dtypes = (input.dtype, weight.dtype, bias.dtype if bias is not None else None)
    ctx.has_bias = bias is not None
    ctx.args = (ignore_index, reduction, label_smoothing, z_loss, chunk_size)
    # Gradients that may be asked for but were not computed in the forward (the op called directly with a
    # grad_* flag off for an input that requires grad) are recomputed from the inputs and the lse.
    requires = [t is not None and t.requires_grad for t in (input, weight, bias)]
    ctx.recompute = not ctx.precomputed or any(r and not f for r, f in zip(requires, ctx.flags, strict=True))
    saved = (gx, gw, gb) if ctx.precomputed else (None, None, None)
    inputs_saved = (input, weight, target, bias, lse) if ctx.recompute else (None,) * 5
    ctx.save_for_backward(*saved, *inputs_saved)


def _autograd(ctx, grad, *_unused):
    needs = ctx.needs_input_grad
    want = (needs[0], needs[1], ctx.has_bias and needs[3])
    if grad is None:  # the loss got no gradient (grads are not materialised): nothing flows back
        want = (False, False, False)
    gx, gw, gb, input, weight, target, bias, lse = ctx.saved_tensors
    precomputed = ctx.flags if ctx.precomputed else (False, False, False)
    outs = [
        call(linear_cross_entropy_scale_grad, buf, grad, dtype) if w and have else None
        for buf, w, have, dtype in zip((gx, gw, gb), want, precomputed, ctx.dtypes, strict=True)
    ]
    rest = [w and not have for w, have in zip(want, precomputed, strict=True)]
    if any(rest):
        recomputed = call(linear_cross_entropy_backward, grad, input, weight, target, bias, lse, *ctx.args, *rest)
        outs = [r if need else o for o, r, need in zip(outs, recomputed, rest, strict=True)]
    return outs[0], outs[1], None, outs[2], None, None, None, None, None, None, None, None, None


register_autograd(linear_cross_entropy, _autograd, _setup_context)


# ----------------------------------------------------------------------------- backward ops


@custom_op("fusedlayers::linear_cross_entropy_scale_grad")
def linear_cross_entropy_scale_grad(buffer: Tensor, grad: Tensor, dtype: torch.dtype) -> Tensor:
    if buffer.dtype != torch.float64 and dtype != torch.float64 and use_triton(buffer):
        return kernels.scale_cast(buffer, grad, dtype)
    acc = _accumulator(buffer.dtype)
    return (buffer.to(acc) * grad.to(acc)).to(dtype).contiguous()


@linear_cross_entropy_scale_grad.register_fake
def _(buffer, grad, dtype):
    return buffer.new_empty(buffer.shape, dtype=dtype)


@custom_op("fusedlayers::linear_cross_entropy_backward")
def linear_cross_entropy_backward(
    grad: Tensor, input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None, lse: Tensor,
    ignore_index: int, reduction: str, label_smoothing: float, z_loss: float, chunk_size: int,
    grad_input: bool, grad_weight: bool, grad_bias: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    if chunk_size <= 0:
        chunk_size = default_chunk_size(input.shape[0], weight.shape[0], input.dtype, input.device)
    row_grad = ce.grad_per_row(grad, target, ignore_index, reduction, _accumulator(input.dtype))
    _, _, gx, gw, gb = chunked_linear_cross_entropy(
        input, weight, target, bias, ignore_index, label_smoothing, z_loss, chunk_size, row_grad,
        grad_input, grad_weight, grad_bias, lse_in=lse,
    )
    return (
        gx if gx is not None else input.new_empty((0,)),
        gw.to(weight.dtype) if gw is not None else weight.new_empty((0,)),
        gb.to(bias.dtype) if gb is not None else weight.new_empty((0,)),
    )


@linear_cross_entropy_backward.register_fake
def _(grad, input, weight, target, bias, lse, ignore_index, reduction, label_smoothing, z_loss, chunk_size,
      grad_input, grad_weight, grad_bias):
    gx = input.new_empty(input.shape) if grad_input else input.new_empty((0,))
    gw = weight.new_empty(weight.shape) if grad_weight else weight.new_empty((0,))
    gb = bias.new_empty(bias.shape) if grad_bias and bias is not None else weight.new_empty((0,))
    return gx, gw, gb
