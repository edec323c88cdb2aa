"""F-style functions with torch-compatible signatures. Each validates its input, then calls its op
(through ``ops._eager.call``: the op's body directly in plain eager code, the registered op otherwise)."""

from __future__ import annotations

import weakref

import torch
from torch import Tensor

from fusedlayers import _validate as v
from fusedlayers.backend import keys_per_row
from fusedlayers.ops import checkpoint as _checkpoint_ops
from fusedlayers.ops import cross_entropy as _cross_entropy_ops
from fusedlayers.ops import fake_quantize as _fake_quantize_ops
from fusedlayers.ops import geglu as _geglu_ops
from fusedlayers.ops import layer_norm as _layer_norm_ops
from fusedlayers.ops import linear_cross_entropy as _linear_cross_entropy_ops
from fusedlayers.ops import linear_log_probs as _linear_log_probs_ops
from fusedlayers.ops import rms_norm as _rms_norm_ops
from fusedlayers.ops import rotary_embedding as _rotary_embedding_ops
from fusedlayers.ops import scaled_dot_product_attention as _attention_ops
from fusedlayers.ops import softmax as _softmax_ops
from fusedlayers.ops import swiglu as _swiglu_ops
from fusedlayers.ops import varlen_attention as _varlen_ops
from fusedlayers.ops._eager import call

__all__ = ["softmax", "scaled_masked_softmax", "scaled_dot_product_attention", "cross_entropy",
           "linear_cross_entropy", "linear_log_probs", "checkpoint", "fake_quantize", "fake_quantize_dynamic",
           "rms_norm", "layer_norm", "swiglu", "geglu", "rotary_embedding", "varlen_attention"]


