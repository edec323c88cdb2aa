"""Our fused ops as a Lightning Thunder executor.

    import thunder
    from fusedlayers.integrations.thunder import fl_executor   # pip install "fusedlayers[thunder]"
    jmodel = thunder.jit(model, executors=[fl_executor, *thunder.get_default_executors()])

``fl_executor`` is a ``thunder.extend.OperatorExecutor`` named ``"fusedlayers"``, registered with
``thunder.extend.register_executor`` (so ``executors=["fusedlayers", ...]`` works too) but not added to Thunder's
default executors: list it, ahead of the defaults, where you want it. It claims five torch functions, call by call:

- ``torch.nn.functional.cross_entropy``: 2-D logits (N, C) with class-index targets (N,) (int64/int32; ignore_index)
  or class-probability targets of the logits' shape and dtype; label_smoothing; reduction "mean"/"sum"/"none";
  class weights of the logits' dtype that do not require grad.
- ``torch.softmax`` / ``torch.nn.functional.softmax`` / ``Tensor.softmax`` (one Thunder symbol): floating input of
  at least one dim, any dim, ``dtype`` None or floating (a dtype that is not wider than the input's casts the input
  first, as torch and ``fl.softmax`` do).
- ``torch.nn.functional.scaled_dot_product_attention``: 4-D (B, H, L, E) query, key/value (B, H, S, E/Ev) of one
  floating dtype; attn_mask None, bool (True = keep) or additive float (float32 or the query's dtype), broadcastable
  to (B, H, L, S); is_causal (not together with a mask, as torch); scale; dropout_p (the dropout mask comes from our
  own counter-based generator, seeded from torch's CPU generator: reproducible under ``torch.manual_seed`` but not
  the same random stream as torch's); ``enable_gqa`` where Thunder passes it (0.2.6's symbol has no such argument).
  On CUDA, head dims up to 256 (where our Triton kernels run).
- ``torch.nn.functional.layer_norm`` and ``torch.nn.functional.rms_norm``: floating input, ``normalized_shape`` its
  last dims, weight (and bias) None or of that shape in the input's dtype (or all fp32 for fp16/bf16 input), eps a
  number (None for rms_norm: torch's default). Thunder's own rules differentiate them as a dozen elementwise ops and
  reductions each way; ours are one kernel forward and one backward.

All tensors of a call on one CPU or CUDA device (CPU runs the PyTorch reference, as the ops do). Every other call
(other shapes, dtypes or arguments, N-D cross-entropy inputs, numbers Thunder traces as symbolic values) is refused
by the checker and stays with the next executors in the list, which give Thunder's usual result.

Each claimed function becomes a forward and a backward symbol of this executor, named in the traces
(``thunder.last_traces(jfn)[-1]``, ``thunder.last_backward_traces(jfn)[-1]``): ``fusedlayers_cross_entropy`` /
``fusedlayers_cross_entropy_backward``, ``fusedlayers_softmax`` / ``fusedlayers_softmax_backward``,
``fusedlayers_scaled_dot_product_attention`` / ``fusedlayers_scaled_dot_product_attention_backward``,
``fusedlayers_layer_norm`` / ``fusedlayers_layer_norm_backward``, ``fusedlayers_rms_norm`` /
``fusedlayers_rms_norm_backward``. They call the
``torch.ops.fusedlayers`` ops (their bodies, without the dispatcher's host cost, as ``fusedlayers.functional``
does). The grad transform saves what our backward ops need: the logsumexp (not the probabilities) for
cross-entropy and attention, the output for softmax, the dropout seed, the per-row statistics (fp32 mean and rstd) of
the norms.

Thunder does not track ``requires_grad`` through every op, so the backward computes every gradient our ops can give:
query, key and value; a float attn_mask's (a (B, H, L, S) fp32 intermediate: prefer bool masks); probability
targets'. A class weight that says it requires grad is refused (our op has no weight gradient; nor has torch's
with class indices).

Written against lightning-thunder 0.2.6, which imports with torch 2.11 but not with torch 2.13 (whose
``torch.Tensor`` lost the named-tensor methods Thunder references); importing this module raises an ImportError
saying why when Thunder is missing or does not import.
"""

