"""F-style functions with torch-compatible signatures. Each validates its input, then calls its op
(through ``ops._eager.call``: the op's body directly in plain eager code, the registered op otherwise)."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from fusedlayers import _validate as v
from fusedlayers.ops import checkpoint as _checkpoint_ops
from fusedlayers.ops import cross_entropy as _cross_entropy_ops
from fusedlayers.ops import fake_quantize as _fake_quantize_ops
from fusedlayers.ops import linear_cross_entropy as _linear_cross_entropy_ops
from fusedlayers.ops import scaled_dot_product_attention as _attention_ops
from fusedlayers.ops import softmax as _softmax_ops
from fusedlayers.ops._eager import call

__all__ = ["softmax", "scaled_masked_softmax", "scaled_dot_product_attention", "cross_entropy",
           "linear_cross_entropy", "checkpoint", "fake_quantize", "fake_quantize_dynamic"]


def softmax(input: Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> Tensor:
    """Softmax over ``dim``, equal to ``torch.softmax(input, dim, dtype=dtype)``.

    ``dtype``: if given, the output's dtype (input is cast to it first, as torch does; widening casts
    happen inside the kernel for free). Accumulates in fp32 (fp64 for fp64). Any rank and shape,
    non-contiguous input, empty tensors. A row of all -inf gives NaN, as in torch.
    """
    v.check_tensor("input", input)
    dim = v.check_dim("dim", dim, input.dim())
    if dtype is not None and dtype not in v.FLOAT_DTYPES:
        raise TypeError(f"dtype must be a floating dtype (float16, bfloat16, float32, float64), got {dtype}")
    if dtype is None:
        v.check_float_tensor("input", input)
    elif not (input.is_floating_point() and dtype.itemsize > input.dtype.itemsize):
        input = input.to(dtype)  # not a widening: torch rounds to dtype before the softmax
        dtype = None
    if input.dim() == 0:
        return call(_softmax_ops.softmax, input.reshape(1), dtype).reshape(())
    if dim == input.dim() - 1:
        return call(_softmax_ops.softmax, input, dtype)
    return call(_softmax_ops.softmax, input.movedim(dim, -1), dtype).movedim(-1, dim)


def scaled_masked_softmax(
    scores: Tensor, scale: float = 1.0, attn_mask: Tensor | None = None, is_causal: bool = False
) -> Tensor:
    """``softmax(scores * scale + mask, dim=-1)`` in one kernel, forward and backward.

    ``attn_mask``: bool (True = keep) or additive float, broadcastable to ``scores``; a float mask that
    requires grad gets its gradient. ``is_causal``: keep key j for query i when j <= i (top-left, as in
    ``F.scaled_dot_product_attention``); needs ``scores`` of at least 2 dims (..., L, S). Both masks may
    be given together. Rows where every entry is masked give zeros (not NaN) and zero gradients.
    The output has the dtype of ``scores``.
    """
    v.check_float_tensor("scores", scores)
    scale = v.check_number("scale", scale)
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if scores.dim() == 0:
        raise ValueError("scores must have at least 1 dim (the softmax runs over the last)")
    if is_causal and scores.dim() < 2:
        raise ValueError(f"is_causal=True needs scores of shape (..., L, S), got {tuple(scores.shape)}")
    if attn_mask is not None:
        v.check_tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in v.FLOAT_DTYPES:
            raise TypeError(f"attn_mask must be bool (True = keep) or floating (additive), got {attn_mask.dtype}")
        v.check_broadcastable("attn_mask", attn_mask, scores)
    return call(_softmax_ops.scaled_masked_softmax, scores, scale, attn_mask, is_causal)


def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False,
) -> Tensor:
    """FlashAttention-2 (Triton on CUDA, the same blockwise algorithm in PyTorch on CPU), equal to
    ``F.scaled_dot_product_attention`` with the same arguments.

    Shapes: query (..., H, L, E), key (..., H_kv, S, E), value (..., H_kv, S, Ev) -> (..., H, L, Ev), with
    the same leading batch dims (usually one: (B, H, L, E)). E and Ev: multiples of 8 from 16 to 256.
    L and S may differ and need not be multiples of a block. ``enable_gqa``: H a multiple of H_kv, query
    head h reads key/value head h // (H // H_kv) (K/V are not copied); otherwise H == H_kv.
    ``attn_mask``: bool (True = keep) or additive float, broadcastable to (..., H, L, S), read tile by tile
    (never expanded in memory); a float mask that requires grad gets its gradient. ``is_causal``: keep
    key j for query i when j <= i (top-left aligned, as torch); may be combined with ``attn_mask``.
    ``dropout_p``: dropout on the attention probabilities whenever > 0 (pass 0.0 in eval, as with torch);
    the mask is regenerated in the backward from a seed drawn from torch's CPU generator, so
    ``torch.manual_seed`` makes it reproducible (the random stream differs from torch's own).
    ``scale``: default 1 / sqrt(E).

    Rows whose keys are all masked give zeros (not NaN) and zero gradients. Accumulates in fp32 (fp64 for
    fp64); fp16/bf16/fp32 run the Triton kernels on CUDA. Saves only the inputs, the output and the
    logsumexp per row; the backward is deterministic and computes only the gradients that are needed.
    Under autocast, floating inputs are cast to the autocast dtype (as torch does for this op).
    """
    import math

    v.check_float_tensor("query", query)
    v.check_float_tensor("key", key)
    v.check_float_tensor("value", value)
    if key.dtype != query.dtype or value.dtype != query.dtype:
        raise TypeError(f"query, key and value must have the same dtype, got query {query.dtype}, "
                        f"key {key.dtype}, value {value.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")
    if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
        raise ValueError("query, key and value must have the same number of dims, at least 3 ((B, H, L, E) "
                         f"layout), got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    if not (query.shape[:-3] == key.shape[:-3] == value.shape[:-3]):
        raise ValueError(f"query, key and value must have the same batch dims, got {tuple(query.shape[:-3])}, "
                         f"{tuple(key.shape[:-3])}, {tuple(value.shape[:-3])}")
    *batch, heads, q_len, head_dim = query.shape
    kv_heads, k_len = key.shape[-3], key.shape[-2]
    if key.shape[-1] != head_dim:
        raise ValueError(f"key head dim {key.shape[-1]} must equal query head dim {head_dim}")
    if value.shape[-3:-1] != key.shape[-3:-1]:
        raise ValueError(f"value (H_kv, S) = {tuple(value.shape[-3:-1])} must equal key's {tuple(key.shape[-3:-1])}")
    v.check_attention_head_dim("query", head_dim)
    v.check_attention_head_dim("value", value.shape[-1])
    enable_gqa = v.check_bool("enable_gqa", enable_gqa)
    if enable_gqa:
        if kv_heads == 0 or heads % kv_heads != 0:
            raise ValueError(f"enable_gqa=True needs query heads ({heads}) to be a multiple of key/value heads "
                             f"({kv_heads})")
    elif kv_heads != heads:
        raise ValueError(f"query has {heads} heads but key/value have {kv_heads}; pass enable_gqa=True for "
                         "grouped-query attention")
    dropout_p = v.check_number("dropout_p", dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be between 0.0 and 1.0, got {dropout_p}")
    is_causal = v.check_bool("is_causal", is_causal)
    scale = 1.0 / math.sqrt(head_dim) if scale is None else v.check_number("scale", scale)
    full_shape = (*batch, heads, q_len, k_len)
    if attn_mask is not None:
        v.check_tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in v.FLOAT_DTYPES:
            raise TypeError(f"attn_mask must be bool (True = keep) or floating (additive), got {attn_mask.dtype}")
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
        v.check_broadcastable_to("attn_mask", attn_mask, full_shape)

    # the op works on (B, H, L, E)
    if query.dim() == 3:
        query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
    elif query.dim() > 4:
        query, key, value = (t.reshape(-1, *t.shape[-3:]) for t in (query, key, value))
        if attn_mask is not None and attn_mask.dim() > 2:
            attn_mask = attn_mask.expand(full_shape).reshape(-1, heads, q_len, k_len)
    seed = torch.randint(0, 2**31, (2,), dtype=torch.int64) if dropout_p > 0.0 else None
    out, _ = call(
        _attention_ops.scaled_dot_product_attention, query, key, value, attn_mask, seed, dropout_p, is_causal, scale
    )
    return out.reshape(*batch, heads, q_len, out.shape[-1])


def _check_loss_args(ignore_index, reduction, label_smoothing, z_loss) -> tuple[int, str, float, float]:
    return (v.check_int("ignore_index", ignore_index), v.check_reduction(reduction),
            v.check_fraction("label_smoothing", label_smoothing), v.check_non_negative("z_loss", z_loss))


def _loss_dtype(input: Tensor) -> torch.dtype:
    """The loss dtype torch gives: the input's, or fp32 under autocast (cross-entropy runs in fp32 there)."""
    if input.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled(input.device.type):
        return torch.float32
    return input.dtype


def cross_entropy(
    input: Tensor, target: Tensor, ignore_index: int = -100, reduction: str = "mean",
    label_smoothing: float = 0.0, z_loss: float = 0.0,
) -> Tensor:
    """Cross-entropy with class-index targets, equal to ``F.cross_entropy`` (no ``weight``) when ``z_loss=0``.

    Shapes as ``F.cross_entropy``: ``input`` (N, C) with ``target`` (N,); (C,) with a 0-d target; or
    (N, C, d1, ...) with target (N, d1, ...) -- the class dim is dim 1, so flatten (B, T, C) logits to
    (B*T, C) (and targets to (B*T,)) yourself, exactly as for ``F.cross_entropy``. ``target``: int64 (or
    another integer dtype) class indices; class-probability targets are not supported.

    ``reduction``: "mean" (over the rows whose target is not ``ignore_index``), "sum" or "none" (shape of
    ``target``; ignored rows give 0). If every target is ignored, "mean" returns NaN with zero gradients,
    as torch does (0 / 0), and "sum" returns 0. ``label_smoothing`` in [0, 1], as torch. ``z_loss`` >= 0
    adds ``z_loss * logsumexp(x)**2`` per non-ignored row (PaLM's auxiliary loss), reduced the same way.

    A target outside [0, C) that is not ``ignore_index`` raises ``TargetOutOfRangeError`` (a ValueError
    and an IndexError) on CPU; on CUDA (where checking would synchronise) no kernel reads out of bounds
    and that row's loss and gradient are NaN, so the reduced loss is NaN.

    The logits are read, never written (the gradient is a new tensor); accumulation in fp32 (fp64 for
    fp64) and the loss in the input's dtype (fp32 under autocast, as torch). Saves the logits, targets
    and one fp32 logsumexp per row for backward. Double backward is not supported.
    """
    v.check_float_tensor("input", input)
    v.check_index_tensor("target", target)
    ignore_index, reduction, label_smoothing, z_loss = _check_loss_args(ignore_index, reduction, label_smoothing,
                                                                        z_loss)
    if target.device != input.device:
        raise ValueError(f"target is on {target.device} but input is on {input.device}")
    if input.dim() == 0:
        raise ValueError("input must have at least 1 dim (the classes), got a 0-d tensor")
    expected = () if input.dim() == 1 else (input.shape[0], *input.shape[2:])
    if tuple(target.shape) != expected:
        raise ValueError(f"target of shape {tuple(target.shape)} does not match input of shape "
                         f"{tuple(input.shape)}: expected {expected} (the class dim of input is dim "
                         f"{0 if input.dim() == 1 else 1})")
    n_classes = input.shape[0] if input.dim() == 1 else input.shape[1]
    if n_classes == 0:
        raise ValueError(f"input must have at least one class, got shape {tuple(input.shape)}")
    if input.dim() == 1:
        logits = input.unsqueeze(0)
    elif input.dim() == 2:
        logits = input
    else:
        logits = input.movedim(1, -1).reshape(-1, n_classes)
    if target.dtype not in (torch.int64, torch.int32):
        target = target.long()
    loss, *_ = call(_cross_entropy_ops.cross_entropy, logits, target.reshape(-1), ignore_index, reduction,
                    label_smoothing, z_loss, _loss_dtype(input))
    return loss.reshape(target.shape) if reduction == "none" else loss


def linear_cross_entropy(
    input: Tensor, weight: Tensor, target: Tensor, bias: Tensor | None = None, ignore_index: int = -100,
    reduction: str = "mean", label_smoothing: float = 0.0, z_loss: float = 0.0, *, chunk_size: int | None = None,
) -> Tensor:
    """``F.cross_entropy(F.linear(input, weight, bias), target, ...)`` without materialising the logits.

    ``input`` (N, H) with ``target`` (N,); more leading dims are flattened: (..., H) with target (...),
    i.e. the classes are the last dim of the logits (the value of ``F.cross_entropy`` on the flattened
    logits; "none" returns target's shape). ``weight`` (V, H), ``bias`` (V,) or None, all one float dtype
    (under autocast they are cast to the autocast dtype, as F.linear does, and the loss is fp32).
    Arguments and loss semantics (ignored rows, "mean" over non-ignored rows, NaN when all are ignored,
    label smoothing, z_loss, out-of-range targets) are those of ``fl.cross_entropy``.

    Rows are processed ``chunk_size`` at a time through one (chunk_size, V) logits buffer; by default the
    chunk is sized from N, V and the free GPU memory (see
    ``fusedlayers.ops.linear_cross_entropy.default_chunk_size``); pass ``chunk_size`` to override. For
    "mean"/"sum" the gradients of input, weight and bias (those that require grad) are computed in the same
    pass, grad_weight and grad_bias accumulated across chunks in fp32, and backward only scales them by the
    upstream gradient. "none" computes the loss only and recomputes the logits in backward (each row's
    upstream gradient must be applied before the rows are summed into grad_weight). Double backward is not
    supported.
    """
    v.check_float_tensor("input", input)
    v.check_float_tensor("weight", weight)
    v.check_index_tensor("target", target)
    ignore_index, reduction, label_smoothing, z_loss = _check_loss_args(ignore_index, reduction, label_smoothing,
                                                                        z_loss)
    if chunk_size is not None and (v.check_int("chunk_size", chunk_size) < 1):
        raise ValueError(f"chunk_size must be >= 1 (or None for automatic), got {chunk_size}")
    if weight.dim() != 2:
        raise ValueError(f"weight must be 2-D (V, H), got shape {tuple(weight.shape)}")
    n_classes, hidden = weight.shape
    if n_classes == 0:
        raise ValueError("weight must have at least one row (class), got shape (0, H)")
    if input.dim() == 0 or input.shape[-1] != hidden:
        raise ValueError(f"input of shape {tuple(input.shape)} must end with weight's H = {hidden}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"target of shape {tuple(target.shape)} must equal input's leading dims "
                         f"{tuple(input.shape[:-1])}")
    if bias is not None:
        v.check_float_tensor("bias", bias)
        if tuple(bias.shape) != (n_classes,):
            raise ValueError(f"bias must have shape ({n_classes},) (weight's V), got {tuple(bias.shape)}")
    for name, t in (("weight", weight), ("target", target), ("bias", bias)):
        if t is not None and t.device != input.device:
            raise ValueError(f"{name} is on {t.device} but input is on {input.device}")
    out_dtype = input.dtype
    device_type = input.device.type
    if torch.is_autocast_enabled(device_type):  # F.linear runs in the autocast dtype, cross-entropy in fp32
        low = torch.get_autocast_dtype(device_type)
        input, weight = (t.to(low) if t.dtype != torch.float64 else t for t in (input, weight))
        bias = bias.to(low) if bias is not None and bias.dtype != torch.float64 else bias
        out_dtype = torch.float32 if input.dtype in (torch.float16, torch.bfloat16) else input.dtype
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and t.dtype != input.dtype:
            raise TypeError(f"{name} must have input's dtype {input.dtype}, got {t.dtype}")
    if target.dtype not in (torch.int64, torch.int32):
        target = target.long()
    grad = torch.is_grad_enabled()
    loss, *_ = call(
        _linear_cross_entropy_ops.linear_cross_entropy,
        input.reshape(-1, hidden), weight, target.reshape(-1), bias, ignore_index, reduction, label_smoothing,
        z_loss, chunk_size or 0, out_dtype, grad and input.requires_grad, grad and weight.requires_grad,
        grad and bias is not None and bias.requires_grad,
    )
    return loss.reshape(target.shape) if reduction == "none" else loss


def checkpoint(function, *args, preserve_rng_state: bool = True, policy="full", **kwargs):
    """``function(*args, **kwargs)`` with the activations inside freed after forward and recomputed in
    backward (like ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)``).

    Returns whatever ``function`` returns (tensors, tuples, dicts, non-tensor values). Gradients are
    bitwise those of the unwrapped call: the recompute restores the CPU and CUDA RNG state (dropout) when
    ``preserve_rng_state`` and always the autocast state and the pre-forward buffers of the modules it
    can reach, so BatchNorm running stats and observers are updated once. Works with
    ``torch.autograd.grad``, inputs that do not require grad (parameters inside still get gradients),
    keyword arguments, nesting and DDP (no reentrant backward). A recompute that produces tensors of
    other shapes/dtypes than the forward raises ``CheckpointError``. Under ``torch.no_grad`` it simply
    calls ``function``.

    ``policy``: ``"full"`` keeps only the inputs; ``"selective"`` also keeps the outputs of matmuls,
    convolutions, attention and the fused attention / linear-cross-entropy ops and recomputes only the
    cheap ops; or a callable ``policy(op, *args, **kwargs) -> bool`` (True: keep the output of that aten
    or custom op). ``preserve_rng_state`` and ``policy`` are not passed on to ``function``.
    """
    if not callable(function):
        raise TypeError(f"function must be callable, got {type(function).__name__}")
    if not isinstance(preserve_rng_state, bool):
        raise TypeError(f"preserve_rng_state must be a bool, got {type(preserve_rng_state).__name__}")
    if isinstance(policy, str):
        if policy not in _checkpoint_ops.POLICIES:
            raise ValueError(f"policy must be one of {_checkpoint_ops.POLICIES} or a callable, got {policy!r}")
    elif not callable(policy):
        raise TypeError(f"policy must be 'full', 'selective' or a callable, got {type(policy).__name__}")
    return _checkpoint_ops.checkpoint(function, *args, preserve_rng_state=preserve_rng_state, policy=policy,
                                      **kwargs)


def _fake_quant_qparam(name: str, value, input: Tensor, shape: tuple[int, ...] | None, floating: bool) -> Tensor:
    """A scale (floating) or zero point as a tensor on input's device; ``shape`` None means per tensor."""
    if isinstance(value, Tensor):
        if value.device != input.device:
            raise ValueError(f"{name} is on {value.device} but the input is on {input.device}")
        if floating and value.dtype not in v.FLOAT_DTYPES:
            raise TypeError(f"{name} must be a floating tensor, got {value.dtype}")
        if not floating and value.dtype not in v.FLOAT_DTYPES and value.dtype not in v.INDEX_DTYPES:
            raise TypeError(f"{name} must be an integer or floating tensor, got {value.dtype}")
        if shape is None and value.numel() != 1:
            raise ValueError(f"{name} must have one element for per-tensor quantization, "
                             f"got shape {tuple(value.shape)}")
        if shape is not None and tuple(value.shape) != shape:
            raise ValueError(f"{name} must have shape {shape}, got {tuple(value.shape)}")
        return value
    if shape is not None:
        raise TypeError(f"{name} must be a tensor of shape {shape} for per-channel / per-group quantization")
    if floating:
        return torch.tensor([v.check_number(name, value)], dtype=torch.float32, device=input.device)
    return torch.tensor([v.check_int(name, value)], dtype=torch.int32, device=input.device)


# qparam tensors whose values passed the checks, with their version then: reading device values costs a host sync, so
# the same tensors (QAT's buffers, a parameter between optimizer steps) are read once per change, not once per call.
# id(tensor) -> (weak reference to it, its version, what was checked); an entry leaves when its tensor dies. (Not a
# WeakIdKeyDictionary: its lookup builds a weak reference, a microsecond per qparam per call.)
_checked_qparams: dict = {}


def _check_qparam_values(scale, zero_point, quant_min: int, quant_max: int) -> None:
    """scale positive and finite, an integer zero_point inside [quant_min, quant_max], for the arguments as given
    (numbers are checked on the host, tensors on their device: one host sync on GPU at most)."""
    checks = {}
    if not isinstance(scale, Tensor):
        checks["scale"] = 0 < scale < float("inf")
    elif not _checked_before(scale, "scale"):
        checks["scale"] = ((scale > 0) & torch.isfinite(scale)).all()
    if not isinstance(zero_point, Tensor):
        checks["zero_point"] = quant_min <= zero_point <= quant_max
    elif not zero_point.is_floating_point() and not _checked_before(zero_point, (quant_min, quant_max)):
        checks["zero_point"] = ((zero_point >= quant_min) & (zero_point <= quant_max)).all()
    on_device = [name for name, ok in checks.items() if isinstance(ok, Tensor)]
    if on_device:
        checks.update(zip(on_device, torch.stack([checks[n] for n in on_device]).tolist(), strict=True))
    if not checks.get("scale", True):
        raise ValueError("scale must be positive and finite")
    if not checks.get("zero_point", True):
        raise ValueError(f"zero_point must lie in [quant_min, quant_max] = [{quant_min}, {quant_max}]")
    for name in on_device:
        t, what = (scale, "scale") if name == "scale" else (zero_point, (quant_min, quant_max))
        if _cacheable(t):
            _remember_checked(t, what)


def _cacheable(t: Tensor) -> bool:
    return type(t) in (Tensor, torch.nn.Parameter) and not t.is_inference()


def _remember_checked(t: Tensor, what) -> None:
    key = id(t)
    forget = lambda _ref, key=key: _checked_qparams.pop(key, None)  # noqa: E731
    _checked_qparams[key] = (weakref.ref(t, forget), t._version, what)


def _checked_before(t: Tensor, what) -> bool:
    entry = _checked_qparams.get(id(t))
    return entry is not None and entry[0]() is t and entry[1] == t._version and entry[2] == what


def fake_quantize(input: Tensor, scale, zero_point, quant_min: int, quant_max: int, axis: int | None = None, *,
                  group_size: int | None = None, grad_factor: float = 1.0) -> Tensor:
    """Affine fake quantization: ``(clamp(round(input * (1 / scale)) + zero_point, quant_min, quant_max)
    - zero_point) * scale``, rounding half to even; the result has input's dtype.

    - ``axis=None``: per tensor, bit-identical to ``torch.fake_quantize_per_tensor_affine``; ``scale`` and
      ``zero_point`` are numbers or one-element tensors.
    - ``axis=k``: per channel, bit-identical to ``torch.fake_quantize_per_channel_affine(..., axis=k, ...)``;
      ``scale`` and ``zero_point`` have shape ``(input.shape[k],)``.
    - ``group_size=g``: per group of ``g`` consecutive elements of the last dim (torchao's per-group weight
      quantization, e.g. int4 with g=32); ``scale`` and ``zero_point`` have shape
      ``(*input.shape[:-1], input.shape[-1] // g)``. Same result as torch's per-channel op on
      ``input.reshape(-1, g)`` with axis 0.

    fp32 math throughout as in torch (``1 / scale`` correctly rounded, then a multiply); fp32, fp16, bf16
    (and fp64, on the reference) inputs; the result equals torch's bit for bit. A floating ``zero_point`` is
    rounded half to even and clamped to the range first (as torch's learnable ops do).
    NaN inputs give ``(quant_min - zero_point) * scale``, +-inf the range ends (as torch on CPU).

    Gradients: for ``input`` the straight-through estimator with the clipping mask (``grad`` where
    ``quant_min <= q <= quant_max`` before clipping, else 0), equal to torch's. When ``scale`` or
    ``zero_point`` require grad, they get LSQ's gradients, equal to
    ``torch._fake_quantize_learnable_per_tensor_affine`` / ``_per_channel_affine`` (round-then-clip as
    torch: ``(x_fq - x) / scale`` inside the range, ``quant_min/max - zero_point`` outside it, for the scale;
    ``-scale`` outside the range, else 0, for the zero point; the mask for ``input`` is then that of torch's
    learnable op, whose backward rounds ``zero_point + x * inv`` on CPU and ``round(x * inv) + zero_point`` on
    CUDA: each device as torch there), each multiplied by ``grad_factor`` (LSQ's
    ``1 / sqrt(numel_per_scale * quant_max)``).
    One Triton kernel per direction; the backward writes dx and partial sums of the qparam gradients in
    one pass over ``input`` and the incoming gradient.
    """
    v.check_float_tensor("input", input)
    quant_min, quant_max = v.check_quant_range(quant_min, quant_max)
    grad_factor = v.check_number("grad_factor", grad_factor)
    if group_size is not None:
        if input.dim() == 0:
            raise ValueError("group_size needs an input with at least 1 dim")
        if axis is not None and v.check_dim("axis", axis, input.dim()) != input.dim() - 1:
            raise ValueError(f"group_size groups the last dim; axis must be None or {input.dim() - 1}, got {axis}")
        group_size = v.check_group_size("group_size", group_size, input.shape[-1])
        axis, shape = None, (*input.shape[:-1], input.shape[-1] // group_size)
    elif axis is not None:
        if input.dim() == 0:
            raise ValueError("per-channel quantization (axis given) needs an input with at least 1 dim")
        axis = v.check_dim("axis", axis, input.dim())
        shape = (input.shape[axis],)
    else:
        shape = None
    scale_arg, zero_point_arg = scale, zero_point
    scale = _fake_quant_qparam("scale", scale, input, shape, floating=True)
    zero_point = _fake_quant_qparam("zero_point", zero_point, input, shape, floating=False)
    if not torch.compiler.is_compiling():
        _check_qparam_values(scale_arg, zero_point_arg, quant_min, quant_max)
    y, _ = call(_fake_quantize_ops.fake_quantize, input, scale, zero_point, quant_min, quant_max, axis,
                group_size or 0, grad_factor)
    return y


def fake_quantize_dynamic(input: Tensor, quant_min: int = -128, quant_max: int = 127, group_size: int | None = None,
                          symmetric: bool = False, return_qparams: bool = False):
    """Fake quantization with qparams computed in the same kernel from each group's own min/max: per token
    (``group_size=None``: each row of the last dim, e.g. int8 activations) or per group of ``group_size``
    consecutive elements of the last dim (per channel of a weight with ``group_size=in_features``).

    The qparams are torchao's (``choose_qparams_per_token_asymmetric`` / ``get_group_qparams_symmetric``),
    with the range widened to include 0, the scale at least fp32 eps, IEEE divisions (torch on CPU; torch on
    CUDA divides by a Python number through its reciprocal, an ulp apart at times):
    asymmetric ``scale = (max - min) / (quant_max - quant_min)`` and the zero point from the smaller of the
    two range errors, rounded; symmetric ``scale = max|x| / ((quant_max - quant_min) / 2)``, zero point 0.
    Then ``fake_quantize`` with those qparams (rounding after adding the zero point, on every device).
    Gradient: straight-through with the clipping mask; the qparams are treated as constants.
    Returns the fake-quantized tensor, or ``(y, scale, zero_point)`` (fp32, shape
    ``(*input.shape[:-1], input.shape[-1] // group_size)``) with ``return_qparams=True``.
    Rows containing NaN give unspecified values.
    """
    v.check_float_tensor("input", input)
    quant_min, quant_max = v.check_quant_range(quant_min, quant_max)
    v.check_bool("symmetric", symmetric)
    v.check_bool("return_qparams", return_qparams)
    if input.dim() == 0:
        raise ValueError("input must have at least 1 dim (qparams are computed over groups of the last dim)")
    size = input.shape[-1]
    if group_size is None:
        group_size = size
    elif size or group_size:
        group_size = v.check_group_size("group_size", group_size, size)
    if size == 0:
        y = input.new_empty(input.shape)
        empty = input.new_empty((*input.shape[:-1], 0), dtype=torch.float32)
        return (y, empty, empty.clone()) if return_qparams else y
    y, scale, zero_point, _ = call(_fake_quantize_ops.fake_quantize_dynamic, input, quant_min, quant_max,
                                   group_size, symmetric)
    return (y, scale, zero_point) if return_qparams else y
