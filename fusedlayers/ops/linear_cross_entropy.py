"""Linear + cross-entropy ops in the ``torch.ops.fusedlayers`` namespace, chunked over the tokens.

``loss = cross_entropy(input @ linear_weight.T + linear_bias, target, weight)`` without the (N, V) logits ever
existing: rows are processed ``chunk_size`` at a time through one reused (chunk_size, V) buffer.

Ops (2-D input (N, H), linear_weight (V, H), linear_bias (V,) or None, target (N,) class indices or (N, V)
class probabilities, weight (V,) class weights or None; ``fusedlayers.functional`` reshapes and validates):

- ``linear_cross_entropy(input, linear_weight, target, linear_bias, weight, ignore_index, reduction,
  label_smoothing, z_loss, logit_scale, softcap, chunk_size, compute_dtype, accumulation_dtype, out_dtype,
  allow_retain_graph, grad_input, grad_weight, grad_bias, grad_target) -> (loss, lse, aux, gx, gw, gb, gt)``.
  The loss is taken of the transformed logits z = logit_scale * logits, then softcap * tanh(z / softcap)
  (``softcap`` None: none), as model heads that scale or soft-cap their logits (Cohere, Granite, Gemma 2).
  The matmuls run in ``compute_dtype`` (the autocast dtype under autocast, else the inputs' dtype: input,
  linear_weight and bias are cast to it chunk by chunk, the weight once; on CPU fp16/bf16 run in fp32, see
  :func:`matmul_dtype`). For "mean"/"sum" with any of the
  ``grad_*`` flags set, the same pass over the chunks also computes the gradients for an upstream gradient of
  1 (the loss is a scalar, so backward only scales them): gx in the input's dtype, gt in the target's, gw
  accumulated across chunks in ``accumulation_dtype`` (fp32 by default; the weight's own dtype is the
  memory-saving opt-in), gb in fp32 (fp64 for fp64). Otherwise (reduction "none", or no gradient wanted) it
  computes the loss and the per-row logsumexp (and aux, see ``fusedlayers.ops.cross_entropy``) only.
  Only ``loss`` is differentiable; the buffers not computed are empty tensors.
- ``linear_cross_entropy_scale_grad(buffer, grad, dtype) -> grad_*``: ``(buffer * grad).to(dtype)``, the
  backward of the first case, in one pass, when it cannot scale the buffer in place (below).
- ``linear_cross_entropy_backward(grad, input, linear_weight, target, linear_bias, weight, lse, aux, ...)
  -> (gx, gw, gb, gt)``: the backward of the second case ("none": each row has its own upstream gradient,
  which must be applied before the rows are summed into gw): recomputes the logits chunk by chunk from the
  saved logsumexp (one extra matmul), then the same gradient products.

Saved for backward: the gradient buffers (first case; not the input or weight), or the inputs, the logsumexp
and aux (second case). The logits buffer lives only inside an op call.

In-place backward (first case, as torch's own chunked op): where a precomputed buffer already has its
gradient's dtype (gx always; gw when accumulated in the weight's dtype -- the opt-in -- or for fp32 master
weights under autocast; gt), backward multiplies it by the upstream gradient in place and returns it, so the
gradient is the buffer itself (autograd then makes it ``.grad`` without a copy): no second gradient-sized
tensor. A second backward through the same graph then raises; ``allow_retain_graph`` (torch's
``LinearCrossEntropyOptions(allow_retain_graph=True)``) keeps the buffers and scales into new tensors
instead. Under torch.compile, a dispatch mode, a functorch transform or ``create_graph`` the scaling is
always out of place.

Loss semantics, ignored rows, class weights, probabilities and out-of-range targets are those of
``fusedlayers.ops.cross_entropy``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fusedlayers.backend import use_triton
from fusedlayers.ops import cross_entropy as ce
from fusedlayers.ops._eager import call, custom_op, register_autograd

try:
    from fusedlayers.kernels import cross_entropy as ce_kernels
    from fusedlayers.kernels import linear_cross_entropy as kernels
except ImportError:  # no Triton: the reference runs everywhere
    ce_kernels = kernels = None

# Budget for the (chunk_size, V) logits buffer: a fraction of the free GPU memory, at most MAX_CHUNK_BYTES; when
# grad_weight is accumulated in its own dtype (the accumulator is the gradient), at most the weight's size in the
# compute dtype, but never less than MIN_CAP_BYTES: a small weight gives small chunks, and every chunk reads and
# writes the whole accumulator once more. llama-small's LM head under autocast (V=50304, H=768, fp32 master weight,
# 32768 rows, H100): a 77 MB cap (768-row chunks, 43 of them) 20.9 ms forward+backward, a 256 MiB floor (2560 rows)
# 16.0 ms, 512 MiB 15.7 ms, 1 GiB 17.3 ms; the whole training step 71-77 -> 65 ms (+0.13 GB peak).
MAX_CHUNK_BYTES = 2**30
CPU_CHUNK_BYTES = 64 * 2**20
FREE_MEMORY_FRACTION = 8
MIN_CAP_BYTES = 256 * 2**20


def default_chunk_size(n_rows: int, n_classes: int, dtype: torch.dtype, device: torch.device,
                       max_bytes: int | None = None) -> int:
    """Rows per chunk: as many as fit the buffer budget (min(free memory / 8, 1 GiB) on CUDA, 64 MiB on CPU,
    and at most ``max_bytes``), evened out over the chunks and, past 64 rows, made a multiple of 64 within the
    budget.

    Bigger chunks mean fewer passes over the grad_weight accumulator (each chunk after the first reads and
    writes it: 8 * V * H bytes in fp32, 4 * V * H in bf16) and bigger, more efficient matmuls; smaller chunks
    mean less memory. On an H200 with N=8192, H=2048, V=128256 (bf16, fp32 accumulator), forward+backward:
    4096-row chunks (1 GiB) 20.9 ms / 2036 MiB peak, 2048 rows 21.5 ms / 1568 MiB, 1024 rows 23.1 ms / 1568 MiB
    (benchmarks/results/h200-linear_cross_entropy.md).
    """
    row_bytes = max(1, n_classes * dtype.itemsize)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        budget = min(free // FREE_MEMORY_FRACTION, MAX_CHUNK_BYTES)
    else:
        budget = CPU_CHUNK_BYTES
    if max_bytes is not None:
        budget = min(budget, max(max_bytes, MIN_CAP_BYTES))
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


def matmul_dtype(compute_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype of the chunk's matmuls and logits: ``compute_dtype`` on CUDA; fp32 for fp16/bf16 elsewhere (CPU
    has no fast fp16/bf16 matmul, and fp32 logits are exact where a rounded low-precision chunk is not: torch's
    own chunked op does the same on CPU)."""
    if device.type == "cuda" or compute_dtype not in (torch.float16, torch.bfloat16):
        return compute_dtype
    return torch.float32