from __future__ import annotations

import math

import torch

try:
    import thunder
    import thunder.torch as ltorch
    from thunder.core import devices, dtypes
    from thunder.core.prims import OpTags
    from thunder.core.proxies import TensorProxy
    from thunder.core.transforms import get_grad, put_grad
    from thunder.extend import OperatorExecutor, register_executor
except Exception as _error:  # ImportError, or e.g. AttributeError from a torch Thunder was not written for
    raise ImportError(
        "fusedlayers.integrations.thunder needs Lightning Thunder (pip install 'fusedlayers[thunder]', i.e. "
        f"lightning-thunder>=0.2.6), which failed to import with torch {torch.__version__}: "
        f"{type(_error).__name__}: {_error}. lightning-thunder 0.2.6 (torch>=2.7.1) imports with torch 2.11, not "
        "with torch 2.13, which removed the named-tensor API it references (Tensor.align_as, ...)"
    ) from _error

from fusedlayers import __version__
from fusedlayers.ops import cross_entropy as _ce_ops
from fusedlayers.ops import layer_norm as _layer_norm_ops
from fusedlayers.ops import rms_norm as _rms_norm_ops
from fusedlayers.ops import scaled_dot_product_attention as _attn_ops
from fusedlayers.ops import softmax as _softmax_ops
from fusedlayers.ops._eager import call

__all__ = ["NAME", "fl_executor", "executors"]

NAME = "fusedlayers"
fl_executor = OperatorExecutor(NAME, version=__version__)
register_executor(fl_executor)


def executors() -> list:
    """``[fl_executor, *thunder.get_default_executors()]``: the ``executors=`` argument of ``thunder.jit``."""
    return [fl_executor, *thunder.get_default_executors()]


_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_DEVICE_TYPES = (devices.DeviceType.CPU, devices.DeviceType.CUDA)


def _torch_dtype(t: TensorProxy) -> torch.dtype:
    return dtypes.to_torch_dtype(t.dtype)


def _is_float(t: TensorProxy) -> bool:
    return dtypes.is_float_dtype(t.dtype)