def softmax(input: Tensor, dim: int = -1, dtype: torch.dtype | None = None) -> Tensor:
    """Softmax over ``dim``, equal to ``torch.softmax(input, dim, dtype=dtype)``.

    ``dtype``: if given, the output's dtype (input is cast to it first, as torch does; widening casts
    happen inside the kernel for free; so integer, bool and complex input work with a floating ``dtype``,
    as in torch). Accumulates in fp32 (fp64 for fp64). Any rank and shape, non-contiguous input, empty
    tensors. A row of all -inf gives NaN, as in torch. The output, and the gradient, are contiguous
    tensors whatever the input's layout and ``dim``, as torch's are; a dim other than the last is reduced
    in place (strided), without a transposed copy.
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
        return call(_softmax_ops.softmax, input.reshape(1), 0, dtype).reshape(())
    return call(_softmax_ops.softmax, input, dim, dtype)


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


def _broadcast(*shapes: torch.Size) -> tuple[int, ...]:
    """``torch.broadcast_shapes(*shapes)``, skipped where the shapes are equal (the usual call: it costs ~20 us of a
    GPU host's time)."""
    first = shapes[0]
    return tuple(first if all(s == first for s in shapes[1:]) else torch.broadcast_shapes(*shapes))


def scaled_dot_product_attention(
    query: Tensor, key: Tensor, value: Tensor, attn_mask: Tensor | None = None, dropout_p: float = 0.0,
    is_causal: bool = False, scale: float | None = None, enable_gqa: bool = False, *,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0, sinks: Tensor | None = None,
) -> Tensor:
    """FlashAttention-2 (Triton on CUDA, the same blockwise algorithm in PyTorch on CPU), equal to
    ``F.scaled_dot_product_attention`` with the same arguments.

    Shapes as torch's: query (..., L, E), key (..., S, E), value (..., S, Ev) -> (..., L, Ev), at least 2 dims
    each; the batch dims (...) broadcast against each other as in torch (e.g. query (B, H, L, E) with key/value
    (H, S, E) or (1, H, S, E)), read through stride-0 views: K/V are not copied (only batch dims of more than
    two levels that broadcast in a mixed pattern are collapsed by a copy). Any head dims E, Ev (0 too): up to
    256 run the Triton kernels (padded to a power of two inside the kernels), larger ones the exact blockwise
    PyTorch algorithm on the inputs' device. ``enable_gqa``: dim -3 (heads) of key/value may divide query's;
    query head h reads key/value head h // (H / H_kv) (K/V are not copied). ``attn_mask``: bool (True = keep)
    or additive float (float32 or query's dtype, as torch), broadcastable to (..., L, S), read tile by tile
    (never expanded in memory); a float mask that requires grad gets its gradient. ``is_causal``: keep key j
    for query i when j <= i (top-left aligned, as torch); may be combined with ``attn_mask``. ``dropout_p``:
    dropout on the attention probabilities whenever > 0 (pass 0.0 in eval, as with torch); the mask is
    regenerated in the backward from a seed drawn from torch's CPU generator, so ``torch.manual_seed`` makes
    it reproducible (the random stream differs from torch's own:
    ``fusedlayers.ops.scaled_dot_product_attention.dropout_keep_mask`` gives the mask that was applied).
    ``scale``: default 1 / sqrt(E) (E = 0: the scores are 0 whatever the scale).

    Beyond torch's arguments (keyword-only; their defaults leave the call exactly torch's): ``window_size=(left,
    right)``: local (sliding-window) attention, key j kept for query i when i - left <= j <= i + right, -1 meaning
    unbounded on that side (``(w, 0)`` with or without ``is_causal``: Mistral's and Gemma's window of w + 1 keys);
    top-left aligned, as ``is_causal`` (query i sits at key i, also when L != S). ``softcap``: logit soft-capping
    as Gemma 2's, each scaled score x becomes softcap * tanh(x / softcap) before ``attn_mask`` is added; 0 = off.
    ``sinks``: None, a (H,) tensor of attention-sink logits, one per query head (gpt-oss's ``s_aux``), or one per query
    row, broadcastable to (..., H, L) (Inkling 2's): each row's softmax also counts a key of that score and value 0
    (it takes probability mass, adds nothing), differentiable in ``sinks``
    (``fusedlayers.ops.scaled_dot_product_attention.AttentionWithSinks``: the same kernels, the output rescaled by
    the sink's share).

    The output has the memory layout (strides) torch's SDPA gives for the same call, which follows the
    kernel torch picks (on CPU: like ``query`` when its flash kernel runs, else contiguous); so do the
    gradients where torch's layout is plain (see ``ops.scaled_dot_product_attention.torch_layout``).
    Rows whose keys are all masked give zeros (not NaN) and zero gradients. Accumulates in fp32 (fp64 for
    fp64); fp16/bf16/fp32 run the Triton kernels on CUDA. Saves only the inputs, the output and the
    logsumexp per row; the backward computes only the gradients that are needed, and is bitwise reproducible
    under ``torch.use_deterministic_algorithms(True)`` or ``fl.use_deterministic_attention(True)``.
    Under autocast, floating inputs are cast to the autocast dtype (as torch does for this op).
    """
    import math

    _check_query_key_value(query, key, value, autocast_casts=True)
    if query.dim() < 2 or key.dim() < 2 or value.dim() < 2:
        raise ValueError("query, key and value must have at least 2 dims ((..., L, E) layout), got "
                         f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}")
    q_len, head_dim = query.shape[-2:]
    k_len = key.shape[-2]
    if key.shape[-1] != head_dim:
        raise ValueError(f"key head dim {key.shape[-1]} must equal query head dim {head_dim}")
    if value.shape[-2] != k_len:
        raise ValueError(f"value has {value.shape[-2]} keys (dim -2) but key has {k_len}")
    enable_gqa = v.check_bool("enable_gqa", enable_gqa)
    q_batch, k_batch, v_batch = query.shape[:-2], key.shape[:-2], value.shape[:-2]
    grouped = (enable_gqa and min(query.dim(), key.dim(), value.dim()) >= 3
               and not q_batch[-1] == k_batch[-1] == v_batch[-1])
    try:
        if grouped:
            heads, kv_heads, v_heads = q_batch[-1], k_batch[-1], v_batch[-1]
            batch = _broadcast(q_batch[:-1], k_batch[:-1], v_batch[:-1])
        else:
            full = _broadcast(q_batch, k_batch, v_batch)
            batch, heads = (full[:-1], full[-1]) if full else ((), 1)
            kv_heads = v_heads = heads
    except RuntimeError:
        hint = ""
        if min(query.dim(), key.dim()) >= 3 and q_batch[-1] != k_batch[-1] and not enable_gqa:
            hint = (f" (query has {q_batch[-1]} heads, key/value {k_batch[-1]}: pass enable_gqa=True for "
                    "grouped-query attention)")
        raise ValueError(f"the batch dims of query {tuple(q_batch)}, key {tuple(k_batch)} and value "
                         f"{tuple(v_batch)} do not broadcast{hint}") from None
    if grouped and (kv_heads == 0 or v_heads == 0 or heads % kv_heads != 0 or heads % v_heads != 0):
        raise ValueError(f"enable_gqa=True needs query heads ({heads}) to be a multiple of key/value heads "
                         f"({kv_heads}, {v_heads})")
    out_batch = (*batch, heads) if grouped or q_batch or k_batch or v_batch else ()
    dropout_p, is_causal, window_size, softcap = _check_attention_options(dropout_p, is_causal, window_size, softcap)
    scale_arg = scale
    if scale is not None:
        scale = v.check_number("scale", scale)
    if head_dim == 0:
        scale = 1.0  # every score is 0
    elif scale is None:
        scale = 1.0 / math.sqrt(head_dim)
    if attn_mask is not None:
        v.check_tensor("attn_mask", attn_mask)
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in v.FLOAT_DTYPES:
            raise TypeError(f"attn_mask must be bool (True = keep) or floating (additive), got {attn_mask.dtype}")
        if (attn_mask.dtype not in (torch.bool, torch.float32, query.dtype)
                and not torch.is_autocast_enabled(query.device.type)):
            raise TypeError(f"a floating attn_mask must be float32 or query's dtype ({query.dtype}), as torch "
                            f"requires, got {attn_mask.dtype}")
        if attn_mask.device != query.device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {query.device}")
        v.check_broadcastable_to("attn_mask", attn_mask, (*out_batch, q_len, k_len))
    layout = _attention_ops.torch_layout(query, key, value, attn_mask, dropout_p, is_causal, scale_arg,
                                         enable_gqa)
    if layout == _attention_ops.LAYOUT_CONTIGUOUS and (grouped or query.dim() < 3 or key.dim() < 3):
        layout = _attention_ops.LAYOUT_CONTIGUOUS_DK  # torch's matmul folds to mm / repeats K: dk contiguous

    # the op works on (B, H, L, E) with key/value (B, H_kv, S, E): broadcast batch dims become stride-0 views
    if grouped and kv_heads != v_heads:  # torch repeats key and value apart: one group size needs copies
        key = key.repeat_interleave(heads // kv_heads, -3)
        value = value.repeat_interleave(heads // v_heads, -3)
        kv_heads = heads
    n_batch = math.prod(batch)

    def folded(t: Tensor, h: int) -> bool:
        """Already (B, H, L, E): passed on as is (each identity view would add an autograd node to the backward of
        every eager call, 5-15 us of a GPU host's time)."""
        return t.dim() == 4 and t.shape[:2] == (n_batch, h)

    def fold(t: Tensor, h: int) -> Tensor:
        if folded(t, h):
            return t
        t = t.expand(*batch, h, *t.shape[-2:])
        return t.reshape(n_batch, h, *t.shape[-2:])

    def fold_transposed(t: Tensor, h: int) -> Tensor:  # the same view, broadcast as t^T: torch's dK layout
        return t if folded(t, h) else fold(t.transpose(-1, -2), h).transpose(-1, -2)

    query, value = fold(query, heads), fold(value, kv_heads)
    key = fold_transposed(key, kv_heads) if layout == _attention_ops.LAYOUT_CONTIGUOUS else fold(key, kv_heads)
    if attn_mask is not None and len(batch) > 1 and attn_mask.dim() > 2:
        attn_mask = attn_mask.expand(*out_batch, q_len, k_len).reshape(n_batch, heads, q_len, k_len)
    seed = _attention_ops.draw_dropout_seed() if dropout_p > 0.0 else None
    if sinks is not None:
        sinks = _folded_sinks(sinks, heads if out_batch else None, out_batch, n_batch, q_len, query)
        out = _attention_ops.AttentionWithSinks.apply(query, key, value, attn_mask, sinks, seed, dropout_p,
                                                      is_causal, scale, layout, *window_size, float(softcap))
        return out if out.shape[:-2] == out_batch else out.reshape(*out_batch, q_len, out.shape[-1])
    out, _ = call(
        _attention_ops.scaled_dot_product_attention, query, key, value, attn_mask, seed, dropout_p, is_causal,
        scale, layout, *window_size, float(softcap),
    )
    return out if out.shape[:-2] == out_batch else out.reshape(*out_batch, q_len, out.shape[-1])


def varlen_attention(
    query: Tensor, key: Tensor, value: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int,
    max_seqlen_k: int, dropout_p: float = 0.0, scale: float | None = None, is_causal: bool = False,
    window_size: tuple[int, int] = (-1, -1), softcap: float = 0.0,
) -> Tensor:
    """Attention over sequences of different lengths packed without padding, as FlashAttention's
    ``flash_attn_varlen_func``: query (total_q, H, D), key (total_k, H_kv, D), value (total_k, H_kv, Dv); sequence b
    is query rows [cu_seqlens_q[b], cu_seqlens_q[b + 1]) and key rows [cu_seqlens_k[b], cu_seqlens_k[b + 1]) (int32,
    on the inputs' device, starting at 0 and ending at total_q / total_k; empty sequences allowed); each row attends
    only to its own sequence's keys. Returns (total_q, H, Dv).

    ``is_causal`` and ``window_size=(left, right)`` are aligned bottom-right within each sequence, as FlashAttention's
    varlen (unlike ``scaled_dot_product_attention``'s top-left): query i of a sequence with L queries and S keys sits
    at key i + S - L, so with L < S the queries see the sequence's earlier keys, and with L > S the first L - S query
    rows see no key (zero output and gradients). GQA by head count (H a multiple of H_kv; query head h reads
    key/value head h // (H / H_kv), not copied); ``softcap`` as Gemma 2's; dropout as
    ``scaled_dot_product_attention``'s. ``max_seqlen_q``/``max_seqlen_k``: FlashAttention's arguments, accepted and
    checked against the lengths (the kernels size their grid by the packed totals and skip what no sequence needs).

    Triton forward and backward on CUDA (the dense attention kernels in interval mode: blocks of keys that no row of a
    query block may see are skipped, not masked), the same blockwise algorithm in PyTorch elsewhere; fp32 math.
    """
    import math

    _check_query_key_value(query, key, value)
    for name, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be 3-D (total, heads, head_dim), got shape {tuple(t.shape)}")
    H, D = query.shape[1:]
    H_kv = key.shape[1]
    if key.shape[2] != D or value.shape[:2] != key.shape[:2]:
        raise ValueError(f"key {tuple(key.shape)} and value {tuple(value.shape)} must have the same (total_k, "
                         f"H_kv) and key query's head dim {D}")
    if H_kv == 0 or H % H_kv:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({H_kv})")
    dropout_p, is_causal, window_size, softcap = _check_attention_options(dropout_p, is_causal, window_size, softcap)
    scale = (1.0 / math.sqrt(D) if D else 1.0) if scale is None else v.check_number("scale", scale)
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        v.check_tensor(name, cu)
        if cu.device != query.device:
            raise ValueError(f"{name} is on {cu.device} but query is on {query.device}")
    intervals = _varlen_key_intervals(cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, window_size,
                                      query.shape[0], key.shape[0])
    seed = _attention_ops.draw_dropout_seed() if dropout_p > 0.0 else None
    out, _ = call(_varlen_ops.varlen_attention, query, key, value, *intervals, seed, dropout_p, float(scale),
                  float(softcap), keys_per_row(max_seqlen_k, is_causal, window_size))
    return out


# The last call's key intervals: a model calls varlen_attention once per layer with the same cu_seqlens tensors, and
# checking their values syncs with the GPU. A hit needs the same tensor objects, unmodified since (their _version), and
# the same options; the entry holds the tensors, so no other tensor can take their memory meanwhile.
_last_intervals: list = [((), None)]  # one (key, intervals) pair, swapped whole: threads never see half of one


def _varlen_key_intervals(cu_q: Tensor, cu_k: Tensor, max_q, max_k, is_causal: bool, window: tuple[int, int],
                          total_q: int, total_k: int) -> tuple[Tensor, ...]:
    """cu_seqlens and max_seqlen checked against the packed totals, then turned into key intervals."""
    compiling = torch.compiler.is_compiling()  # the checks of the lengths' values read them (not traceable)
    key = None
    if not (compiling or cu_q.is_inference() or cu_k.is_inference()):  # inference tensors have no _version
        key = (cu_q, cu_q._version, cu_k, cu_k._version, max_q, max_k, is_causal, window, total_q, total_k)
        cached, intervals = _last_intervals[0]
        if len(cached) == len(key) and all(c is k if isinstance(k, Tensor) else type(c) is type(k) and c == k
                                           for c, k in zip(cached, key, strict=False)):
            return intervals
    lens = []
    for name, cu, total in (("cu_seqlens_q", cu_q, total_q), ("cu_seqlens_k", cu_k, total_k)):
        if cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 1:
            raise ValueError(f"{name} must be a 1-D int32 tensor of cumulative lengths, got {cu.dtype} of shape "
                             f"{tuple(cu.shape)}")
        n = cu.to(torch.int64)
        if not compiling and (n[0] != 0 or n[-1] != total or bool((n[1:] < n[:-1]).any())):
            raise ValueError(f"{name} must start at 0, never decrease and end at {total} (the packed length)")
        lens.append(n[1:] - n[:-1])
    if cu_q.numel() != cu_k.numel():
        raise ValueError(f"cu_seqlens_q and cu_seqlens_k must hold the same number of sequences, got "
                         f"{cu_q.numel() - 1} and {cu_k.numel() - 1}")
    for name, value_, n in (("max_seqlen_q", max_q, lens[0]), ("max_seqlen_k", max_k, lens[1])):
        longest = int(n.max()) if n.numel() and not compiling else 0
        if not isinstance(value_, int) or isinstance(value_, bool) or value_ < longest:
            raise ValueError(f"{name} must be an int >= the longest sequence ({longest}), got {value_!r}")
    intervals = _varlen_intervals(cu_q.to(torch.int64), cu_k.to(torch.int64), *lens, is_causal, window, total_q,
                                  total_k)
    if key is not None:
        _last_intervals[0] = (key, intervals)
    return intervals


def _varlen_intervals(cu_q: Tensor, cu_k: Tensor, len_q: Tensor, len_k: Tensor, is_causal: bool,
                      window: tuple[int, int], total_q: int, total_k: int) -> tuple[Tensor, ...]:
    """(row_lo, row_hi, col_lo, col_hi) int32: the keys each query row attends, the queries each key is attended by.
    Within a sequence query i sits at key i + (S - L) (bottom-right); causal caps the right side at 0 keys past it."""
    n = len_q.numel()
    big = total_q + total_k + 1
    left = window[0] if window[0] >= 0 else big
    right = window[1] if window[1] >= 0 else big
    if is_causal:
        right = min(right, 0)
    diag = len_k - len_q
    seq_q = torch.repeat_interleave(torch.arange(n, device=cu_q.device), len_q, output_size=total_q)
    i = torch.arange(total_q, device=cu_q.device) - cu_q[seq_q]
    at = i + diag[seq_q]  # the key this query sits at, local to its sequence
    lo = torch.clamp(at - left, min=0)
    hi = torch.minimum(at + right, len_k[seq_q] - 1)
    row_lo, row_hi = cu_k[seq_q] + lo, cu_k[seq_q] + hi  # hi < lo: no key
    seq_k = torch.repeat_interleave(torch.arange(n, device=cu_q.device), len_k, output_size=total_k)
    j = torch.arange(total_k, device=cu_q.device) - cu_k[seq_k]
    first = torch.clamp(j - diag[seq_k] - right, min=0)  # queries i with at(i) - left <= j <= at(i) + right
    last = torch.minimum(j - diag[seq_k] + left, len_q[seq_k] - 1)
    col_lo, col_hi = cu_q[seq_k] + first, cu_q[seq_k] + last
    return tuple(t.to(torch.int32) for t in (row_lo, row_hi, col_lo, col_hi))


def _check_query_key_value(query: Tensor, key: Tensor, value: Tensor, autocast_casts: bool = False) -> None:
    """Floating tensors of one dtype on query's device (both attention functions). ``autocast_casts``: the op's
    autocast rule casts them (all but fp64) to one dtype, so under autocast they need only agree after it, as torch's
    scaled_dot_product_attention accepts a float32 query beside a bfloat16 value there."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        v.check_float_tensor(name, t)
    dtypes = {query.dtype, key.dtype, value.dtype}
    if len(dtypes) > 1 and autocast_casts and torch.is_autocast_enabled(query.device.type):
        dtypes = {d if d == torch.float64 else None for d in dtypes}
    if len(dtypes) > 1:
        raise TypeError(f"query, key and value must have the same dtype, got query {query.dtype}, "
                        f"key {key.dtype}, value {value.dtype}")
    for name, t in (("key", key), ("value", value)):
        if t.device != query.device:
            raise ValueError(f"{name} is on {t.device} but query is on {query.device}")


def _check_attention_options(dropout_p, is_causal, window_size, softcap) -> tuple[float, bool, tuple[int, int], float]:
    """The options both attention functions share, checked: dropout_p in [0, 1], is_causal a bool, window_size a pair
    of ints >= -1, softcap finite >= 0."""
    dropout_p = v.check_number("dropout_p", dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be between 0.0 and 1.0, got {dropout_p}")
    softcap = v.check_number("softcap", softcap)
    if not (0.0 <= softcap < float("inf")):
        raise ValueError(f"softcap must be a finite number >= 0 (0: no soft-capping), got {softcap}")
    return dropout_p, v.check_bool("is_causal", is_causal), _check_window("window_size", window_size), softcap


def _folded_sinks(sinks, heads: int | None, out_batch: tuple, n_batch: int, q_len: int, query: Tensor) -> Tensor:
    """Sinks (H,) or broadcastable to (..., H, L) as (1, H, 1) or (B, H, L), the op's layout."""
    v.check_float_tensor("sinks", sinks)
    if sinks.device != query.device:
        raise ValueError(f"sinks is on {sinks.device} but query is on {query.device}")
    if heads is not None and tuple(sinks.shape) == (heads,):
        return sinks.view(1, heads, 1)
    rows = (*out_batch, q_len)
    try:
        ok = heads is not None and sinks.dim() == len(rows) and torch.broadcast_shapes(sinks.shape, rows) == rows
    except RuntimeError:
        ok = False
    if not ok:
        raise ValueError(f"sinks must have shape (H,) (one logit per query head) or broadcast to (..., H, L) = {rows} "
                         f"(one per query row; query of shape {tuple(query.shape)} has heads at dim -3), got "
                         f"{tuple(sinks.shape)}")
    return sinks.expand(rows).reshape(n_batch, heads, q_len)


def _check_window(name: str, window) -> tuple[int, int]:
    ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(
        isinstance(w, int) and not isinstance(w, bool) and w >= -1 for w in window)
    if not ok:
        raise ValueError(f"{name} must be a pair (left, right) of ints >= -1 (-1: unbounded), got {window!r}")
    return int(window[0]), int(window[1])


def _check_loss_args(ignore_index, reduction, label_smoothing, z_loss) -> tuple[int, str, float, float]:
    return (v.check_int("ignore_index", ignore_index), v.check_reduction(reduction),
            v.check_fraction("label_smoothing", label_smoothing), v.check_non_negative("z_loss", z_loss))


def _loss_dtype(input: Tensor) -> torch.dtype:
    """The loss dtype torch gives: the input's, or fp32 under autocast (cross-entropy runs in fp32 there)."""
    if input.dtype in (torch.float16, torch.bfloat16) and torch.is_autocast_enabled(input.device.type):
        return torch.float32
    return input.dtype


def _check_logit_transform(logit_scale, softcap, scale_name: str = "logit_scale", softcap_name: str = "softcap"
                           ) -> tuple[float, float | None]:
    logit_scale = v.check_number(scale_name, logit_scale)
    if not 0.0 < logit_scale < float("inf"):
        raise ValueError(f"{scale_name} must be a finite number > 0, got {logit_scale}")
    if softcap is not None:
        softcap = v.check_number(softcap_name, softcap)
        if not 0.0 < softcap < float("inf"):
            raise ValueError(f"{softcap_name} must be None (no soft-capping) or a finite number > 0, got {softcap}")
    return logit_scale, softcap


def _check_class_weight(weight, n_classes: int, device: torch.device) -> Tensor | None:
    if weight is None:
        return None
    v.check_float_tensor("weight", weight)
    if tuple(weight.shape) != (n_classes,):
        raise ValueError(f"weight must hold one weight per class, shape ({n_classes},), got {tuple(weight.shape)}")
    if weight.device != device:
        raise ValueError(f"weight is on {weight.device} but input is on {device}")
    return weight


def _probabilities_dtype(dtype: torch.dtype, target: Tensor, weight: Tensor | None) -> torch.dtype:
    """torch computes a class-probability loss in the promoted dtype of logits, target (and weights)."""
    dtype = torch.promote_types(dtype, target.dtype)
    return torch.promote_types(dtype, weight.dtype) if weight is not None else dtype


def cross_entropy(
    input: Tensor, target: Tensor, weight: Tensor | None = None, size_average: bool | None = None,
    ignore_index: int = -100, reduce: bool | None = None, reduction: str = "mean", label_smoothing: float = 0.0,
    *, z_loss: float = 0.0,
) -> Tensor:
    """Cross-entropy, equal to ``F.cross_entropy`` (same arguments, same positional order) when ``z_loss=0``.

    Shapes as ``F.cross_entropy``: ``input`` (N, C), (C,) unbatched or (N, C, d1, ...) -- the class dim is dim 1,
    so flatten (B, T, C) logits to (B*T, C) yourself, exactly as for ``F.cross_entropy``. ``target``: class
    indices (int64, or another integer dtype) of shape (N,), () or (N, d1, ...), or class probabilities (a
    floating tensor of ``input``'s shape; torch promotes logits, probabilities and weights to one dtype, and so
    do we). ``weight``: None or (C,) per-class weights, with torch's semantics: a class-index row counts
    ``weight[target]`` times, and "mean" divides by the sum of ``weight[target]`` over the non-ignored rows;
    with label smoothing the smoothing term is weighted per class as torch does; with probabilities the
    weights scale each class's term and "mean" divides by the number of rows. ``size_average``/``reduce``:
    torch's legacy arguments, mapped as torch maps them (with its warning).

    ``reduction``: "mean", "sum" or "none" (shape of ``target`` without the class dim; ignored rows give 0).
    If every target is ignored (or the batch is empty), "mean" returns NaN with zero gradients, as torch does
    (0 / 0), and "sum" returns 0. ``label_smoothing`` in [0, 1], as torch. ``ignore_index`` applies to class
    indices only (torch refuses it for probabilities, and so do we). ``z_loss`` >= 0 (keyword-only) adds
    ``z_loss * logsumexp(x)**2`` per non-ignored row (PaLM's auxiliary loss; times ``weight[target]`` with
    class weights), reduced the same way.

    A class index outside [0, C) that is not ``ignore_index`` raises ``TargetOutOfRangeError`` (a ValueError
    and an IndexError) on CPU; on CUDA (where checking would synchronise) no kernel reads out of bounds and
    that row's loss and gradient are NaN, so the reduced loss is NaN.

    The logits are read, never written (the gradient is a new tensor); accumulation in fp32 (fp64 for fp64,
    which runs the PyTorch reference) and the loss in the input's dtype (fp32 under autocast, as torch).
    Saves the logits, targets and one fp32 logsumexp per row (two with probabilities, or with weights and
    smoothing) for backward. Probability targets that require grad get their gradient. Class weights that
    require grad (torch: probabilities only) take a slower path of plain PyTorch ops.
    """
    v.check_float_tensor("input", input)
    v.check_tensor("target", target)
    if size_average is not None or reduce is not None:
        from torch.nn import _reduction

        reduction = _reduction.legacy_get_string(size_average, reduce)
    ignore_index, reduction, label_smoothing, z_loss = _check_loss_args(ignore_index, reduction, label_smoothing,
                                                                        z_loss)
    if target.device != input.device:
        raise ValueError(f"target is on {target.device} but input is on {input.device}")
    if input.dim() == 0:
        raise ValueError("input must have at least 1 dim (the classes), got a 0-d tensor")
    n_classes = input.shape[0] if input.dim() == 1 else input.shape[1]
    soft = target.is_floating_point()
    if soft:
        v.check_float_tensor("target", target)
        if target.shape != input.shape:
            raise ValueError(f"target of class probabilities (a floating tensor) must have input's shape "
                             f"{tuple(input.shape)}, got {tuple(target.shape)}")
        if ignore_index != -100:
            raise ValueError("ignore_index is not supported for class-probability (floating) targets, as in torch")
    else:
        v.check_index_tensor("target", target)
        expected = () if input.dim() == 1 else (input.shape[0], *input.shape[2:])
        if tuple(target.shape) != expected:
            raise ValueError(f"target of shape {tuple(target.shape)} does not match input of shape "
                             f"{tuple(input.shape)}: expected {expected} (the class dim of input is dim "
                             f"{0 if input.dim() == 1 else 1}) for class indices, or input's shape for "
                             "class probabilities")
    if n_classes == 0:
        raise ValueError(f"input must have at least one class, got shape {tuple(input.shape)}")
    weight = _check_class_weight(weight, n_classes, input.device)
    if soft:
        dtype = _probabilities_dtype(input.dtype, target, weight)
        input, target = input.to(dtype), target.to(dtype)
    out_shape = target.shape if not soft else input.shape[:1] + input.shape[2:] if input.dim() > 1 else ()
    if input.dim() == 1:
        logits, target = input.unsqueeze(0), target.reshape(1, n_classes) if soft else target.reshape(1)
    elif input.dim() > 2:
        logits = input.movedim(1, -1).reshape(-1, n_classes)
        target = target.movedim(1, -1).reshape(-1, n_classes) if soft else target.reshape(-1)
    else:
        logits = input
    if not soft and target.dtype not in (torch.int64, torch.int32):
        target = target.long()
    out_dtype = _loss_dtype(input)
    if weight is not None and weight.requires_grad and torch.is_grad_enabled():
        loss = _cross_entropy_ops.cross_entropy_composite(logits, target, weight, ignore_index, reduction,
                                                          label_smoothing, z_loss).to(out_dtype)
    else:
        loss, *_ = call(_cross_entropy_ops.cross_entropy, logits, target, weight, ignore_index, reduction,
                        label_smoothing, z_loss, out_dtype)
    return loss.reshape(out_shape) if reduction == "none" else loss


def _prod(sizes) -> int:
    n = 1
    for s in sizes:
        n *= s
    return n


def _aspect_ratio_rows(method: str, n_rows: int, hidden: int, n_classes: int) -> int:
    """torch's LinearCrossEntropyOptions chunking_method "aspect_ratio[:k]": the logits chunk as big as the input,
    divided by k: next_pow2(ceil(N / ceil(C / H))) // k rows."""
    _, _, factor = method.partition(":")
    target = -(-n_rows // -(-n_classes // hidden))
    rows = 1 << max(target - 1, 0).bit_length()
    return max(1, min(rows // int(factor or 1), n_rows))


def _linear_ce_options(options, chunk_size, accumulation_dtype, n_rows: int, hidden: int, n_classes: int,
                       compute_dtype: torch.dtype) -> tuple[int, torch.dtype, bool]:
    """(rows per chunk, 0 = ours by default; grad_weight accumulation dtype; allow_retain_graph) from torch's
    ``LinearCrossEntropyOptions`` and our keywords."""
    chunk = acc = None
    retain = False
    if options is not None:
        options_type = getattr(torch.nn, "LinearCrossEntropyOptions", None)
        if options_type is None:
            raise TypeError("options: this torch has no torch.nn.LinearCrossEntropyOptions (torch >= 2.13); pass "
                            "options=None and use chunk_size= / accumulation_dtype=")
        if not isinstance(options, options_type):
            raise TypeError(f"options must be a torch.nn.LinearCrossEntropyOptions or None, got "
                            f"{type(options).__name__}")
        retain = bool(options.allow_retain_graph)
        if options.acc_dtype is not None:
            acc = options.acc_dtype
        elif options.acc_policy != "auto":  # torch: an explicit policy without acc_dtype accumulates in the input's
            acc = compute_dtype
        method = options.chunking_method
        if options.batch_chunk_size is not None:
            chunk = min(options.batch_chunk_size, max(n_rows, 1))
            if method not in (None, "auto") and _aspect_ratio_rows(method, n_rows, hidden, n_classes) != chunk:
                raise ValueError(f"options: batch_chunk_size={options.batch_chunk_size} and chunking_method="
                                 f"{method!r} give different chunk sizes; pass only one")
        elif method is None:
            chunk = max(n_rows, 1)  # torch: one chunk
        elif method != "auto":  # "auto" leaves the choice to us (torch's auto picks small chunks for its own op)
            chunk = _aspect_ratio_rows(method, n_rows, hidden, n_classes)
    if chunk_size is not None:
        if v.check_int("chunk_size", chunk_size) < 1:
            raise ValueError(f"chunk_size must be >= 1 (or None for automatic), got {chunk_size}")
        if chunk is not None and chunk != min(chunk_size, max(n_rows, 1)):
            raise ValueError(f"chunk_size={chunk_size} disagrees with the chunk size options ask for ({chunk})")
        chunk = chunk_size
    if accumulation_dtype is not None:
        if not isinstance(accumulation_dtype, torch.dtype) or accumulation_dtype not in v.FLOAT_DTYPES:
            raise TypeError(f"accumulation_dtype must be a floating torch.dtype or None, got {accumulation_dtype!r}")
        if acc is not None and acc != accumulation_dtype:
            raise ValueError(f"accumulation_dtype={accumulation_dtype} disagrees with options' acc_dtype ({acc})")
        acc = accumulation_dtype
    if acc is None:
        acc = torch.float64 if compute_dtype == torch.float64 else torch.float32
    if acc not in v.FLOAT_DTYPES:
        raise ValueError(f"options: acc_dtype must be a floating dtype, got {acc}")
    return chunk or 0, acc, retain


def linear_cross_entropy(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, linear_bias: Tensor | None = None,
    weight: Tensor | None = None, reduction: str = "mean", ignore_index: int | None = None,
    label_smoothing: float = 0.0, options=None, z_loss: float = 0.0, chunk_size: int | None = None,
    accumulation_dtype: torch.dtype | None = None, logit_scale: float = 1.0, softcap: float | None = None,
) -> Tensor:
    """``F.linear_cross_entropy`` of torch >= 2.13 (same signature; works on older torch too), i.e.
    ``fl.cross_entropy(F.linear(input, linear_weight, linear_bias), target, weight, ...)``, without
    materialising the logits.

    Shapes as torch: ``input`` (N, H) or (H,) -- and, beyond torch, (..., H) with the leading dims flattened;
    ``linear_weight`` (C, H), or (C, d1, ..., dK, H) for a K-dimensional loss (logits (N, C, d1, ..., dK), class
    dim 1; needs a 2-D input); ``linear_bias`` None or (C, d1, ..., dK); ``target`` class indices of shape
    (N,) / () / (N, d1, ..., dK) / input's leading dims, or class probabilities of the logits' shape (as torch,
    the target holds probabilities exactly when its shape is the logits' shape). ``weight``: None or (C,)
    class weights. ``ignore_index``: None means -100 for class indices; giving one with probabilities is an
    error (as torch). Loss semantics (reductions, NaN "mean" when every row is ignored, weights, smoothing,
    z_loss, out-of-range targets) are those of ``fl.cross_entropy``. Under autocast the matmuls run in the
    autocast dtype (as F.linear) and the loss is fp32.

    Beyond torch, as model heads that post-process their logits: ``logit_scale`` (> 0) multiplies the logits
    (Cohere's ``logit_scale``, Granite's ``1 / logits_scaling``) and ``softcap`` (None or > 0) then caps them to
    ``softcap * tanh(logits / softcap)`` (Gemma 2's ``final_logit_softcapping``) before the cross-entropy, in the
    same kernels (the loss and gradient of the transformed logits, which are never stored either).

    Rows are processed ``chunk_size`` at a time through one (chunk_size, C) logits buffer (2-D linear_weight;
    a K-dimensional one, and class weights that require grad, take the slower exact path through
    ``F.linear`` and ``fl.cross_entropy``). By default the chunk is sized from N, C and the free GPU memory
    (``fusedlayers.ops.linear_cross_entropy.default_chunk_size``). For "mean"/"sum" the gradients of input,
    linear_weight, linear_bias and probability targets (those that require grad) are computed in the same pass,
    and backward only scales them by the upstream gradient -- in place where the buffer already has the
    gradient's dtype, so a second backward through the same graph raises unless ``options`` has
    ``allow_retain_graph=True``. "none" computes the loss only and recomputes the logits in backward.
    grad_weight is accumulated across chunks in fp32 by default (fp64 for fp64); ``accumulation_dtype``
    (ours) or ``options.acc_dtype`` (torch's ``LinearCrossEntropyOptions``, honoured where it exists, with
    its ``batch_chunk_size`` / ``chunking_method`` -- "auto" leaves the chunk to us -- and
    ``allow_retain_graph``) set it: the weight's own dtype (e.g. bf16) saves the fp32 accumulator and the
    final cast (the accumulator is the gradient), at the cost of a rounding per chunk. Under autocast with
    fp32 (master) weights the default fp32 accumulator is the weight's gradient itself, with no extra copy.
    Double backward is not supported.
    """
    v.check_float_tensor("input", input)
    v.check_float_tensor("linear_weight", linear_weight)
    v.check_tensor("target", target)
    if ignore_index is not None:
        v.check_int("ignore_index", ignore_index)
    _, reduction, label_smoothing, z_loss = _check_loss_args(-100, reduction, label_smoothing, z_loss)
    logit_scale, softcap = _check_logit_transform(logit_scale, softcap)
    if linear_weight.dim() < 2:
        raise ValueError(f"linear_weight must be (C, in_features) or (C, d1, ..., in_features), got shape "
                         f"{tuple(linear_weight.shape)}")
    n_classes, hidden = linear_weight.shape[0], linear_weight.shape[-1]
    out_features = tuple(linear_weight.shape[1:-1])
    if n_classes == 0:
        raise ValueError("linear_weight must have at least one row (class), got shape (0, ...)")
    if input.dim() == 0 or input.shape[-1] != hidden:
        raise ValueError(f"input of shape {tuple(input.shape)} must end with linear_weight's in_features = {hidden}")
    if out_features and input.dim() != 2:
        raise ValueError(f"a K-dimensional loss (linear_weight of shape {tuple(linear_weight.shape)}) needs a "
                         f"batched 2-D input (N, {hidden}), got input of shape {tuple(input.shape)}")
    lead = tuple(input.shape[:-1])
    logits_shape = (*lead, n_classes, *out_features)
    soft = tuple(target.shape) == logits_shape
    if soft:
        if not target.is_floating_point():
            raise TypeError(f"target has the logits' shape {logits_shape}, so it holds class probabilities and must "
                            f"be floating, got {target.dtype}")
        v.check_float_tensor("target", target)
        if ignore_index is not None:
            raise ValueError("ignore_index cannot be specified when target contains probabilities (as in torch)")
    else:
        if tuple(target.shape) != (*lead, *out_features):
            raise ValueError(f"target of shape {tuple(target.shape)} must be {(*lead, *out_features)} (class "
                             f"indices) or {logits_shape} (class probabilities) for input {tuple(input.shape)} and "
                             f"linear_weight {tuple(linear_weight.shape)}")
        v.check_index_tensor("target", target)
    ignore_index = -100 if ignore_index is None else ignore_index
    if linear_bias is not None:
        v.check_float_tensor("linear_bias", linear_bias)
        if tuple(linear_bias.shape) != (n_classes, *out_features):
            raise ValueError(f"linear_bias must have shape {(n_classes, *out_features)}, got "
                             f"{tuple(linear_bias.shape)}")
    weight = _check_class_weight(weight, n_classes, input.device)
    for name, t in (("linear_weight", linear_weight), ("target", target), ("linear_bias", linear_bias)):
        if t is not None and t.device != input.device:
            raise ValueError(f"{name} is on {t.device} but input is on {input.device}")
    device_type = input.device.type
    tensors = [t for t in (input, linear_weight, linear_bias) if t is not None]
    autocast = torch.is_autocast_enabled(device_type) and all(t.dtype != torch.float64 for t in tensors)
    if autocast:  # F.linear runs in the autocast dtype, cross-entropy in fp32
        compute_dtype = torch.get_autocast_dtype(device_type)
        ce_dtype = torch.float32 if compute_dtype in (torch.float16, torch.bfloat16) else compute_dtype
    else:
        compute_dtype = ce_dtype = input.dtype
        for name, t in (("linear_weight", linear_weight), ("linear_bias", linear_bias)):
            if t is not None and t.dtype != input.dtype:
                raise TypeError(f"{name} must have input's dtype {input.dtype}, got {t.dtype}")
    chunk, acc, retain = _linear_ce_options(options, chunk_size, accumulation_dtype, _prod(lead), hidden,
                                            n_classes, compute_dtype)
    grad = torch.is_grad_enabled()
    out_dtype = ce_dtype if not soft else _probabilities_dtype(ce_dtype, target, weight)
    if (out_features or (weight is not None and weight.requires_grad and grad)
            or (soft and out_dtype != ce_dtype)):  # the exact path, with the logits
        flat = input.dim() > 2
        logits = torch.nn.functional.linear(input.reshape(-1, hidden) if flat else input,
                                            linear_weight.reshape(-1, hidden),
                                            linear_bias.reshape(-1) if linear_bias is not None else None)
        logits = logits.reshape(-1, n_classes) if flat else logits.reshape(logits_shape)
        rows_target = target.reshape(-1, n_classes) if flat and soft else target.reshape(-1) if flat else target
        if (logit_scale, softcap) != (1.0, None):
            logits = logits * logit_scale
            logits = softcap * torch.tanh(logits / softcap) if softcap is not None else logits
        loss = cross_entropy(logits, rows_target, weight, ignore_index=ignore_index, reduction=reduction,
                             label_smoothing=label_smoothing, z_loss=z_loss)
        return loss.reshape(lead) if flat and reduction == "none" else loss
    if not soft and target.dtype not in (torch.int64, torch.int32):
        target = target.long()
    loss, *_ = call(
        _linear_cross_entropy_ops.linear_cross_entropy,
        input.reshape(-1, hidden), linear_weight, target.reshape(-1, n_classes) if soft else target.reshape(-1),
        linear_bias, weight, ignore_index, reduction, label_smoothing, z_loss, logit_scale, softcap, chunk,
        compute_dtype, acc, out_dtype, retain, grad and input.requires_grad, grad and linear_weight.requires_grad,
        grad and linear_bias is not None and linear_bias.requires_grad, grad and soft and target.requires_grad,
    )
    return loss.reshape(lead) if reduction == "none" else loss


def linear_log_probs(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, linear_bias: Tensor | None = None,
    temperature: float = 1.0, ignore_index: int = -100, return_entropy: bool = False, softcap: float | None = None,
    logit_scale: float = 1.0, chunk_size: int | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Per-token log-probabilities of a linear head, ``log_softmax(F.linear(input, linear_weight, linear_bias) /
    temperature, -1).gather(-1, target)``, without materialising the logits; with ``return_entropy`` also each
    token's entropy ``-sum_v p_v log p_v`` of that distribution. Both are differentiable (an entropy that only gets
    logged costs no backward work).

    ``input`` (..., H), ``linear_weight`` (V, H), ``linear_bias`` None or (V,), ``target`` (...) class indices
    (input's leading dims). Returns tensors of ``target``'s shape in fp32 (fp64 for fp64 input), 0 where the target
    is ``ignore_index``. ``logit_scale`` multiplies the logits and ``softcap`` caps them (``softcap * tanh(z /
    softcap)``, Gemma's final soft-cap) before the temperature, as model heads that scale their logits do. Under
    autocast the products run in the autocast dtype (as F.linear), the row work in fp32. Rows go through a
    (chunk_size, V) logits buffer (by default sized as :func:`linear_cross_entropy`'s); backward recomputes each
    chunk's logits, because every token has its own upstream gradient. The post-training losses
    (``fusedlayers.post_training``) know those gradients within the forward and skip the recomputation.
    """
    log_probs, entropy, _, _, _ = _linear_log_probs(input, linear_weight, target, linear_bias, temperature,
                                                     ignore_index, softcap, logit_scale, chunk_size,
                                                     return_entropy, False)
    return (log_probs, entropy) if return_entropy else log_probs


def linear_log_prob_statistics(
    input: Tensor, linear_weight: Tensor, target: Tensor, *, linear_bias: Tensor | None = None,
    temperature: float = 1.0, ignore_index: int = -100, softcap: float | None = None, logit_scale: float = 1.0,
    outputs: tuple[str, ...] = ("log_probs",), chunk_size: int | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None, Tensor | None, Tensor | None]:
    """:func:`linear_log_probs` with the per-token statistics TRL's fused LM head logs: returns ``(log_probs,
    entropy, log_sum_sq_probs, mean_logits, is_top1)``, each None unless named in ``outputs`` (log_probs always):
    the entropy (differentiable), ``log(sum_v p_v^2)``, the mean of the scaled logits over the vocabulary, and
    whether the target is the most likely token (first index on ties, as argmax) -- the last three without
    gradient. All 0 (False) where the target is ``ignore_index``."""
    unknown = set(outputs) - {"log_probs", "entropy", *_linear_log_probs_ops.STATS}
    if unknown:
        raise ValueError(f"outputs must name log_probs, entropy, {', '.join(_linear_log_probs_ops.STATS)}; got "
                         f"{sorted(unknown)}")
    want_stats = any(name in outputs for name in _linear_log_probs_ops.STATS)
    log_probs, entropy, mean, log_sum_sq, top1 = _linear_log_probs(
        input, linear_weight, target, linear_bias, temperature, ignore_index, softcap, logit_scale, chunk_size,
        "entropy" in outputs, want_stats)
    return (log_probs, entropy, log_sum_sq if "log_sum_sq_probs" in outputs else None,
            mean if "mean_logits" in outputs else None, top1 if "is_top1" in outputs else None)


def _linear_log_probs(input, linear_weight, target, linear_bias, temperature, ignore_index, softcap, logit_scale,
                      chunk_size, want_entropy, want_stats):
    v.check_float_tensor("input", input)
    v.check_float_tensor("linear_weight", linear_weight)
    v.check_index_tensor("target", target)
    ignore_index = v.check_int("ignore_index", ignore_index)
    temperature = v.check_number("temperature", temperature)
    logit_scale = v.check_number("logit_scale", logit_scale)
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if softcap is not None and not v.check_number("softcap", softcap) > 0:
        raise ValueError(f"softcap must be None or > 0, got {softcap}")
    if linear_weight.dim() != 2 or linear_weight.shape[0] == 0:
        raise ValueError(f"linear_weight must be (V, H) with V >= 1, got shape {tuple(linear_weight.shape)}")
    n_classes, hidden = linear_weight.shape
    if input.dim() == 0 or input.shape[-1] != hidden:
        raise ValueError(f"input of shape {tuple(input.shape)} must end with linear_weight's in_features = {hidden}")
    if tuple(target.shape) != tuple(input.shape[:-1]):
        raise ValueError(f"target must have input's leading shape {tuple(input.shape[:-1])}, got "
                         f"{tuple(target.shape)}")
    if linear_bias is not None:
        v.check_float_tensor("linear_bias", linear_bias)
        if tuple(linear_bias.shape) != (n_classes,):
            raise ValueError(f"linear_bias must have shape ({n_classes},), got {tuple(linear_bias.shape)}")
    for name, t in (("linear_weight", linear_weight), ("target", target), ("linear_bias", linear_bias)):
        if t is not None and t.device != input.device:
            raise ValueError(f"{name} is on {t.device} but input is on {input.device}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be None or a positive int, got {chunk_size!r}")
    compute_dtype = _head_compute_dtype(input, linear_weight, linear_bias)
    if target.dtype not in (torch.int64, torch.int32):
        target = target.long()
    lead = tuple(target.shape)
    log_probs, entropy, _, stats = call(
        _linear_log_probs_ops.linear_log_probs, input.reshape(-1, hidden), linear_weight,
        target.reshape(-1), linear_bias, ignore_index, logit_scale, None if softcap is None else float(softcap),
        temperature, chunk_size or 0, compute_dtype, want_entropy, want_stats)
    entropy = entropy.reshape(lead) if want_entropy else None
    if not want_stats:
        return log_probs.reshape(lead), entropy, None, None, None
    mean, log_sum_sq, top1 = (s.reshape(lead) for s in stats)
    return log_probs.reshape(lead), entropy, mean, log_sum_sq, top1.bool()


def _head_compute_dtype(input: Tensor, linear_weight: Tensor, linear_bias: Tensor | None) -> torch.dtype:
    """The dtype of a head's products: the autocast dtype under autocast (as F.linear), else the input's, which the
    weight and bias must share."""
    device_type = input.device.type
    tensors = [t for t in (input, linear_weight, linear_bias) if t is not None]
    if torch.is_autocast_enabled(device_type) and all(t.dtype != torch.float64 for t in tensors):
        return torch.get_autocast_dtype(device_type)
    for name, t in (("linear_weight", linear_weight), ("linear_bias", linear_bias)):
        if t is not None and t.dtype != input.dtype:
            raise TypeError(f"{name} must have input's dtype {input.dtype}, got {t.dtype}")
    return input.dtype


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


# ----------------------------------------------------------------------------- normalization (RMSNorm, LayerNorm)


def _check_norm_args(input: Tensor, normalized_shape, weight, bias, residual) -> list[int]:
    """normalized_shape as a list of ints, after checking every argument of rms_norm / layer_norm."""
    v.check_float_tensor("input", input)

    def is_size(s) -> bool:  # an int, or a symbolic one under torch.compile(dynamic=True)
        return isinstance(s, (int, torch.SymInt)) and not isinstance(s, bool)

    if is_size(normalized_shape):
        shape = [normalized_shape]
    elif isinstance(normalized_shape, (list, tuple)) and all(is_size(s) for s in normalized_shape):
        shape = list(normalized_shape)
    else:
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}")
    if not shape:
        raise ValueError("normalized_shape must have at least one dim")
    if input.dim() < len(shape) or list(input.shape[input.dim() - len(shape):]) != shape:
        raise ValueError(f"normalized_shape={tuple(shape)} must equal the last {len(shape)} dim(s) of input, got "
                         f"input of shape {tuple(input.shape)}")
    for name, param in (("weight", weight), ("bias", bias)):
        if param is not None:
            v.check_float_tensor(name, param)
            if list(param.shape) != shape:
                raise ValueError(f"{name} of shape {tuple(param.shape)} must have shape normalized_shape="
                                 f"{tuple(shape)}")
            if param.device != input.device:
                raise ValueError(f"{name} is on {param.device} but the input is on {input.device}")
    if residual is not None:
        v.check_float_tensor("residual", residual)
        if residual.shape != input.shape:
            raise ValueError(f"residual of shape {tuple(residual.shape)} must have the input's shape "
                             f"{tuple(input.shape)}")
        if residual.device != input.device:
            raise ValueError(f"residual is on {residual.device} but the input is on {input.device}")
    return shape


def rms_norm(input: Tensor, normalized_shape, weight: Tensor | None = None, eps: float | None = None, *,
             residual: Tensor | None = None, out_dtype: torch.dtype | None = None):
    """RMSNorm over the last ``len(normalized_shape)`` dims, equal to ``F.rms_norm(input, normalized_shape, weight,
    eps)``: ``input * rsqrt(mean(input**2) + eps) * weight``, computed in fp32 (fp64 for fp64), output in the input's
    dtype (whatever the weight's dtype, as torch). ``eps=None`` is torch's default: the machine epsilon of the compute
    dtype, ``torch.finfo(torch.float32).eps`` for fp16/bf16/fp32 input (fp64's for fp64).

    ``residual`` (keyword-only; a tensor of the input's shape): the pre-norm block's residual add fused in, returning
    ``(F.rms_norm(h, ...), h)`` with ``h = input + residual`` (torch's dtype promotion); gradients reach input and
    residual. Any shape and strides, empty input; the backward saves the normalized tensor, the weight and the fp32
    rstd per row, and computes only the gradients asked for. Under CUDA autocast the output is fp32 on torch >= 2.12
    (rms_norm is on its fp32 list), the input's dtype on older torch, as torch's. Complex input (which torch computes
    as a composite of complex ops) is handed to torch's own ``F.rms_norm``.

    ``out_dtype`` (keyword-only, a floating dtype): the normalized output's dtype instead of torch's, autocast's
    included (h keeps its own). For a norm that feeds only matmuls under autocast, the autocast dtype: the kernel
    writes what the matmul would have cast to (the same rounding), and no cast kernel runs either way.
    """
    if out_dtype is not None:
        v.check_float_dtype("out_dtype", out_dtype)
    if isinstance(input, Tensor) and input.is_complex():  # torch runs a composite of complex ops: no kernel of ours
        if out_dtype is not None:
            raise TypeError("out_dtype is not supported for complex input")
        h = input if residual is None else input + residual
        y = torch.nn.functional.rms_norm(h, normalized_shape, weight, eps)
        return (y, h) if residual is not None else y
    shape = _check_norm_args(input, normalized_shape, weight, None, residual)
    if eps is None:
        h_dtype = input.dtype if residual is None else torch.promote_types(input.dtype, residual.dtype)
        eps = torch.finfo(torch.float64 if h_dtype == torch.float64 else torch.float32).eps
    else:
        eps = v.check_number("eps", eps)
    y, h, _ = call(_rms_norm_ops.rms_norm, input, shape, weight, eps, residual, out_dtype)
    return (y, h) if residual is not None else y


def _check_layer_norm_dtypes(dtype: torch.dtype, is_cuda: bool, weight, bias) -> None:
    """torch's layer_norm takes parameters of the (normalized) input's ``dtype``, or fp32 ones (all of them) for
    fp16/bf16 input; under CUDA autocast, which casts them all to fp32, any."""
    params = [(name, p) for name, p in (("weight", weight), ("bias", bias)) if p is not None]
    if not params or (is_cuda and torch.is_autocast_enabled("cuda")):
        return
    mixed = dtype in (torch.float16, torch.bfloat16) and any(p.dtype == torch.float32 for _, p in params)
    for name, p in params:
        if mixed and p.dtype != torch.float32:
            raise TypeError(f"{name} must be float32 like the other parameters (mixed {dtype} input and "
                            f"float32 parameters), got {p.dtype}")
        if not mixed and p.dtype != dtype:
            raise TypeError(f"{name} must have the input's dtype {dtype} (or float32 for float16/bfloat16 "
                            f"input), got {p.dtype}")


def layer_norm(input: Tensor, normalized_shape, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5, *, residual: Tensor | None = None, out_dtype: torch.dtype | None = None):
    """LayerNorm over the last ``len(normalized_shape)`` dims, equal to ``F.layer_norm(input, normalized_shape,
    weight, bias, eps)``: ``(input - mean) * rsqrt(var + eps) * weight + bias`` with the biased variance, computed in
    fp32 (fp64 for fp64), output in the input's dtype. ``weight``/``bias``: the input's dtype, or float32 for
    fp16/bf16 input (as torch on CPU).

    ``residual`` (keyword-only; a tensor of the input's shape): the pre-norm block's residual add fused in, returning
    ``(F.layer_norm(h, ...), h)`` with ``h = input + residual`` (torch's dtype promotion); gradients reach input and
    residual. Any shape and strides, empty input; the backward saves the normalized tensor, the weight and the fp32
    mean and rstd per row, and computes only the gradients asked for. Under CUDA autocast the output is fp32, as
    torch's (the 16-bit input is read as it is, not copied to fp32). ``out_dtype``: as for ``rms_norm``.
    """
    if out_dtype is not None:
        v.check_float_dtype("out_dtype", out_dtype)
    shape = _check_norm_args(input, normalized_shape, weight, bias, residual)
    eps = v.check_number("eps", eps)
    h_dtype = input.dtype if residual is None else torch.promote_types(input.dtype, residual.dtype)
    _check_layer_norm_dtypes(h_dtype, input.is_cuda, weight, bias)
    y, h, _ = call(_layer_norm_ops.layer_norm, input, shape, weight, bias, eps, residual, out_dtype)
    return (y, h) if residual is not None else y


# ----------------------------------------------------------------------------- SwiGLU




def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's gating, equal to ``F.silu(gate) * up``, from one kernel forward (reads gate and up, writes the output)
    and one backward (reads the gradient, gate and up; writes only the gradients asked for). Computed in fp32 (fp64
    for fp64), output in the promoted dtype of gate and up (as torch's), gradients in gate's and up's dtypes; the
    backward saves only the inputs. gate and up: float tensors of the same shape on one device (no broadcasting),
    any strides (each read as a (rows, last dim) view in place, e.g. the halves of a fused gate_up projection; a copy
    only where its strides allow no such view), empty too; the output is contiguous. No autocast rule, as torch's
    silu and mul (the inputs' dtypes in, the promoted dtype out)."""
    _check_gate_up(gate, up)
    return call(_swiglu_ops.swiglu, gate, up)


def geglu(gate: Tensor, up: Tensor, approximate: str = "none") -> Tensor:
    """GeGLU's gating, equal to ``F.gelu(gate, approximate=approximate) * up`` (``approximate``: "none", exact GELU,
    or "tanh", its tanh form: Gemma's ``gelu_pytorch_tanh``), as :func:`swiglu` in everything else (the same
    kernels: one pass forward, one backward, fp32 math, any strides)."""
    _check_gate_up(gate, up)
    if approximate not in _geglu_ops.APPROXIMATIONS:
        raise ValueError(f"approximate must be 'none' or 'tanh' (as F.gelu), got {approximate!r}")
    return call(_geglu_ops.geglu, gate, up, approximate)


def _check_gate_up(gate, up) -> None:
    v.check_float_tensor("gate", gate)
    v.check_float_tensor("up", up)
    if gate.shape != up.shape:
        raise ValueError(f"gate and up must have the same shape (no broadcasting), got gate of shape "
                         f"{tuple(gate.shape)} and up of shape {tuple(up.shape)}")
    if gate.device != up.device:
        raise ValueError(f"up is on {up.device} but gate is on {gate.device}")


# ----------------------------------------------------------------------------- rotary position embedding


def rotary_embedding(q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotary position embedding of q and k, equal to transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``
    (rotate-half convention): ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)``.

    q: (B, H, T, D), k: (B, H_kv, T, D) (H_kv may differ from H: GQA/MQA), D even; any strides (e.g. a transposed
    (B, T, H, D) projection, read in place). cos, sin: (B, T, D) or (1, T, D) as transformers' rotary embedding
    returns them (unsqueezed on the head dim, ``unsqueeze_dim=1``), or (T, D) (broadcast over batch and heads). Returns
    new tensors (q', k') laid out as q and k, in ``promote_types(q.dtype, cos.dtype)`` as transformers' result; q and k
    are never modified. Both are rotated by one kernel launch, in fp32 (fp64 input runs the PyTorch reference); the
    backward is the inverse rotation (by -theta) of both gradients in one launch and saves only cos and sin. cos/sin
    get no gradient: a ValueError if they require one (detach them, or use transformers' function)."""
    for name, t in (("q", q), ("k", k), ("cos", cos), ("sin", sin)):
        v.check_float_tensor(name, t)
    # each shape read once (every .shape is a call into torch): these checks run on every call, and at short
    # sequences a call's host time is the op's time
    q_shape, k_shape, cos_shape = q.shape, k.shape, cos.shape
    if len(q_shape) != 4 or len(k_shape) != 4:
        raise ValueError(f"q and k must be 4-D (batch, heads, seq_len, head_dim), got q of shape {tuple(q_shape)} "
                         f"and k of shape {tuple(k_shape)}")
    B, _, T, D = q_shape
    if (k_shape[0], k_shape[2], k_shape[3]) != (B, T, D):
        raise ValueError(f"k of shape {tuple(k_shape)} must match q of shape {tuple(q_shape)} in batch, seq_len and "
                         f"head_dim")
    if D % 2:
        raise ValueError(f"head_dim must be even for the rotate-half rotary embedding, got {D}")
    if q.dtype != k.dtype:
        raise TypeError(f"k must have q's dtype {q.dtype}, got {k.dtype}")
    if cos_shape != sin.shape or cos.dtype != sin.dtype:
        raise ValueError(f"cos and sin must have the same shape and dtype, got cos {tuple(cos_shape)} {cos.dtype} and "
                         f"sin {tuple(sin.shape)} {sin.dtype}")
    if cos_shape[-2:] != (T, D) or not (len(cos_shape) == 2 or (len(cos_shape) == 3 and cos_shape[0] in (1, B))):
        raise ValueError(f"cos/sin must have shape (seq_len, head_dim)=({T}, {D}) or (batch or 1, seq_len, head_dim)"
                         f"=({B}, {T}, {D}), got {tuple(cos_shape)}")
    device = q.device
    if k.device != device or cos.device != device or sin.device != device:
        name, t = next((n, t) for n, t in (("k", k), ("cos", cos), ("sin", sin)) if t.device != device)
        raise ValueError(f"{name} is on {t.device} but q is on {device}")
    if (cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled():
        raise ValueError("cos/sin require grad, but fusedlayers.rotary_embedding computes no gradient for them: "
                         "detach them (or use transformers' apply_rotary_pos_emb)")
    return call(_rotary_embedding_ops.rotary_embedding, q, k, cos, sin)