def _accumulator(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bias_accumulator(accumulation_dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(torch.float32, accumulation_dtype)


def _chunk_for(chunk_size: int, input: Tensor, linear_weight: Tensor, compute_dtype: torch.dtype,
               accumulation_dtype: torch.dtype) -> int:
    if chunk_size > 0:
        return chunk_size
    # the accumulator is the gradient itself (the memory-saving modes: bf16 accumulation, or fp32 master weights
    # under autocast): keep the logits buffer within the weight's size in the compute dtype (the weight itself, or
    # the copy autocast makes), so the op's peak stays gradient + at most two weight-sized tensors
    cap = None
    if accumulation_dtype == linear_weight.dtype:
        cap = linear_weight.numel() * matmul_dtype(compute_dtype, input.device).itemsize
    return default_chunk_size(input.shape[0], linear_weight.shape[0], matmul_dtype(compute_dtype, input.device),
                              input.device, cap)


# ----------------------------------------------------------------------------- the chunk loop


def transform_reference(x: Tensor, scale: float, softcap: float | None, temperature: float = 1.0
                        ) -> tuple[Tensor, Tensor]:
    """z = scale * x, soft-capped to softcap * tanh(z / softcap) (softcap None: not), / temperature, of logits x
    (already in the accumulation dtype), and dz/dx."""
    u = x * scale
    if softcap is None:
        return u / temperature, torch.full_like(u, scale / temperature)
    v = u / softcap
    # sech^2 rather than 1 - tanh^2, which cancels to nothing where tanh saturates
    return softcap * torch.tanh(v) / temperature, (scale / temperature) * torch.cosh(v).pow(-2)


def _chunk_ce_forward(use_kernels, logits, target, weight, ignore_index, smoothing, z_loss, transform, loss_out,
                      lse_out, aux_out):
    if use_kernels:
        ce_kernels.cross_entropy_forward(logits, target, ignore_index, smoothing, z_loss, loss_out, lse_out,
                                         weight=weight, aux=aux_out, scale=transform[0], softcap=transform[1])
        return
    if transform != (1.0, None):
        logits, _ = transform_reference(logits.to(_accumulator(logits.dtype)), *transform)
    loss, lse, aux = ce.cross_entropy_rows_reference(logits, target, weight, ignore_index, smoothing, z_loss)
    loss_out.copy_(loss)
    lse_out.copy_(lse)
    if aux_out is not None:
        aux_out.copy_(aux)


def _chunk_ce_backward_(use_kernels, logits, target, weight, lse, aux, g, ignore_index, smoothing, z_loss,
                        transform, grad_target_out):
    """g * dloss/dlogits from lse (and aux), written over ``logits`` (our own buffer); g * dloss/dtarget into
    ``grad_target_out`` when given (probabilities).

    With the forward kernel just before it: two kernels (a read pass, then a read + write pass): on an H200 0.81
    ms on a 4096 x 128256 bf16 chunk (92% of a copy for its three passes), slightly faster than a single kernel
    that re-reads each row for its second sweep (measured while developing)."""
    if use_kernels:
        ce_kernels.cross_entropy_backward(g, logits, target, lse, ignore_index, smoothing, z_loss, out=logits,
                                          weight=weight, aux=aux, grad_target=grad_target_out, scale=transform[0],
                                          softcap=transform[1])
        return
    g_rows = g.expand(logits.shape[0]) if g.dim() == 0 else g
    z, slope = logits, None
    if transform != (1.0, None):
        z, slope = transform_reference(logits.to(_accumulator(logits.dtype)), *transform)
    d, dq = ce.cross_entropy_grad_reference(g_rows, z, target, weight, lse, aux, ignore_index, smoothing,
                                            z_loss, grad_target_out is not None)
    logits.copy_(d if slope is None else d * slope)
    if grad_target_out is not None:
        grad_target_out.copy_(dq)


def chunk_logits_(logits: Tensor, x_c: Tensor, weight_t: Tensor, bias: Tensor | None) -> Tensor:
    """logits = x_c @ weight_t (+ bias), written into the reused chunk buffer ``logits``."""
    if bias is not None:
        return torch.addmm(bias, x_c, weight_t, out=logits)
    return torch.mm(x_c, weight_t, out=logits)


def _addmm_acc_(acc: Tensor, a: Tensor, b: Tensor, first: bool) -> None:
    """acc += a @ b summed in acc's dtype; ``first``: acc = a @ b (acc may be uninitialised)."""
    beta = 0.0 if first else 1.0
    if a.dtype == acc.dtype:
        acc.addmm_(a, b, beta=beta)
    elif acc.dtype.itemsize > a.dtype.itemsize:  # a wider accumulator: bf16 x bf16 -> fp32 in one cuBLAS call
        if kernels is not None:
            kernels.addmm_fp32_(acc, a, b, beta)
        else:
            acc.addmm_(a.to(acc.dtype), b.to(acc.dtype), beta=beta)
    else:  # a narrower accumulator than the operands (fp32 weights accumulated in bf16): round each product
        product = torch.mm(a, b)
        if first:
            acc.copy_(product)
        else:
            acc.add_(product)


def chunked_linear_cross_entropy(
    x: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Tensor | None, weight: Tensor | None,
    ignore_index: int, smoothing: float, z_loss: float, chunk_size: int, compute_dtype: torch.dtype,
    accumulation_dtype: torch.dtype, row_grad: Tensor | None, need_gx: bool, need_gw: bool, need_gb: bool,
    need_gt: bool, lse_in: Tensor | None = None, aux_in: Tensor | None = None,
    transform: tuple[float, float | None] = (1.0, None),
) -> tuple[Tensor, Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """The loop over row chunks shared by every op here (Triton CE kernels or the PyTorch reference).

    Returns (loss rows, lse, aux, gx, gw, gb, gt). ``row_grad``: None -> loss, lse and aux only. Else the factor
    of each row's gradient (0-d or (N,)), and the gradients wanted are computed in the same pass: gx (input
    dtype), gt (target dtype), gw (``accumulation_dtype``) and gb (fp32 / fp64). ``lse_in``, ``aux_in``: saved
    by the forward (backward): the loss is not recomputed. ``transform``: (logit_scale, softcap).

    Runs with autocast off: the op's dtypes are already chosen (``compute_dtype``), and autocast would otherwise
    recast the matmuls here (the grad_weight accumulation included) when the op is called inside an autocast
    region.
    """
    with torch.autocast(x.device.type, enabled=False):
        n_rows = x.shape[0]
        n_classes = linear_weight.shape[0]
        acc = _accumulator(compute_dtype)
        soft = target.is_floating_point()
        compute_dtype = matmul_dtype(compute_dtype, x.device)
        use_kernels = compute_dtype != torch.float64 and use_triton(x)
        has_aux = ce.needs_aux(soft, weight is not None, smoothing)
        class_weight = ce.kernel_weight(weight) if use_kernels else weight
        loss = torch.zeros(n_rows, dtype=acc, device=x.device)
        lse = torch.zeros(2, n_rows, dtype=acc, device=x.device)  # hi + lo
        aux = torch.zeros(n_rows, dtype=acc, device=x.device) if has_aux else None
        gx = gw = gb = gt = None
        if row_grad is not None:
            gx = torch.empty(x.shape, dtype=x.dtype, device=x.device) if need_gx else None
            # the first chunk writes it with beta=0
            gw = torch.empty(linear_weight.shape, dtype=accumulation_dtype, device=x.device) if need_gw else None
            if need_gb and linear_bias is not None:
                gb = torch.zeros(n_classes, dtype=_bias_accumulator(accumulation_dtype), device=x.device)
            gt = torch.empty(target.shape, dtype=target.dtype, device=x.device) if need_gt and soft else None
        if n_rows == 0:
            if gw is not None:
                gw.zero_()
            return loss, lse, aux, gx, gw, gb, gt
        w = linear_weight.to(compute_dtype)  # no copy when it already is (a cast once under autocast)
        b = linear_bias.to(compute_dtype) if linear_bias is not None else None
        chunk_size = max(1, min(chunk_size, n_rows))
        buffer = torch.empty(chunk_size, n_classes, dtype=compute_dtype, device=x.device)
        gx_chunk = None
        if gx is not None and x.dtype != compute_dtype:
            gx_chunk = torch.empty(chunk_size, x.shape[1], dtype=compute_dtype, device=x.device)
        weight_t = w.t()
        for start in range(0, n_rows, chunk_size):
            stop = min(start + chunk_size, n_rows)
            x_c, t_c = x[start:stop].to(compute_dtype), target[start:stop]
            logits = chunk_logits_(buffer[: stop - start], x_c, weight_t, b)
            aux_c = aux[start:stop] if aux is not None else None
            if row_grad is None:
                _chunk_ce_forward(use_kernels, logits, t_c, class_weight, ignore_index, smoothing, z_loss, transform,
                                  loss[start:stop], lse[:, start:stop], aux_c)
                continue
            g = row_grad if row_grad.dim() == 0 else row_grad[start:stop]
            if lse_in is None:
                _chunk_ce_forward(use_kernels, logits, t_c, class_weight, ignore_index, smoothing, z_loss, transform,
                                  loss[start:stop], lse[:, start:stop], aux_c)
                lse_c = lse[:, start:stop]
            else:
                lse_c, aux_c = lse_in[:, start:stop], aux_in[start:stop] if aux_in is not None else None
            _chunk_ce_backward_(use_kernels, logits, t_c, class_weight, lse_c, aux_c, g, ignore_index, smoothing,
                                z_loss, transform, gt[start:stop] if gt is not None else None)
            if gx is not None:
                if gx_chunk is None:
                    torch.mm(logits, w, out=gx[start:stop])
                else:
                    gx[start:stop].copy_(torch.mm(logits, w, out=gx_chunk[: stop - start]))
            if gw is not None:
                _addmm_acc_(gw, logits.t(), x_c, first=start == 0)
            if gb is not None:
                gb += logits.sum(0, dtype=gb.dtype)
        return loss, lse, aux, gx, gw, gb, gt


def _grad_factor(reduction: str, target: Tensor, weight: Tensor | None, ignore_index: int, n_classes: int,
                 acc: torch.dtype, grad: Tensor | None = None) -> Tensor:
    """The factor each row's gradient is scaled by: 0-d for "mean" (grad / denominator) and "sum", (rows,) for
    "none"; grad None means 1."""
    g = torch.ones((), dtype=acc, device=target.device) if grad is None else grad.to(acc)
    if reduction == "mean":
        g = g / ce.denominator_reference(target, weight, ignore_index, n_classes, acc)
    return g


# ----------------------------------------------------------------------------- forward


def _empty(like: Tensor, dtype: torch.dtype) -> Tensor:
    return like.new_empty((0,), dtype=dtype)


def _flags(target: Tensor, linear_bias, grad_input, grad_weight, grad_bias, grad_target) -> tuple[bool, ...]:
    return (grad_input, grad_weight, grad_bias and linear_bias is not None,
            grad_target and target.is_floating_point())


@custom_op("fusedlayers::linear_cross_entropy")
def linear_cross_entropy(
    input: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Tensor | None, weight: Tensor | None,
    ignore_index: int, reduction: str, label_smoothing: float, z_loss: float, logit_scale: float,
    softcap: float | None, chunk_size: int, compute_dtype: torch.dtype, accumulation_dtype: torch.dtype,
    out_dtype: torch.dtype, allow_retain_graph: bool, grad_input: bool, grad_weight: bool, grad_bias: bool,
    grad_target: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    n_classes = linear_weight.shape[0]
    ce.check_targets(target, n_classes, ignore_index)
    chunk_size = _chunk_for(chunk_size, input, linear_weight, compute_dtype, accumulation_dtype)
    acc = _accumulator(compute_dtype)
    flags = _flags(target, linear_bias, grad_input, grad_weight, grad_bias, grad_target)
    precompute = reduction != "none" and any(flags)
    row_grad = _grad_factor(reduction, target, weight, ignore_index, n_classes, acc) if precompute else None
    loss_rows, lse, aux, gx, gw, gb, gt = chunked_linear_cross_entropy(
        input, linear_weight, target, linear_bias, weight, ignore_index, label_smoothing, z_loss, chunk_size,
        compute_dtype, accumulation_dtype, row_grad, *flags, transform=(logit_scale, softcap),
    )
    denom = ce.denominator_reference(target, weight, ignore_index, n_classes, acc) if reduction == "mean" else None
    loss = ce.reduce_rows(loss_rows, denom, reduction, out_dtype)
    return (loss, lse, aux if aux is not None else _empty(lse, acc),
            gx if gx is not None else _empty(input, input.dtype),
            gw if gw is not None else _empty(lse, accumulation_dtype),
            gb if gb is not None else _empty(lse, _bias_accumulator(accumulation_dtype)),
            gt if gt is not None else _empty(lse, target.dtype if target.is_floating_point() else acc))


@linear_cross_entropy.register_fake
def _(input, linear_weight, target, linear_bias, weight, ignore_index, reduction, label_smoothing, z_loss,
      logit_scale, softcap, chunk_size, compute_dtype, accumulation_dtype, out_dtype, allow_retain_graph, grad_input,
      grad_weight, grad_bias, grad_target):
    n_rows, n_classes = input.shape[0], linear_weight.shape[0]
    acc = _accumulator(compute_dtype)
    soft = target.is_floating_point()
    flags = _flags(target, linear_bias, grad_input, grad_weight, grad_bias, grad_target)
    precompute = reduction != "none" and any(flags)
    loss = input.new_empty((n_rows,) if reduction == "none" else (), dtype=out_dtype)
    aux_rows = n_rows if ce.needs_aux(soft, weight is not None, label_smoothing) else 0
    shapes = [(input.shape, input.dtype), (linear_weight.shape, accumulation_dtype),
              ((n_classes,), _bias_accumulator(accumulation_dtype)), (target.shape, target.dtype if soft else acc)]
    grads = [input.new_empty(shape if precompute and f else (0,), dtype=dtype)
             for (shape, dtype), f in zip(shapes, flags, strict=True)]
    return (loss, input.new_empty((2, n_rows), dtype=acc), input.new_empty((aux_rows,), dtype=acc), *grads)


def _setup_context(ctx, inputs, output):
    (input, linear_weight, target, linear_bias, weight, ignore_index, reduction, label_smoothing, z_loss,
     logit_scale, softcap, chunk_size, compute_dtype, accumulation_dtype, _, allow_retain_graph,
     *grad_flags) = inputs
    _, lse, aux, gx, gw, gb, gt = output
    ctx.mark_non_differentiable(*output[1:])
    ctx.set_materialize_grads(False)  # no zero-filled (V, H) gradient for the gw output
    soft = target.is_floating_point()
    ctx.flags = _flags(target, linear_bias, *grad_flags)
    ctx.precomputed = reduction != "none" and any(ctx.flags)
    ctx.soft = soft
    ctx.has_bias = linear_bias is not None
    ctx.dtypes = (input.dtype, linear_weight.dtype, linear_bias.dtype if linear_bias is not None else None,
                  target.dtype)
    ctx.allow_retain_graph = allow_retain_graph
    ctx.consumed = False
    ctx.args = (ignore_index, reduction, label_smoothing, z_loss, logit_scale, softcap, chunk_size, compute_dtype,
                accumulation_dtype)
    # Gradients that may be asked for but were not computed in the forward (the op called directly with a
    # grad_* flag off for an input that requires grad) are recomputed from the inputs and the lse.
    requires = [input.requires_grad, linear_weight.requires_grad,
                linear_bias is not None and linear_bias.requires_grad, soft and target.requires_grad]
    ctx.recompute = not ctx.precomputed or any(r and not f for r, f in zip(requires, ctx.flags, strict=True))
    saved = (gx, gw, gb, gt) if ctx.precomputed else (None,) * 4
    inputs_saved = (input, linear_weight, target, linear_bias, weight, lse, aux) if ctx.recompute else (None,) * 7
    ctx.save_for_backward(*saved, *inputs_saved)


def _in_place_allowed(ctx, grad: Tensor) -> bool:
    return not (ctx.allow_retain_graph or grad.requires_grad or torch.compiler.is_compiling()
                or torch._C._len_torch_dispatch_stack() or torch._C._are_functorch_transforms_active()
                or type(grad) is not Tensor)


def _scale_in_place(buffer: Tensor, grad: Tensor) -> Tensor:
    """buffer *= grad (0-d), computed in fp32 (or fp64), returned."""
    if kernels is not None and buffer.dtype != torch.float64 and use_triton(buffer):
        return kernels.scale_(buffer, grad)
    if buffer.dtype in (torch.float32, torch.float64):
        return buffer.mul_(grad.to(buffer.dtype))
    return buffer.copy_(buffer.float() * grad.float())


def _autograd(ctx, grad, *_unused):
    needs = ctx.needs_input_grad
    want = (needs[0], needs[1], ctx.has_bias and needs[3], ctx.soft and needs[2])
    if grad is None:  # the loss got no gradient (grads are not materialised): nothing flows back
        want = (False,) * 4
    outs = [None] * 4
    if any(want):
        if ctx.consumed:
            raise RuntimeError(
                "linear_cross_entropy: backward through the same graph a second time; the first backward scaled "
                "the gradients precomputed in the forward in place. Pass "
                "options=torch.nn.LinearCrossEntropyOptions(allow_retain_graph=True) (torch >= 2.13) to keep them "
                "(one more gradient-sized tensor per backward), or use reduction='none'.")
        gx, gw, gb, gt, input, linear_weight, target, linear_bias, weight, lse, aux = ctx.saved_tensors
        precomputed = ctx.flags if ctx.precomputed else (False,) * 4
        in_place = _in_place_allowed(ctx, grad)
        for i, (buffer, dtype) in enumerate(zip((gx, gw, gb, gt), ctx.dtypes, strict=True)):
            if not (want[i] and precomputed[i]):
                continue
            if in_place and buffer.dtype == dtype and type(buffer) is Tensor:
                outs[i] = _scale_in_place(buffer, grad)
                ctx.consumed = True
            else:
                outs[i] = call(linear_cross_entropy_scale_grad, buffer, grad, dtype)
        rest = [w and not have for w, have in zip(want, precomputed, strict=True)]
        if any(rest):
            recomputed = call(linear_cross_entropy_backward, grad, input, linear_weight, target, linear_bias, weight,
                              lse, aux, *ctx.args, *rest)
            outs = [r if need else o for o, r, need in zip(outs, recomputed, rest, strict=True)]
    # inputs: input, linear_weight, target, linear_bias, weight, then 15 non-tensor arguments
    return (outs[0], outs[1], outs[3], outs[2]) + (None,) * 16


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
    grad: Tensor, input: Tensor, linear_weight: Tensor, target: Tensor, linear_bias: Tensor | None,
    weight: Tensor | None, lse: Tensor, aux: Tensor, ignore_index: int, reduction: str, label_smoothing: float,
    z_loss: float, logit_scale: float, softcap: float | None, chunk_size: int, compute_dtype: torch.dtype,
    accumulation_dtype: torch.dtype, grad_input: bool, grad_weight: bool, grad_bias: bool, grad_target: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    n_classes = linear_weight.shape[0]
    chunk_size = _chunk_for(chunk_size, input, linear_weight, compute_dtype, accumulation_dtype)
    soft = target.is_floating_point()
    row_grad = _grad_factor(reduction, target, weight, ignore_index, n_classes, _accumulator(compute_dtype), grad)
    has_aux = ce.needs_aux(soft, weight is not None, label_smoothing)
    *_, gx, gw, gb, gt = chunked_linear_cross_entropy(
        input, linear_weight, target, linear_bias, weight, ignore_index, label_smoothing, z_loss, chunk_size,
        compute_dtype, accumulation_dtype, row_grad, grad_input, grad_weight, grad_bias, grad_target,
        lse_in=lse, aux_in=aux if has_aux else None, transform=(logit_scale, softcap),
    )
    return (
        gx if gx is not None else input.new_empty((0,)),
        gw.to(linear_weight.dtype) if gw is not None else linear_weight.new_empty((0,)),
        gb.to(linear_bias.dtype) if gb is not None else linear_weight.new_empty((0,)),
        gt if gt is not None else linear_weight.new_empty((0,)),
    )


@linear_cross_entropy_backward.register_fake
def _(grad, input, linear_weight, target, linear_bias, weight, lse, aux, ignore_index, reduction, label_smoothing,
      z_loss, logit_scale, softcap, chunk_size, compute_dtype, accumulation_dtype, grad_input, grad_weight,
      grad_bias, grad_target):
    gx = input.new_empty(input.shape) if grad_input else input.new_empty((0,))
    gw = linear_weight.new_empty(linear_weight.shape) if grad_weight else linear_weight.new_empty((0,))
    has_gb = grad_bias and linear_bias is not None
    gb = linear_bias.new_empty(linear_bias.shape) if has_gb else linear_weight.new_empty((0,))
    has_gt = grad_target and target.is_floating_point()
    gt = target.new_empty(target.shape) if has_gt else linear_weight.new_empty((0,))
    return gx, gw, gb, gt