def _is_number(x) -> bool:
    """A Python number (not a symbolic NumberProxy, not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _tensors_on_one_device(*tensors) -> bool:
    """Every argument a TensorProxy (None skipped), all on one CPU or CUDA device."""
    tensors = [t for t in tensors if t is not None]
    if not all(isinstance(t, TensorProxy) for t in tensors):
        return False
    device = tensors[0].device
    return device.devicetype in _DEVICE_TYPES and all(t.device == device for t in tensors)


def _accumulator(t: TensorProxy):
    return dtypes.float64 if _torch_dtype(t) == torch.float64 else dtypes.float32


# ----------------------------------------------------------------------------- cross-entropy


def _cross_entropy_meta(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype):
    rows = logits.shape[0]
    acc = _accumulator(logits)
    aux_rows = rows if _ce_ops.needs_aux(_is_float(target), weight is not None, label_smoothing) else 0
    return (
        TensorProxy(like=logits, shape=(rows,) if reduction == "none" else (), dtype=dtypes.to_dtype(out_dtype)),
        TensorProxy(like=logits, shape=(2, rows), dtype=acc, requires_grad=False),  # logsumexp, hi + lo
        TensorProxy(like=logits, shape=(aux_rows,), dtype=acc, requires_grad=False),
        TensorProxy(like=logits, shape=(), dtype=acc, requires_grad=False),  # denominator of "mean"
    )


def _cross_entropy_impl(logits, target, weight, ignore_index, reduction, label_smoothing, z_loss, out_dtype):
    return call(_ce_ops.cross_entropy, logits, target, weight, ignore_index, reduction, label_smoothing, z_loss,
                dtypes.to_torch_dtype(out_dtype))


def _cross_entropy_backward_meta(grad, logits, target, weight, lse, aux, denom, ignore_index, reduction,
                                 label_smoothing, z_loss, target_grad):
    grad_target = TensorProxy(like=target) if target_grad else TensorProxy(like=logits, shape=(0,))
    return TensorProxy(like=logits), grad_target


def _cross_entropy_backward_impl(grad, logits, target, weight, lse, aux, denom, ignore_index, reduction,
                                 label_smoothing, z_loss, target_grad):
    return call(_ce_ops.cross_entropy_backward, grad, logits, target, weight, lse, aux, denom, ignore_index,
                reduction, label_smoothing, z_loss, target_grad)


cross_entropy_forward = fl_executor.register_operator(
    "fusedlayers_cross_entropy", meta=_cross_entropy_meta, fn=_cross_entropy_impl,
    tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,),
)
cross_entropy_backward = fl_executor.register_operator(
    "fusedlayers_cross_entropy_backward", meta=_cross_entropy_backward_meta, fn=_cross_entropy_backward_impl,
)


def _cross_entropy_checker(a, /, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                           reduction="mean", label_smoothing=0.0) -> bool:
    if size_average is not None or reduce is not None or reduction not in ("mean", "sum", "none"):
        return False
    if not (isinstance(ignore_index, int) and _is_number(label_smoothing) and 0.0 <= label_smoothing <= 1.0):
        return False
    if not _tensors_on_one_device(a, target, weight):
        return False
    dtype = _torch_dtype(a)
    if dtype not in _FLOATS or a.ndim != 2 or a.shape[0] == 0 or a.shape[1] == 0:
        return False
    if _is_float(target):  # class probabilities (torch refuses ignore_index with them)
        if tuple(target.shape) != tuple(a.shape) or _torch_dtype(target) != dtype or ignore_index != -100:
            return False
    elif _torch_dtype(target) not in (torch.int64, torch.int32) or tuple(target.shape) != (a.shape[0],):
        return False
    if weight is not None:  # our op has no gradient for class weights
        if tuple(weight.shape) != (a.shape[1],) or _torch_dtype(weight) != dtype or weight.requires_grad:
            return False
    return True


def _cross_entropy_args(a, target, weight, ignore_index, reduction, label_smoothing):
    return a, target, weight, ignore_index, reduction, float(label_smoothing), 0.0, a.dtype


def _cross_entropy_execution(a, /, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                             reduction="mean", label_smoothing=0.0):
    loss, _, _, _ = cross_entropy_forward(*_cross_entropy_args(a, target, weight, ignore_index, reduction,
                                                               label_smoothing))
    return loss


def _cross_entropy_grad(a, /, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0):
    args = _cross_entropy_args(a, target, weight, ignore_index, reduction, label_smoothing)
    loss, lse, aux, denom = cross_entropy_forward(*args)
    soft = _is_float(target)
    grad_a, grad_target = cross_entropy_backward(get_grad(loss), a, target, weight, lse, aux, denom, *args[3:7],
                                                 soft)
    put_grad(a, grad_a)
    if soft:
        put_grad(target, grad_target)
    return loss


fl_executor.register_implementation(
    ltorch.cross_entropy, checker=_cross_entropy_checker, execution_transform=_cross_entropy_execution,
    grad_transform=_cross_entropy_grad,
)


# ----------------------------------------------------------------------------- softmax


def _softmax_meta(x, dim, dtype):
    return TensorProxy(like=x, dtype=dtypes.to_dtype(dtype) if dtype is not None else None)


def _softmax_impl(x, dim, dtype):
    return call(_softmax_ops.softmax, x, dim, dtypes.to_torch_dtype(dtype))


def _softmax_backward_meta(grad, out, dim, input_dtype):
    return TensorProxy(like=out, dtype=dtypes.to_dtype(input_dtype))


def _softmax_backward_impl(grad, out, dim, input_dtype):
    return call(_softmax_ops.softmax_backward, grad, out, dim, 1.0, dtypes.to_torch_dtype(input_dtype))


softmax_forward = fl_executor.register_operator("fusedlayers_softmax", meta=_softmax_meta, fn=_softmax_impl)
softmax_backward = fl_executor.register_operator(
    "fusedlayers_softmax_backward", meta=_softmax_backward_meta, fn=_softmax_backward_impl,
)


def _softmax_checker(a, /, dim, *, dtype=None) -> bool:
    if not _tensors_on_one_device(a) or _torch_dtype(a) not in _FLOATS or a.ndim == 0:
        return False
    if not isinstance(dim, int) or not -a.ndim <= dim < a.ndim:
        return False
    return dtype is None or dtypes.to_torch_dtype(dtype) in _FLOATS


def _softmax_input(a, dim, dtype):
    """(input, dim >= 0, output dtype or None) of our op, as fl.softmax: a ``dtype`` wider than the input's is
    the output dtype (widened inside the kernel); any other casts the input first (torch rounds it to dtype)."""
    dim = dim % a.ndim
    if dtype is None:
        return a, dim, None
    want = dtypes.to_torch_dtype(dtype)
    have = _torch_dtype(a)
    if want.itemsize > have.itemsize:
        return a, dim, dtypes.to_dtype(want)
    return (a if want == have else a.to(want)), dim, None


def _softmax_execution(a, /, dim, *, dtype=None):
    return softmax_forward(*_softmax_input(a, dim, dtype))


def _softmax_grad(a, /, dim, *, dtype=None):
    x, dim, out_dtype = _softmax_input(a, dim, dtype)
    out = softmax_forward(x, dim, out_dtype)
    put_grad(a, softmax_backward(get_grad(out), out, dim, a.dtype))  # one rounding, to a's dtype
    return out


fl_executor.register_implementation(
    ltorch._softmax, checker=_softmax_checker, execution_transform=_softmax_execution, grad_transform=_softmax_grad,
)


# ----------------------------------------------------------------------------- scaled dot-product attention


def _attention_scale(scale, query) -> float:
    return float(scale) if scale is not None else 1.0 / math.sqrt(query.shape[-1])


def _attention_layout(query, key, value, attn_mask, dropout_p, is_causal, scale) -> int:
    """The memory layout torch's SDPA gives this call (as fl.scaled_dot_product_attention; from the real tensors,
    so decided at run time, in the forward and again in the backward)."""
    grouped = key.shape[1] != query.shape[1]
    layout = _attn_ops.torch_layout(query, key, value, attn_mask, dropout_p, is_causal, scale, grouped)
    if layout == _attn_ops.LAYOUT_CONTIGUOUS and grouped:  # torch's math path repeats K: dk contiguous
        layout = _attn_ops.LAYOUT_CONTIGUOUS_DK
    return layout


def _attention_meta(query, key, value, attn_mask, dropout_p, is_causal, scale):
    B, H, L, _ = query.shape
    lse_dtype = dtypes.to_dtype(_attn_ops.lse_dtype(_torch_dtype(query)))
    seed = (TensorProxy(shape=(2,), device=devices.cpu, dtype=dtypes.int64, requires_grad=False)
            if dropout_p > 0.0 else None)
    return (TensorProxy(like=query, shape=(B, H, L, value.shape[3])),
            TensorProxy(like=query, shape=(B, H, L), dtype=lse_dtype, requires_grad=False),
            seed)


def _attention_impl(query, key, value, attn_mask, dropout_p, is_causal, scale):
    seed = _attn_ops.draw_dropout_seed() if dropout_p > 0.0 else None
    layout = _attention_layout(query, key, value, attn_mask, dropout_p, is_causal, scale)
    out, lse = call(_attn_ops.scaled_dot_product_attention, query, key, value, attn_mask, seed, dropout_p,
                    is_causal, _attention_scale(scale, query), layout)
    return out, lse, seed


def _attention_backward_meta(grad_out, query, key, value, out, lse, attn_mask, seed, dropout_p, is_causal, scale):
    grad_mask = TensorProxy(like=attn_mask) if attn_mask is not None and _is_float(attn_mask) else None
    return TensorProxy(like=query), TensorProxy(like=key), TensorProxy(like=value), grad_mask


def _attention_backward_impl(grad_out, query, key, value, out, lse, attn_mask, seed, dropout_p, is_causal, scale):
    need_mask = attn_mask is not None and attn_mask.is_floating_point()
    layout = _attention_layout(query, key, value, attn_mask, dropout_p, is_causal, scale)
    dq, dk, dv, ds = call(_attn_ops.scaled_dot_product_attention_backward, grad_out, query, key, value, out, lse,
                          attn_mask, seed, dropout_p, is_causal, _attention_scale(scale, query),
                          True, True, True, need_mask, layout)
    grad_mask = ds.sum_to_size(attn_mask.shape).to(attn_mask.dtype) if need_mask else None
    return dq, dk, dv, grad_mask


attention_forward = fl_executor.register_operator(
    "fusedlayers_scaled_dot_product_attention", meta=_attention_meta, fn=_attention_impl,
    tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,),  # expensive, and it draws the dropout seed
)
attention_backward = fl_executor.register_operator(
    "fusedlayers_scaled_dot_product_attention_backward", meta=_attention_backward_meta, fn=_attention_backward_impl,
)


def _attention_checker(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                       enable_gqa=False) -> bool:
    if not _tensors_on_one_device(query, key, value, attn_mask):
        return False
    if not (query.ndim == key.ndim == value.ndim == 4):
        return False
    dtype = _torch_dtype(query)
    if dtype not in _FLOATS or _torch_dtype(key) != dtype or _torch_dtype(value) != dtype:
        return False
    if not (_is_number(dropout_p) and 0.0 <= dropout_p <= 1.0 and isinstance(is_causal, bool)
            and isinstance(enable_gqa, bool) and (scale is None or _is_number(scale))):
        return False
    B, H, L, E = query.shape
    Bk, H_kv, S, Ek = key.shape
    Bv, H_v, S_v, Ev = value.shape
    if not (Bk == Bv == B and H_v == H_kv and S_v == S and Ek == E):
        return False
    if min(B, H, L, S, E, Ev, H_kv) == 0 or not (H_kv == H or (enable_gqa and H % H_kv == 0)):
        return False
    if query.device.devicetype == devices.DeviceType.CUDA and max(E, Ev) > _attn_ops.KERNEL_MAX_HEAD_DIM:
        return False
    if attn_mask is not None:
        if is_causal or attn_mask.ndim > 4:  # torch refuses a mask with is_causal
            return False
        mask_dtype = _torch_dtype(attn_mask)
        if mask_dtype != torch.bool and mask_dtype not in (torch.float32, dtype):
            return False
        if any(m not in (1, n) for m, n in zip(reversed(attn_mask.shape), (S, L, H, B), strict=False)):
            return False
    return True


def _attention_execution(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                         enable_gqa=False):
    out, _, _ = attention_forward(query, key, value, attn_mask, float(dropout_p), is_causal, scale)
    return out


def _attention_grad(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
                    enable_gqa=False):
    dropout_p = float(dropout_p)
    out, lse, seed = attention_forward(query, key, value, attn_mask, dropout_p, is_causal, scale)
    dq, dk, dv, grad_mask = attention_backward(get_grad(out), query, key, value, out, lse, attn_mask, seed,
                                               dropout_p, is_causal, scale)
    put_grad(query, dq)
    put_grad(key, dk)
    put_grad(value, dv)
    if grad_mask is not None:
        put_grad(attn_mask, grad_mask)
    return out


fl_executor.register_implementation(
    ltorch.scaled_dot_product_attention, checker=_attention_checker, execution_transform=_attention_execution,
    grad_transform=_attention_grad,
)


# ----------------------------------------------------------------------------- LayerNorm and RMSNorm
# Thunder differentiates its own layer_norm / rms_norm by decomposing them into a dozen elementwise ops and
# reductions each way; ours is one kernel forward and one backward (the weight and bias gradients reduced in it).


def _norm_checker(a, normalized_shape, eps, *params) -> bool:
    """torch's rules for F.layer_norm / F.rms_norm: float input, normalized_shape its last dims, parameters of that
    shape in the input's dtype (or all fp32 for 16-bit input), a Python eps (None for rms_norm: torch's default)."""
    if not _tensors_on_one_device(a, *params) or _torch_dtype(a) not in _FLOATS:
        return False
    shape = (normalized_shape,) if isinstance(normalized_shape, int) else normalized_shape
    if not (isinstance(shape, (list, tuple)) and shape
            and all(isinstance(n, int) and not isinstance(n, bool) for n in shape)):
        return False
    if a.ndim < len(shape) or tuple(a.shape[a.ndim - len(shape):]) != tuple(shape):
        return False
    if not (eps is None or _is_number(eps)):
        return False
    params = [p for p in params if p is not None]
    if any(tuple(p.shape) != tuple(shape) for p in params):
        return False
    dtype = _torch_dtype(a)
    mixed = dtype in (torch.float16, torch.bfloat16) and all(_torch_dtype(p) == torch.float32 for p in params)
    return mixed or all(_torch_dtype(p) == dtype for p in params)


def _normalized(a, normalized_shape) -> list[int]:
    return [normalized_shape] if isinstance(normalized_shape, int) else list(normalized_shape)


def _stats_meta(a, normalized_shape, n_stats: int, *params):
    """The per-row statistics our norm ops save: (rows,) rstd for RMSNorm, (2, rows) mean and rstd for LayerNorm;
    fp32, or fp64 where any tensor is."""
    rows = math.prod(a.shape[: a.ndim - len(normalized_shape)])
    acc = dtypes.float64 if dtypes.float64 in [t.dtype for t in (a, *params) if t is not None] else dtypes.float32
    shape = (rows,) if n_stats == 1 else (n_stats, rows)
    return TensorProxy(like=a, shape=shape, dtype=acc, requires_grad=False)


def _grad_or_none(g: torch.Tensor | None, needed: bool):
    return g if needed else None


def _layer_norm_meta(a, normalized_shape, weight, bias, eps):
    return TensorProxy(like=a), _stats_meta(a, normalized_shape, 2, weight, bias)  # y, (mean, rstd) per row


def _layer_norm_impl(a, normalized_shape, weight, bias, eps):
    y, _, stats = call(_layer_norm_ops.layer_norm, a, normalized_shape, weight, bias, eps, None, None)
    return y, stats


def _layer_norm_backward_meta(grad, a, normalized_shape, weight, bias, stats):
    return (TensorProxy(like=a), None if weight is None else TensorProxy(like=weight),
            None if bias is None else TensorProxy(like=bias))


def _layer_norm_backward_impl(grad, a, normalized_shape, weight, bias, stats):
    need_dw, need_db = weight is not None, bias is not None
    dx, dw, db, _ = call(_layer_norm_ops.layer_norm_backward, grad, a, normalized_shape, weight, stats, None, a.dtype,
                         bias.dtype if need_db else None, True, need_dw, need_db)
    return dx, _grad_or_none(dw, need_dw), _grad_or_none(db, need_db)


layer_norm_forward = fl_executor.register_operator(
    "fusedlayers_layer_norm", meta=_layer_norm_meta, fn=_layer_norm_impl,
    tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,),  # the backward reads its stats, not its output
)
layer_norm_backward = fl_executor.register_operator(
    "fusedlayers_layer_norm_backward", meta=_layer_norm_backward_meta, fn=_layer_norm_backward_impl,
)


def _layer_norm_checker(a, /, normalized_shape, weight=None, bias=None, eps=1e-5) -> bool:
    return eps is not None and _norm_checker(a, normalized_shape, eps, weight, bias)


def _layer_norm_execution(a, /, normalized_shape, weight=None, bias=None, eps=1e-5):
    y, _ = layer_norm_forward(a, _normalized(a, normalized_shape), weight, bias, float(eps))
    return y


def _layer_norm_grad(a, /, normalized_shape, weight=None, bias=None, eps=1e-5):
    shape = _normalized(a, normalized_shape)
    y, stats = layer_norm_forward(a, shape, weight, bias, float(eps))
    dx, dw, db = layer_norm_backward(get_grad(y), a, shape, weight, bias, stats)
    put_grad(a, dx)
    for param, grad in ((weight, dw), (bias, db)):
        if param is not None:
            put_grad(param, grad)
    return y


fl_executor.register_implementation(
    ltorch.layer_norm, checker=_layer_norm_checker, execution_transform=_layer_norm_execution,
    grad_transform=_layer_norm_grad,
)


def _rms_norm_eps(a, eps) -> float:
    """torch's default eps: the machine epsilon of the compute dtype (fp32 for 16-bit input)."""
    if eps is not None:
        return float(eps)
    return torch.finfo(torch.float64 if _torch_dtype(a) == torch.float64 else torch.float32).eps


def _rms_norm_meta(a, normalized_shape, weight, eps):
    return TensorProxy(like=a), _stats_meta(a, normalized_shape, 1, weight)  # y, rstd per row


def _rms_norm_impl(a, normalized_shape, weight, eps):
    y, _, rstd = call(_rms_norm_ops.rms_norm, a, normalized_shape, weight, eps, None, None)
    return y, rstd


def _rms_norm_backward_meta(grad, a, normalized_shape, weight, rstd):
    return TensorProxy(like=a), None if weight is None else TensorProxy(like=weight)


def _rms_norm_backward_impl(grad, a, normalized_shape, weight, rstd):
    need_dw = weight is not None
    dx, dw, _ = call(_rms_norm_ops.rms_norm_backward, grad, a, normalized_shape, weight, rstd, None, a.dtype, True,
                     need_dw)
    return dx, _grad_or_none(dw, need_dw)


rms_norm_forward = fl_executor.register_operator(
    "fusedlayers_rms_norm", meta=_rms_norm_meta, fn=_rms_norm_impl, tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,),
)
rms_norm_backward = fl_executor.register_operator(
    "fusedlayers_rms_norm_backward", meta=_rms_norm_backward_meta, fn=_rms_norm_backward_impl,
)


def _rms_norm_checker(a, /, normalized_shape, weight=None, eps=None) -> bool:
    return _norm_checker(a, normalized_shape, eps, weight)


def _rms_norm_execution(a, /, normalized_shape, weight=None, eps=None):
    y, _ = rms_norm_forward(a, _normalized(a, normalized_shape), weight, _rms_norm_eps(a, eps))
    return y


def _rms_norm_grad(a, /, normalized_shape, weight=None, eps=None):
    shape = _normalized(a, normalized_shape)
    y, rstd = rms_norm_forward(a, shape, weight, _rms_norm_eps(a, eps))
    dx, dw = rms_norm_backward(get_grad(y), a, shape, weight, rstd)
    put_grad(a, dx)
    if weight is not None:
        put_grad(weight, dw)
    return y


fl_executor.register_implementation(
    ltorch.rms_norm, checker=_rms_norm_checker, execution_transform=_rms_norm_execution, grad_transform=_rms_norm_grad,
)
