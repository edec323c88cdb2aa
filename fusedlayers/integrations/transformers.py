"""Fused layers inside Hugging Face transformers models.

    from fusedlayers.integrations import transformers as flt
    model = flt.apply(model)          # the same model object, changed in place
    loss = model(input_ids, attention_mask=mask, labels=labels).loss   # fused attention and fused loss
    flt.revert(model)                 # stock behaviour again

``apply(model, attention=True, loss=True, norm=True, mlp=True, rotary=True, cast_once=True)`` does independent
things (each idempotent, each undone by ``revert``): ``norm``, ``mlp`` and ``rotary`` swap in fused layers where a
module's code is Llama's (``_norm_forward``, ``_mlp_forward``, ``_apply_rotary``); the others:

**attention** -- registers :func:`attention_forward` (``fl.scaled_dot_product_attention``) with transformers'
``AttentionInterface`` under the name ``"fusedlayers"``, together with transformers' SDPA mask builder
(``sdpa_mask``) under the same name in ``AttentionMaskInterface`` (without it transformers would build no
mask at all for an unknown implementation), and selects it with ``model.set_attn_implementation`` (which
also sets every sub-model and sub-config). The attention function mirrors transformers' own
``sdpa_attention_forward``: (B, H, L, D) inputs, (B, L, H, D) output and no weights; padding / sliding-window
/ packed-sequence masks arrive as the 4-D boolean masks transformers builds for SDPA (float masks work too); a
mask that is exactly causal within documents and a sliding window, without padding (checked once per mask tensor,
not while compiling), runs without it: a sliding window as the op's ``window_size``, padding-free packing
(position_ids that restart) as ``fl.varlen_attention`` over the flattened rows, so the key blocks outside are
skipped rather than masked;
no mask means ``is_causal`` (top-left, and only when L > 1, keys cut to L when the cache has more, as SDPA's
integration does); grouped-query attention reads the shared K/V heads (``enable_gqa``, no copy); dropout in
training; Gemma 2's attention-logit soft-capping (``softcap``: the scaled score x becomes softcap * tanh(x /
softcap) before the mask is added, as its eager attention) by the op's ``softcap``; attention sinks (gpt-oss's
``s_aux`` one per head, Inkling 2's ``sinks`` one per query row) by the op's ``sinks``; an additive ``position_bias``
(Inkling's relative bias) folded into the mask as one additive float mask, which the op differentiates. Calls our
op cannot express exactly fall back, per call, to transformers' stock function -- the SDPA one, or for what SDPA
cannot do either (sinks of another shape, a soft-cap that is not a finite number >= 0) the model's own eager
function, given the mask eager attention expects (a float mask, causal included). Each fallback is counted in
:data:`fallbacks` and logged once per reason: ``softcap``, ``sinks``, ``position_bias``, ``mask_type`` (not a
bool/float tensor), ``layout`` (not 4-D, batch broadcast between query and key, heads not a multiple), ``dtype``,
``head_dim`` (key and query head dims differ), ``sliding_window`` (a window the mask does not encode: no mask and
more keys than the window), ``mask_shape``. Twelve families whose attention predates the ``AttentionInterface``
(OpenAI GPT, GPT-Neo, GPT-NeoX-Japanese, BLOOM, Falcon, MPT, XGLM, TrOCR, MVP, RemBERT, Megatron-BERT, RoFormer) get
their attention code swapped for the same steps on this function instead
(``fusedlayers.integrations._legacy_attention``); others of that age stay stock, with a warning.

**loss** -- replaces the ``forward`` of this model instance (not its class) by one that, when ``labels`` are
given, computes the causal-LM loss with ``fl.linear_cross_entropy`` on the final hidden states and the
output embedding's weight (and bias), so the (tokens x vocab) logits are never materialised. The stock
forward still runs the base model (every argument, ``logits_to_keep`` and cache handling unchanged); only
the output embedding is short-circuited while it runs: the loss is computed from its input inside its module
call and a zero-width placeholder returned. Running inside that call is what makes the loss right where the head
is sharded on its own (FSDP2's ``fully_shard(model.lm_head)``, tested; any framework that gathers a module's
weight in hooks around its call): the hooks give the head its whole weight there, and the placeholder carries the
loss so that the framework's backward hooks on the head's output fire too. An applied model holds itself only
through weak references: it is freed by ``del`` as a stock one is. The loss is exactly transformers'
``ForCausalLMLoss``: labels shifted left and padded with ``ignore_index`` (-100 unless given), or ``shift_labels``
if given; ``"mean"`` over the non-ignored tokens,
or ``sum / num_items_in_batch`` when ``num_items_in_batch`` is given (as the Trainer does under gradient
accumulation). fp16/bf16 models compute the loss in fp32 with 16-bit matmuls, as stock upcasts the logits;
fp64 models get an fp64 loss (stock rounds the logits to fp32 first).

With labels the returned output's ``logits`` are None, unless the call passes ``return_logits=True`` (then
they are computed as stock computes them, from the same hidden states, at the cost of the logits). Without
labels the forward is the stock one (logits computed as stock, generation unaffected). The output is the
model's own output class (e.g. ``CausalLMOutputWithPast``), or a tuple under ``return_dict=False``.

Models that post-process their logits: the placeholder records what the model does to it before returning it as its
``logits`` (:class:`_LogitsProbe`); a constant scale and one soft-cap (Gemma 2/3's ``final_logit_softcapping``,
Cohere's ``logit_scale``, Granite's ``logits_scaling``, ...) are the loss's ``logit_scale`` and ``softcap``: assumed
from the config on the first call, checked on every call, learned where the config does not announce them (that first
call is then recomputed by the stock forward: ``logit_transform``). Decoders that compute their own cross-entropy of
the labels unshifted (BART, Marian, Whisper, ...; read from the forward's source) get that loss fused instead of
``ForCausalLMLoss``.

The fused loss falls back to the stock forward (counted in :data:`fallbacks`, logged once) when it could not be
exact: an output embedding that is not a plain ``nn.Linear`` (or whose forward was replaced, e.g. by accelerate's
offloading hooks), a loss other than those two, and -- found on the first call with labels, then remembered for the
model -- ``logits_postprocessed``: the model changes the logits after the output embedding other than by a constant
scale and soft-cap (e.g. a learned scale), or calls the output embedding other than once; that first call is then
recomputed by the stock forward (it raises instead if a cache object was passed, since the first pass already
updated it).

**cast_once** -- under autocast over fp32 weights, a module's fp32 input that several of its ``nn.Linear`` children
read (q/k/v projections, an MLP's gate and up) is cast to the autocast dtype once instead of by each child, and one
16-bit copy is kept for their backward instead of one each; their gradients are summed in fp32 as autograd sums
them: bitwise stock's where the input feeds only those layers, else the same terms in another order (hooks on the
module and its linear children; see ``_SharedCast``).

Works for decoder ``*ForCausalLM`` models whose output embedding ``model.get_output_embeddings()`` is an
``nn.Linear`` and whose forward takes ``labels`` (tested: Llama, Mistral, Qwen2, Gemma, Gemma 2, GPT-2, Phi, Cohere,
Llava). Needs ``transformers>=4.54`` (``set_attn_implementation``, ``AttentionMaskInterface``); written against
transformers 5.x (tested with 5.24 on CPU; the GPU machine has 5.17).
"""

from __future__ import annotations

import ast
import collections
import contextlib
import contextvars
import copy
import dataclasses
import functools
import inspect
import logging
import math
import re
import sys
import textwrap
import threading
import types
import warnings
import weakref

import torch
from torch import nn

try:
    from transformers import AttentionInterface, PreTrainedModel
    from transformers.activations import (
        FastGELUActivation,
        GELUActivation,
        GELUTanh,
        NewGELUActivation,
        SiLUActivation,
    )
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.loss.loss_utils import ForCausalLMLoss
    from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
    from transformers.models.gemma import modeling_gemma as _gemma
    from transformers.models.llama import modeling_llama as _llama
    from transformers.utils import ModelOutput
except ImportError as _error:
    raise ImportError(
        "fusedlayers.integrations.transformers needs Hugging Face transformers>=4.54: "
        f"pip install 'fusedlayers[transformers]' ({type(_error).__name__}: {_error})"
    ) from _error

from fusedlayers import functional as _fl  # looked up at call time (tests wrap its functions)
from fusedlayers.backend import use_triton as _use_triton
from fusedlayers.integrations import _legacy_attention  # noqa: E402  (it uses this module at call time only)
from fusedlayers.ops import scaled_dot_product_attention as _attention_ops

try:
    from fusedlayers.kernels import shared_cast as _shared_cast_kernels
except ImportError:  # no Triton: PyTorch sums the gradients
    _shared_cast_kernels = None

__all__ = ["NAME", "apply", "revert", "register", "attention_forward", "fallbacks", "is_applied",
           "AutoFusedModelForCausalLM"]

NAME = "fusedlayers"
EAGER_MASK_NAME = "fusedlayers_eager_mask"  # the same attention, for models that support only eager attention

#: How many calls fell back to stock, per reason (attention: per attention call; loss: per forward).
fallbacks: collections.Counter[str] = collections.Counter()

logger = logging.getLogger(__name__)
_logged: set[str] = set()
_STATE = "_fusedlayers_transformers"  # the per-model record in model.__dict__
_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _fallback(reason: str, detail: str) -> None:
    fallbacks[reason] += 1
    if reason not in _logged:
        _logged.add(reason)
        logger.warning("fusedlayers: %s; falling back to the stock implementation (logged once)", detail)


# --------------------------------------------------------------------------------------------------------------
# attention


def register() -> None:
    """Register :func:`attention_forward` and transformers' SDPA mask builder under ``"fusedlayers"`` (idempotent;
    :func:`apply` calls it). After it, ``from_pretrained(..., attn_implementation="fusedlayers")`` works too."""
    AttentionInterface.register(NAME, attention_forward)
    # class-level registration: transformers checks the global mapping, and builds no mask for unknown names
    AttentionMaskInterface.register(NAME, sdpa_mask)
    # models that support only eager attention build their own additions to the mask in eager's float form (e.g.
    # DeepSeek-V4's block bias, cast to the mask's dtype): they get our attention under a name whose masks are eager's
    AttentionInterface.register(EAGER_MASK_NAME, attention_forward)
    AttentionMaskInterface.register(EAGER_MASK_NAME, eager_mask)


def _sinks(kwargs, query):
    """The attention-sink logits a model passes (gpt-oss: ``s_aux``, one per head; Inkling 2: ``sinks`` (B, H, L, 1),
    one per query row) as fl.scaled_dot_product_attention takes them ((H,) or (B, H, L)); None if there are none;
    False if they are not of either form."""
    sinks = kwargs.get("s_aux")
    sinks = kwargs.get("sinks") if sinks is None else sinks
    if sinks is None:
        return None
    if not (isinstance(sinks, torch.Tensor) and sinks.is_floating_point() and query.dim() == 4):
        return False
    B, H, L = query.shape[:3]
    if tuple(sinks.shape) == (H,):
        return sinks
    rows = (B, H, L, 1)
    if sinks.dim() == 4 and all(n in (1, m) for n, m in zip(sinks.shape, rows, strict=True)) and sinks.shape[-1] == 1:
        return sinks.squeeze(-1)
    return False


def _position_bias(kwargs, query, key):
    """An additive position bias broadcastable to (B, H, L, S) (added to the scaled scores before the mask, as the
    models' eager attention does), None if there is none, False if it is not that."""
    bias = kwargs.get("position_bias")
    if bias is None:
        return None
    shape = (query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    try:
        ok = (isinstance(bias, torch.Tensor) and bias.is_floating_point() and bias.dim() <= 4
              and torch.broadcast_shapes(bias.shape, shape) == shape)
    except RuntimeError:
        ok = False
    return bias if ok else False


def _with_bias(attention_mask, bias):
    """One additive float mask: the position bias, then the mask (a bool mask as -inf where it drops a key)."""
    if attention_mask is None:
        return bias
    if attention_mask.dtype == torch.bool:
        return bias.masked_fill(~attention_mask, float("-inf"))
    return bias + attention_mask


def _attention_fallback_reason(query, key, value, attention_mask, kwargs) -> tuple[str, str] | None:
    softcap = kwargs.get("softcap")
    if softcap is not None and not (isinstance(softcap, (int, float)) and 0 <= softcap < float("inf")):
        return "softcap", f"attention logit soft-capping by {softcap!r} (not a finite number >= 0)"
    if _sinks(kwargs, query) is False:
        sinks = kwargs.get("s_aux", kwargs.get("sinks"))
        return "sinks", (f"attention sinks of shape {tuple(getattr(sinks, 'shape', ()))}, neither one per query head "
                         "nor one per query row")
    if _position_bias(kwargs, query, key) is False:
        bias = kwargs["position_bias"]
        return "position_bias", (f"a position bias of shape {tuple(getattr(bias, 'shape', ()))} that is not an "
                                 "additive float tensor broadcastable to (B, H, L, S)")
    if attention_mask is not None and not (
        isinstance(attention_mask, torch.Tensor)
        and (attention_mask.dtype == torch.bool or attention_mask.is_floating_point())
    ):
        return "mask_type", f"attention mask of type {type(attention_mask).__name__} is not a bool or float tensor"
    if query.dim() != 4 or key.dim() != 4 or value.dim() != 4:
        return "layout", "query/key/value are not 4-D (B, H, L, D)"
    if not (query.dtype == key.dtype == value.dtype) or query.dtype not in _DTYPES:
        return "dtype", f"query/key/value dtypes {query.dtype}/{key.dtype}/{value.dtype} are not supported"
    if not (query.shape[0] == key.shape[0] == value.shape[0]):
        return "layout", "query and key/value have different batch sizes (SDPA broadcasts them, we do not)"
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads == 0 or heads % kv_heads or value.shape[1] != kv_heads or value.shape[2] != key.shape[2]:
        return "layout", f"{heads} query heads and {kv_heads} key/value heads are not grouped-query attention"
    if key.shape[-1] != query.shape[-1]:
        return "head_dim", f"key head dim {key.shape[-1]} differs from query's {query.shape[-1]}"
    window = kwargs.get("sliding_window")
    if window is not None and attention_mask is None and key.shape[2] > window:
        return "sliding_window", "a sliding window that the (absent) attention mask does not encode"
    if attention_mask is not None:
        try:
            torch.broadcast_shapes(attention_mask.shape, (query.shape[0], heads, query.shape[2], key.shape[2]))
            ok = attention_mask.dim() <= 4
        except RuntimeError:
            ok = False
        if not ok:
            return "mask_shape", (f"attention mask of shape {tuple(attention_mask.shape)} does not broadcast to "
                                  f"{(query.shape[0], heads, query.shape[2], key.shape[2])}")
    return None


# The masks _mask_structure read last: a forward's layers of one kind all pass the one mask transformers built for them
# (two kinds alternate in Gemma 2's layers: full and sliding). A hit needs that same tensor (a weak reference: no stale
# hit once it is freed), unmodified since (its _version), with the same window and batch.
_recent_masks: list = [[]]  # [[(weakref to the mask, its _version, (window, batch), structure), ...]], newest first
RECENT_MASKS = 4
MASK_BLOCK_ELEMENTS = 2**26  # about how many mask elements _read_mask_structure compares at a time


def _mask_structure(attention_mask, query, key, kwargs) -> tuple | None:
    """What a mask from transformers (boolean, or eager's additive 0 / min) encodes, where the op can run it without
    reading the mask: each query i of a row keeps exactly the keys max(start of its document, i - w + 1) <= j <= i
    (causal within documents, w the layer's ``sliding_window`` or unbounded; no padding). Documents are what
    padding-free packing (position_ids that restart) gives; one per row is plain causal attention. Returns None (the
    mask is used as is), or (w or None, cu_seqlens, max_seqlen) over the batch's rows flattened, with cu_seqlens
    None where every row is one document. One read of the mask (GPU syncs) per mask tensor: the layers sharing it
    reuse the answer. Not while compiling (reading values) and not for inference tensors (no version counter to tell
    a change by)."""
    w = kwargs.get("sliding_window")
    w = w if type(w) is int and 1 < w < query.shape[2] else None  # a window >= L: plain causal
    B, L = query.shape[0], query.shape[2]
    if (not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 4
            or not (attention_mask.dtype == torch.bool or attention_mask.is_floating_point())
            or attention_mask.shape[0] not in (1, B) or tuple(attention_mask.shape[2:]) != (L, L)
            or key.shape[2] != L or torch.compiler.is_compiling() or attention_mask.is_inference()):
        return None
    recent = _recent_masks[0]
    for ref, version, key_, structure in recent:
        if ref() is attention_mask and version == attention_mask._version and key_ == (w, B):
            return structure
    keep, pure = attention_mask, True
    if attention_mask.is_floating_point():  # eager's additive form: a bool mask only where it is 0 or the dtype's min
        keep = attention_mask == 0
        pure = bool((keep | (attention_mask <= torch.finfo(attention_mask.dtype).min)).all())
    structure = _read_mask_structure(keep, w, B) if pure else None
    entry = (weakref.ref(attention_mask), attention_mask._version, (w, B), structure)
    _recent_masks[0] = [entry, *recent[:RECENT_MASKS - 1]]  # swapped whole: threads never see half of it
    return structure


def _read_mask_structure(mask: torch.Tensor, w: int | None, B: int) -> tuple | None:
    """_mask_structure's reading, in blocks of query rows (its temporaries stay near MASK_BLOCK_ELEMENTS elements,
    not a few times the mask's)."""
    rows, heads, L = mask.shape[0], mask.shape[1], mask.shape[-1]
    i = torch.arange(L, device=mask.device)
    step = max(1, MASK_BLOCK_ELEMENTS // (rows * heads * L))
    # each query's first kept key (0 for a query with none: caught below)
    first = torch.cat([mask[:, 0, q0:q0 + step].to(torch.uint8).argmax(-1) for q0 in range(0, L, step)], dim=-1)
    starts = first == i  # a document's first token keeps only itself first (w > 1)
    doc_start = torch.cummax(torch.where(starts, i, 0), dim=-1).values
    lo = doc_start if w is None else torch.maximum(doc_start, i - w + 1)
    for q0 in range(0, L, step):  # query i keeps exactly the keys lo[i] <= j <= i
        q = i[q0:q0 + step]
        expected = (i >= lo[:, q0:q0 + step, None]) & (i <= q[:, None])
        block = mask[:, :, q0:q0 + step]
        if not torch.equal(block, expected[:, None].expand(block.shape)):
            return None
    starts = starts.expand(B, L)
    if bool(starts.sum(-1).eq(1).all()):  # one document a row (its start is key 0)
        return w, None, None
    flat = torch.cat((starts.reshape(-1).nonzero().flatten(), torch.tensor([B * L], device=mask.device)))
    return w, flat.to(torch.int32), int((flat[1:] - flat[:-1]).max())


def _eager_attention_function(module: nn.Module):
    fn = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
    if fn is None:
        raise NotImplementedError(f"fusedlayers: {type(module).__name__} needs eager attention here (softcap or "
                                  "sinks) but its module defines no eager_attention_forward")
    return fn


def _eager_mask(module, query, key, attention_mask, is_causal):
    """The additive float mask eager attention expects, from what the SDPA mask builder gave (bool or None)."""
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        if not (causal and query.shape[2] > 1):
            return None
        # transformers skips the SDPA mask only where SDPA's top-left is_causal is exact
        attention_mask = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
        attention_mask = attention_mask[None, None]
    if attention_mask.dtype == torch.bool:  # as transformers' eager_mask
        zero = torch.zeros((), dtype=query.dtype, device=attention_mask.device)
        attention_mask = torch.where(attention_mask, zero, torch.finfo(query.dtype).min)
    return attention_mask


def _sparse_mask(module, query, key, attention_mask, is_causal, indices):
    """The mask with only each query's selected keys kept (``indices``: (B, L, topk) key positions), as the eager and
    SDPA paths of those models build it."""
    B, L, S = query.shape[0], query.shape[2], key.shape[2]
    keep = torch.zeros(B, L, S, dtype=torch.bool, device=query.device).scatter(-1, indices.long(), True)[:, None]
    if attention_mask is None:
        attention_mask = _eager_mask(module, query, key, None, is_causal)
        if attention_mask is None:
            return keep
    if attention_mask.dtype == torch.bool:
        return attention_mask & keep
    return attention_mask.masked_fill(~keep, torch.finfo(attention_mask.dtype).min)


def _autocast_inputs(*tensors):
    """Under autocast, query, key and value in the autocast dtype (float64 excepted), as SDPA (on autocast's
    lower-precision list) and our op compute them: the checks below then see what the op runs. Without it, a rotary
    embedding's fp32 query and key beside the bf16 value (transformers' rotary under autocast over fp32 weights)
    would read as mixed dtypes and fall back."""
    device = tensors[0].device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    return _attention_ops._autocast_cast(device, torch.get_autocast_dtype(device), tensors)


def attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function interface (as ``sdpa_attention_forward``) on
    ``fl.scaled_dot_product_attention``: query (B, H, L, D), key/value (B, H_kv, S, D), mask bool (True = keep)
    or additive float broadcastable to (B, H, L, S), or None -> attention output (B, L, H, Dv) and None. See the
    module docstring for the fallbacks."""
    query, key, value = _autocast_inputs(query, key, value)
    indices = kwargs.pop("indices", None)
    if indices is not None:  # DeepSeek-V3.2-style sparse attention: each query's top-k keys
        attention_mask, is_causal = _sparse_mask(module, query, key, attention_mask, is_causal, indices), False
    reason = _attention_fallback_reason(query, key, value, attention_mask, kwargs)
    if reason is not None:
        _fallback(*reason)
        call_kwargs = dict(kwargs, dropout=dropout, scaling=scaling)
        if is_causal is not None:
            call_kwargs["is_causal"] = is_causal
        if any(kwargs.get(name) is not None for name in ("softcap", "s_aux", "sinks")):  # SDPA refuses them
            mask = _eager_mask(module, query, key, attention_mask, is_causal)
            return _eager_attention_function(module)(module, query, key, value, mask, **call_kwargs)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **call_kwargs)

    q_len = query.shape[2]
    softcap = float(kwargs.get("softcap") or 0.0)
    sinks = _sinks(kwargs, query)
    bias = _position_bias(kwargs, query, key)
    window_size = (-1, -1)
    structure = _mask_structure(attention_mask, query, key, kwargs)
    if structure is not None and (bias is not None or (sinks is not None and structure[1] is not None)):
        structure = None  # the dense op with the mask: varlen has no sinks; a bias is a mask of its own
    if structure is not None:  # causal within documents (and a window) without padding: no mask to read
        window, cu_seqlens, max_seqlen = structure
        window_size = (window - 1, 0) if window is not None else (-1, -1)
        if cu_seqlens is not None:  # several documents a row (padding-free packing): the rows flattened, varlen
            B, H, L, _ = query.shape
            flat = [t.transpose(1, 2).reshape(B * L, t.shape[1], t.shape[3]) for t in (query, key, value)]
            out = _fl.varlen_attention(*flat, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p=dropout,
                                       scale=scaling, is_causal=True, window_size=window_size, softcap=softcap)
            return out.view(B, L, H, -1), None
        attention_mask, is_causal = None, True
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(q_len > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > q_len:  # prefill into an empty static cache: the rest are empty slots
        key, value = key[:, :, :q_len], value[:, :, :q_len]
        bias = bias[..., :q_len] if bias is not None else None
    if bias is not None:
        attention_mask = _with_bias(attention_mask, bias)
    out = _fl.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, dropout_p=dropout, is_causal=causal, scale=scaling,
        enable_gqa=query.shape[1] != key.shape[1], softcap=softcap, window_size=window_size, sinks=sinks,
    )
    return out.transpose(1, 2).contiguous(), None


def _configs(model: PreTrainedModel) -> list:
    """Every config whose attention implementation set_attn_implementation may change."""
    seen, out = set(), []
    todo = [model.config] + [m.config for m in model.modules() if isinstance(m, PreTrainedModel)]
    while todo:
        config = todo.pop()
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        out.append(config)
        todo.extend(getattr(config, key, None) for key in getattr(config, "sub_configs", {}) or {})
    return out


def _apply_attention(model: PreTrainedModel, state: dict) -> None:
    register()
    if "attention" in state:
        return
    previous = [(config, config.__dict__.get("_attn_implementation_internal")) for config in _configs(model)]
    name = NAME if getattr(model, "_supports_sdpa", False) else EAGER_MASK_NAME
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        for config, value in previous:
            config._attn_implementation_internal = value
        switched, stock = _switch_sub_models(model, name)
        legacy = _legacy_attention.apply(model)
        if legacy[0]:  # a family whose attention predates the AttentionInterface, its code swapped
            state["legacy_attention"] = legacy
        if not switched and legacy[0]:
            state["attention"] = previous
            return
        if not switched:
            warnings.warn(f"fusedlayers: {type(model).__name__} cannot switch its attention implementation (it does "
                          "not use transformers' AttentionInterface); attention left as it was", stacklevel=3)
            return
        warnings.warn(f"fusedlayers: {type(model).__name__}'s {', '.join(stock)} cannot switch its attention "
                      "implementation (it does not use transformers' AttentionInterface): left as it was; "
                      f"{', '.join(switched)} switched", stacklevel=3)
    state["attention"] = previous


def _switch_sub_models(model: PreTrainedModel, name: str) -> tuple[list[str], list[str]]:
    """For a composite model that cannot switch as a whole (e.g. a vision tower written before the
    AttentionInterface): switch each sub-model that can ((sub-config keys switched, keys left)). Only sub-configs
    that are a sub-model's own config count (not, e.g., MPT's ``attn_config``)."""
    switched, stock = [], []
    model_configs = {id(m.config) for m in model.modules() if isinstance(m, PreTrainedModel) and m is not model}
    for key in getattr(model.config, "sub_configs", {}):
        sub = getattr(model.config, key, None)
        if sub is None or id(sub) not in model_configs:
            continue
        before = sub.__dict__.get("_attn_implementation_internal")
        with contextlib.suppress(ValueError, AttributeError, TypeError):
            model.set_attn_implementation({key: name})
        if getattr(model.config, key)._attn_implementation == name:
            switched.append(key)
        else:
            sub._attn_implementation_internal = before
            stock.append(key)
    return switched, stock


def _revert_attention(state: dict) -> None:
    _legacy_attention.revert(*state.pop("legacy_attention", ((), ())))
    for config, value in state.pop("attention", ()):
        config._attn_implementation_internal = value


# --------------------------------------------------------------------------------------------------------------
# loss


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _loss_fallback_reason(model, state) -> tuple[str, str] | None:
    if state.get("loss_unsupported"):
        return state["loss_unsupported"]
    head = model.get_output_embeddings()
    # an nn.Linear subclass that keeps Linear's forward (FSDP2's FSDPLinear) computes what the fused loss does
    if not isinstance(head, nn.Linear) or type(head).forward is not nn.Linear.forward or "forward" in head.__dict__:
        return "lm_head", f"the output embedding ({type(head).__name__}) is not a plain nn.Linear"
    if _loss_kind(model) is None:
        return "loss_function", ("the model's loss is neither transformers' ForCausalLMLoss nor a cross-entropy of "
                                 "its unshifted labels")
    return None


def _loss_kind(model) -> str | None:
    """"causal": the forward's loss is ``self.loss_function``, transformers' ForCausalLMLoss; "unshifted": a
    ``CrossEntropyLoss()`` of the logits and the labels as given (the decoders of encoder-decoder families: BART,
    Marian, Pegasus, Whisper, ...); else None."""
    cls = type(model)
    if _forward_uses_loss_function(cls):
        return "causal" if model.loss_function is ForCausalLMLoss else None
    if _forward_is_unshifted_cross_entropy(cls):
        head = model.get_output_embeddings()
        return "unshifted" if getattr(head, "out_features", None) == _text_config(model).vocab_size else None
    return None


@functools.cache
def _forward_uses_loss_function(cls) -> bool:
    """Whether the class's forward computes its loss through ``self.loss_function``."""
    code = getattr(inspect.unwrap(cls.forward), "__code__", None)
    return code is not None and "loss_function" in code.co_names


_UNSHIFTED_LOSS = re.compile(r"loss = (\w+)\(logits\.view\(-1, (self\.config\.vocab_size|logits\.size\(-1\))\), "
                             r"labels\.view\(-1\)\)")


@functools.cache
def _forward_is_unshifted_cross_entropy(cls) -> bool:
    """Whether the class's forward computes its loss as ``loss_fct = CrossEntropyLoss()`` then ``loss =
    loss_fct(logits.view(-1, V), labels.view(-1))`` (the mean over the labels that are not -100, not shifted) and
    uses ``labels`` for nothing else (read from its source: anything else keeps the stock loss)."""
    try:
        function = ast.parse(textwrap.dedent(inspect.getsource(inspect.unwrap(cls.forward)))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    loss_fns, calls = set(), set()
    for node in ast.walk(function):
        if isinstance(node, ast.Assign) and ast.unparse(node.value) == "CrossEntropyLoss()":
            loss_fns.update(ast.unparse(t) for t in node.targets)
        if isinstance(node, (ast.If, ast.While)):  # a compound statement: its header only (its body is walked)
            parts, allowed = [node.test], "labels is not None"
        elif isinstance(node, (ast.For, ast.AsyncFor)):
            parts, allowed = [node.target, node.iter], None
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            parts, allowed = [item.context_expr for item in node.items], None
        elif isinstance(node, ast.stmt) and not isinstance(node, (ast.FunctionDef, ast.Try)):
            parts, allowed = [node], "labels = labels.to(logits.device)"
        else:
            continue
        if not any(isinstance(n, ast.Name) and n.id == "labels" for part in parts for n in ast.walk(part)):
            continue
        text = " ".join(ast.unparse(part) for part in parts)
        match = _UNSHIFTED_LOSS.fullmatch(text) if isinstance(node, ast.Assign) else None
        if match:
            calls.add(match.group(1))
        elif text != allowed:
            return False
    return bool(calls) and calls <= loss_fns


def _var_keyword(sig: inspect.Signature) -> str | None:
    return next((p.name for p in sig.parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD), None)


def _holds_cache(values) -> bool:
    from transformers.cache_utils import Cache

    return any(isinstance(v, Cache) for v in values)


# ----------------------------------------------------------------------------- logits the model post-processes


class _LogitsProbe(torch.Tensor):
    """What the output embedding returns to the model while the fused loss runs: a zero-width stand-in for the logits
    that records the steps the model applies to it before returning it as its ``logits`` (Cohere's ``* logit_scale``,
    Granite's ``/ logits_scaling``, Gemma 2's ``/ cap, tanh, * cap``), so that the loss can take the same transform
    (:func:`_logit_transform`). ``steps``: (kind, value, func, args, kwargs) with the probe in args as None; only the
    output embedding's placeholder and what derives from it are probes."""

    steps: tuple = ()

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        probes = [a for a in args if isinstance(a, _LogitsProbe)]
        if isinstance(out, torch.Tensor) and len(probes) == 1:
            step = (*_step_kind(func, args, kwargs), func, tuple(None if a is probes[0] else a for a in args), kwargs)
            if out is not probes[0]:  # an in-place step returns the probe itself
                out = out.as_subclass(cls)
            out.steps = probes[0].steps + (step,)
        return out


_MUL = {torch.mul, torch.Tensor.mul, torch.Tensor.__mul__, torch.Tensor.__rmul__, torch.Tensor.mul_,
        torch.Tensor.__imul__}
_DIV = {torch.div, torch.Tensor.div, torch.Tensor.__truediv__, torch.Tensor.div_, torch.Tensor.__itruediv__}
_TANH = {torch.tanh, torch.Tensor.tanh, torch.Tensor.tanh_, nn.functional.tanh}
_SAME = {torch.Tensor.float, torch.Tensor.contiguous, torch.Tensor.to}
# detach: DeepSpeed ZeRO-3's hook wraps a module's output in an autograd function whose forward is a detach
_IDENTITY = {torch.Tensor.detach}


def _step_kind(func, args, kwargs) -> tuple[str, float | None]:
    """("scale", s) for a multiplication of the probe by a constant s (a division: 1 / s), ("tanh", None),
    ("same", None) for a cast to a floating dtype or a copy, ("identity", None) for a detach (not replayed), else
    ("other", None)."""
    others = [a for a in args if not isinstance(a, _LogitsProbe)]
    if func in _IDENTITY and not others and not kwargs:
        return "identity", None
    if func in _TANH and not others and not kwargs:
        return "tanh", None
    if func in _SAME and all(isinstance(a, torch.dtype) and a.is_floating_point for a in others + [*kwargs.values()]):
        return "same", None
    if (func in _MUL or (func in _DIV and isinstance(args[0], _LogitsProbe))) and len(others) == 1 and not kwargs:
        value = others[0]
        if isinstance(value, torch.Tensor):
            if value.numel() != 1 or value.requires_grad or not value.is_floating_point():
                return "other", None  # a learned scale or a tensor of them: not a constant transform
            value = value.item()
        if isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < float("inf"):
            return "scale", value if func in _MUL else 1.0 / value
    return "other", None


def _logit_transform(logits, placeholder) -> tuple[float, float | None] | None:
    """(logit_scale, softcap) such that the model's logits are softcap * tanh(logit_scale * x / softcap) (softcap
    None: logit_scale * x) of the head's output x, from the steps recorded on ``logits``; None if they are not of
    that form (or ``logits`` does not come from the head's placeholder)."""
    if not isinstance(logits, _LogitsProbe):
        return (1.0, None) if logits is placeholder else None  # a plain placeholder: under torch.compile
    inner, outer, capped = 1.0, 1.0, False  # logits = outer * tanh(inner * x) (capped), else inner * x
    for kind, value, *_ in logits.steps:
        if kind == "scale":
            if capped:
                outer *= value
            else:
                inner *= value
        elif kind == "tanh" and not capped:
            capped = True
        elif kind not in ("same", "identity"):
            return None
    scale = inner * outer if capped else inner
    scale = 1.0 if math.isclose(scale, 1.0, rel_tol=1e-12) else scale  # Gemma's x / cap * cap: 1 up to a rounding
    return (scale, outer) if capped else (scale, None)


def _same_transform(a: tuple[float, float | None], b: tuple[float, float | None]) -> bool:
    """Equal up to the rounding of the steps' products (a config's 1 / logits_scaling against the model's division)."""
    return (math.isclose(a[0], b[0], rel_tol=1e-12) and (a[1] is None) == (b[1] is None)
            and (a[1] is None or math.isclose(a[1], b[1], rel_tol=1e-12)))


def _replay(logits: torch.Tensor, steps: tuple) -> torch.Tensor:
    """The model's post-processing (the steps recorded on its logits) applied to real logits."""
    for kind, _, func, args, kwargs in steps:
        if kind != "identity":
            logits = func(*(logits if a is None else a for a in args), **kwargs)
    return logits


def _expected_transform(model) -> tuple[float, float | None]:
    """The transform the config announces (Gemma 2's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
    ``logits_scaling``): the first call with labels assumes it, and each call checks it against the recorded steps."""
    config = _text_config(model)
    scale, cap = 1.0, getattr(config, "final_logit_softcapping", None)
    for name, power in (("logit_scale", 1), ("logits_scaling", -1)):
        value = getattr(config, name, None)
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
            scale *= value**power
    return scale, (float(cap) if isinstance(cap, (int, float)) and cap > 0 else None)


def _fused_lm_loss(hidden, head: nn.Linear, labels, loss_kwargs: dict,
                   transform: tuple[float, float | None] = (1.0, None), unshifted: bool = False) -> torch.Tensor:
    """transformers' ForCausalLMLoss(head(hidden), labels, **loss_kwargs) without the logits; ``transform``: the
    logits' (logit_scale, softcap). ``unshifted``: ``CrossEntropyLoss()(logits.view(-1, V), labels.view(-1))``
    instead (the labels as given, the mean, in the logits' dtype)."""
    if unshifted:
        loss_kwargs = {"shift_labels": labels}
    ignore_index = loss_kwargs.get("ignore_index", -100)
    num_items_in_batch = loss_kwargs.get("num_items_in_batch")
    shift_labels = loss_kwargs.get("shift_labels")
    if shift_labels is None:
        shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    shift_labels = shift_labels.reshape(-1).to(hidden.device)
    rows = hidden.reshape(-1, hidden.shape[-1])
    reduction = "sum" if num_items_in_batch is not None else "mean"
    device_type = hidden.device.type
    # stock computes the loss in fp32 from 16-bit logits: autocast makes our op do the same (16-bit matmuls,
    # fp32 cross-entropy and loss)
    upcast = hidden.dtype in (torch.float16, torch.bfloat16) and not torch.is_autocast_enabled(device_type)
    with torch.autocast(device_type, dtype=hidden.dtype) if upcast else contextlib.nullcontext():
        loss = _fl.linear_cross_entropy(
            rows, head.weight, shift_labels, linear_bias=head.bias, ignore_index=ignore_index, reduction=reduction,
            logit_scale=transform[0], softcap=transform[1],
        )
    if reduction == "sum":
        if torch.is_tensor(num_items_in_batch):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss.to(hidden.dtype) if unshifted and upcast else loss  # stock's cross-entropy of 16-bit logits


def _stock_forward(model, inner):
    return inner if inner is not None else type(model).forward.__get__(model, type(model))


def _fused_forward(model, inner, args, kwargs):
    stock = _stock_forward(model, inner)
    return_logits = bool(kwargs.pop("return_logits", False))
    sig = inspect.signature(stock)
    try:
        bound = sig.bind(*args, **kwargs)
    except TypeError:
        return stock(*args, **kwargs)  # stock raises the error
    labels = bound.arguments.get("labels")
    state = model.__dict__.get(_STATE, {})
    # stock: without labels; after revert, when a forward installed on top of ours (TRL's trainers wrap the model's
    # forward) still calls it; and where the call asks for TRL's own chunked LM-head loss (``fused_lm_head=True``)
    if labels is None or "loss" not in state or kwargs.get("fused_lm_head"):
        return stock(*args, **kwargs)
    reason = _loss_fallback_reason(model, state)
    if reason is not None:
        _fallback(*reason)
        return stock(*args, **kwargs)

    vk = _var_keyword(sig)
    extra = bound.arguments.setdefault(vk, {}) if vk is not None else {}
    if "return_dict" in sig.parameters:
        caller_return_dict = bound.arguments.get("return_dict")
        bound.arguments["return_dict"] = True
    else:
        caller_return_dict = extra.get("return_dict")
        if vk is not None:
            extra["return_dict"] = True
    return_dict = getattr(model.config, "return_dict", True) if caller_return_dict is None else caller_return_dict
    bound.arguments["labels"] = None
    loss_kwargs = dict(extra)

    head = model.get_output_embeddings()
    captured, placeholders, losses = [], [], []
    shift_labels = loss_kwargs.get("shift_labels")
    n_labels = (labels if shift_labels is None else shift_labels).numel()
    transform = state.setdefault("logit_transform", _expected_transform(model))
    kind = _loss_kind(model)
    # the probe records what the model does to the logits; under torch.compile the plain placeholder (a model that
    # post-processes its logits then falls back)
    placeholder_type = torch.Tensor if torch.compiler.is_compiling() else _LogitsProbe

    def fused_head(hidden, *rest, **more):
        # The loss is computed here, as the head's forward inside its module call: where the head is sharded on its
        # own (FSDP2's fully_shard), the framework's hooks around that call are what give it its whole weight.
        # The placeholder standing for the logits carries the loss, and the loss returned adds the placeholder's
        # (empty) sum, so that a gradient reaches the head's output in backward and the framework's backward hooks
        # on it fire as they would for stock logits. (A model found to change the logits after the head, on its
        # first call, discards this loss for the stock one.)
        captured.append(hidden)
        if len(captured) == 1 and hidden.numel() == hidden.shape[-1] * n_labels:
            losses.append(_fused_lm_loss(hidden, head, labels, loss_kwargs, transform, kind == "unshifted"))
            placeholder = losses[0].new_zeros((*hidden.shape[:-1], 0)) + losses[0]  # not a view (FSDP2)
        else:
            placeholder = hidden.new_empty((*hidden.shape[:-1], 0))
        placeholders.append(placeholder.as_subclass(placeholder_type))
        return placeholders[-1]

    head.forward = fused_head
    try:
        output = stock(*bound.args, **bound.kwargs)
    finally:
        del head.forward

    intact = isinstance(output, ModelOutput) and len(captured) == 1
    found = _logit_transform(getattr(output, "logits", None), placeholders[0]) if intact else None
    if found is None:
        reason = ("logits_postprocessed", f"{type(model).__name__} changes the logits after the output embedding "
                  "other than by a constant scale and soft-cap (or does not call it exactly once), which the fused "
                  "loss cannot reproduce")
        state["loss_unsupported"] = reason  # a property of the model: stock from now on
    elif not _same_transform(found, transform):  # learned now: the next calls take it
        state["logit_transform"] = found
        reason = ("logit_transform", f"{type(model).__name__} scales or soft-caps its logits other than its config "
                  f"says; the loss takes logit_scale={found[0]}, softcap={found[1]} from the next call")
    elif not losses:  # this call only (e.g. logits_to_keep with labels for every position)
        reason = ("label_count", "the output embedding saw a number of positions other than the labels'")
    else:
        reason = None
    if reason is not None:
        if _holds_cache(list(args) + list(kwargs.values())):
            raise RuntimeError(f"fusedlayers: {reason[1]}; this call passed a cache that the first pass already "
                               "updated, so it cannot be recomputed with the stock loss. Call it again or use "
                               "apply(model, loss=False).")
        _fallback(*reason)
        return stock(*args, **kwargs)

    hidden = captured[0]
    # + 0 through the model's logits, which derive from the head's placeholder (see fused_head): the gradient passes
    # every hook a framework put on the head's output on its way, as stock logits' would (DeepSpeed ZeRO-3 wraps the
    # output in an autograd function whose backward gathers the head's weight for the head's backward)
    with torch._C.DisableTorchFunctionSubclass():
        loss = losses[0] + output.logits.sum()
    logits = _replay(head(hidden), getattr(output.logits, "steps", ())) if return_logits else None
    values = {f.name: getattr(output, f.name) for f in dataclasses.fields(output)}
    values.update(loss=loss, logits=logits)
    output = type(output)(**values)
    return output if return_dict else output.to_tuple()


class _WeakForward:
    """``fn(owner, *args, **kwargs)`` as the instance-level ``forward`` of ``owner``, holding ``owner`` through a weak
    reference: a bound method in the instance's own ``__dict__`` would make a reference cycle, so that a dropped model
    (its GPU memory with it) waited for the garbage collector. A deep copy or pickle of the owner gets a forward bound
    to the copy."""

    def __init__(self, fn, owner: nn.Module):
        self.fn, self._owner = fn, weakref.ref(owner)

    @property
    def owner(self) -> nn.Module:
        return self._owner()

    def __call__(self, *args, **kwargs):
        return self.fn(self._owner(), *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        params = list(inspect.signature(self.fn).parameters.values())[1:]
        return inspect.Signature(params)

    def __deepcopy__(self, memo):
        owner = self._owner()
        return type(self)(self.fn, memo.get(id(owner), owner))  # the owner is memoized before its __dict__ is copied

    def __reduce__(self):
        return type(self), (self.fn, self._owner())


class _FusedForward(_WeakForward):
    """The ``forward`` of a model instance after ``apply(model, loss=True)``: the stock forward, with the causal-LM
    loss fused when labels are given. Keeps the stock signature (generation and the Trainer inspect it)."""

    def __init__(self, model: PreTrainedModel, inner):
        super().__init__(_fused_forward, model)
        self.inner = inner  # a forward the instance had before (e.g. a hook's), else None: the class's

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(_stock_forward(self.owner, self.inner))

    def __call__(self, *args, **kwargs):
        return _fused_forward(self.owner, self.inner, args, kwargs)

    def __deepcopy__(self, memo):
        owner = self.owner
        return type(self)(memo.get(id(owner), owner), copy.deepcopy(self.inner, memo))

    def __reduce__(self):
        return type(self), (self.owner, self.inner)


def _apply_loss(model: PreTrainedModel, state: dict) -> None:
    if "loss" in state:
        return
    head = model.get_output_embeddings()
    if not isinstance(head, nn.Linear) or "labels" not in inspect.signature(model.forward).parameters:
        warnings.warn(f"fusedlayers: {type(model).__name__} is not a causal LM with an nn.Linear output embedding "
                      "and a `labels` argument; loss left as it was", stacklevel=3)
        return
    inner = model.__dict__.get("forward")
    model.forward = _FusedForward(model, inner)
    state["loss"] = inner


def _revert_loss(model: PreTrainedModel, state: dict) -> None:
    if "loss" not in state:
        return
    inner = state.pop("loss")
    state.pop("loss_unsupported", None)
    forward = model.__dict__.get("forward")
    if not (isinstance(forward, _FusedForward) and forward.owner is model):
        return  # a forward installed after ours stays; ours, which it calls, now passes every call to stock
    if inner is None:
        del model.forward
    else:
        model.forward = inner


# --------------------------------------------------------------------------------------------------------------
# layers: RMSNorm / LayerNorm, the SwiGLU MLP, the rotary embedding
#
# A model's layer is swapped only where its code is Llama's (compared as bytecode, so the many "Copied from Llama"
# classes qualify and a variant such as Gemma's (1 + weight) RMSNorm does not) and its configuration is what our op
# computes (a SiLU gate). Norms and MLPs get an instance-level forward; parameters and their names are untouched.


def _same_code(fn, reference) -> bool:
    """Do two functions run the same bytecode (docstrings aside)?"""
    a, b = getattr(fn, "__code__", None), reference.__code__

    def key(code):
        consts = tuple(c.co_code if isinstance(c, types.CodeType) else c
                       for c in code.co_consts if not isinstance(c, str))
        return code.co_code, code.co_names, consts

    return a is not None and key(a) == key(b)


def _rms_norm_forward(self, hidden_states):
    # Llama: weight * normalized.to(input dtype), i.e. the weight's and the input's promoted dtype out
    out_dtype = torch.promote_types(self.weight.dtype, hidden_states.dtype)
    y = _fl.rms_norm(hidden_states, self.weight.shape, self.weight, self.variance_epsilon)
    return y.to(out_dtype)


def _gemma_rms_norm_forward(self, x):
    # Gemma: (normalized * (1 + weight)) in fp32, rounded once to x's dtype: one rounding, as ours
    compute = torch.float64 if x.dtype == torch.float64 else torch.float32
    return _fl.rms_norm(x, self.weight.shape, 1.0 + self.weight.to(compute), self.eps)


def _layer_norm_forward(self, input):
    return _fl.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)


def _swiglu_mlp_forward(self, x):
    return self.down_proj(_fl.swiglu(self.gate_proj(x), self.up_proj(x)))


def _geglu_mlp_forward(approximate: str):
    def forward(self, x):
        return self.down_proj(_fl.geglu(self.gate_proj(x), self.up_proj(x), approximate))

    return forward


_GEGLU_FORWARDS = {approximate: _geglu_mlp_forward(approximate) for approximate in ("none", "tanh")}


def _gelu_approximation(act) -> str | None:
    """GELU's form an activation module computes ("tanh": its tanh form, "none": exact), None if not GELU. The tanh
    form's modules (GELUTanh, NewGELU, FastGELU) differ only in how they round the same formula."""
    if isinstance(act, (GELUTanh, NewGELUActivation, FastGELUActivation)):
        return "tanh"
    if isinstance(act, GELUActivation):
        return "none"
    if type(act) is nn.GELU:
        return act.approximate
    return None


def _norm_forward(module: nn.Module):
    if type(module) is nn.LayerNorm and module.elementwise_affine:
        return _layer_norm_forward
    if (isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(module, "variance_epsilon")
            and _same_code(type(module).forward, _llama.LlamaRMSNorm.forward)):
        return _rms_norm_forward
    if (isinstance(getattr(module, "weight", None), torch.Tensor) and hasattr(module, "eps")
            and _same_code(type(module).forward, _gemma.GemmaRMSNorm.forward)
            and _same_code(getattr(type(module), "_norm", None), _gemma.GemmaRMSNorm._norm)):
        return _gemma_rms_norm_forward
    return None


def _mlp_forward(module: nn.Module):
    """Llama's MLP code with a SiLU gate: fl.swiglu; with a GELU gate (Gemma's): fl.geglu."""
    if not _same_code(type(module).forward, _llama.LlamaMLP.forward):
        return None
    act = getattr(module, "act_fn", None)
    if isinstance(act, (SiLUActivation, nn.SiLU)):
        return _swiglu_mlp_forward
    approximate = _gelu_approximation(act)
    return _GEGLU_FORWARDS[approximate] if approximate is not None else None


def _apply_module_forwards(model: PreTrainedModel, state: dict, what: str, choose) -> None:
    if what in state:
        return
    swapped = []
    for module in model.modules():
        forward = choose(module)
        if forward is not None and "forward" not in module.__dict__:  # not already replaced (by us or anyone)
            module.forward = _WeakForward(forward, module)
            swapped.append(module)
    state[what] = swapped


def _revert_module_forwards(state: dict, what: str) -> None:
    for module in state.pop(what, ()):
        module.__dict__.pop("forward", None)


# Under autocast, an fp32 hidden state that several linear layers of one module read (q/k/v projections, an MLP's
# gate and up) is cast to the autocast dtype by each of them, and each keeps its own 16-bit copy for its backward.
# ``cast_once``: the module's forward pre-hook casts it once (``_SharedCast``: one output per linear child, views of
# one tensor), each linear child takes one of them in its own pre-hook, and the backward sums their gradients in fp32
# in the order autograd would: bitwise the stock values and gradients where the input feeds nothing else (a residual
# or a parallel block gets its gradient added between the children's in stock). Only exact ``nn.Linear`` children
# take the cast input (they would have cast it themselves), only the very tensor the module was given, and only while
# autocast casts to the same dtype. The hooks are module-level functions: no reference to the model. Only linear
# layers with fp32 weights at ``apply`` get them (a model converted to fp32 later: reapply).
_shared_casts = threading.local()  # .stack: (module input, its casts not yet taken) per hooked module running
# Inputs of fewer elements keep stock's casts: sharing saves about 44 bytes of memory traffic an element (three
# children; 0.16 ms a layer on an H200 at 16M elements) for tens of microseconds of Python a module call, which a
# small, host-bound step would wait for (a 24-layer model of hidden 32 on the CPU: up to 1.2x slower with it).
CAST_ONCE_MIN_ELEMENTS = 2**22


class _SharedCast(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, dtype, n):
        ctx.set_materialize_grads(False)  # casts no child took get no zero gradient
        y = x.to(dtype)
        return (y, *(y.view_as(y) for _ in range(n - 1)))

    @staticmethod
    def backward(ctx, *grads):
        given = [g for g in grads if g is not None]
        if len(given) < 2:
            return (given[0].float() if given else None), None, None
        if (_shared_cast_kernels is not None and _use_triton(given[0])
                and all(g.is_contiguous() and g.shape == given[0].shape for g in given)):
            return _shared_cast_kernels.sum_fp32(given), None, None
        total = given[0].float()
        for g in given[1:]:
            total = total + g
        return total, None, None


def _autocast_target(x) -> torch.dtype | None:
    """The dtype autocast casts ``x`` to in a linear layer, if it casts it."""
    if not isinstance(x, torch.Tensor) or x.dtype != torch.float32 or torch.compiler.is_compiling():
        return None
    device = x.device.type
    if not torch.is_autocast_enabled(device):
        return None
    dtype = torch.get_autocast_dtype(device)
    return dtype if dtype != torch.float32 else None


def _cast_once_enter(module, args, kwargs, children):
    x = args[0] if args else kwargs.get("hidden_states")
    dtype = _autocast_target(x)
    share = dtype is not None and x.numel() >= CAST_ONCE_MIN_ELEMENTS
    casts = list(_SharedCast.apply(x, dtype, children)) if share else []
    _shared_casts.__dict__.setdefault("stack", []).append((x, casts))


def _cast_once_leave(module, args, output):
    _shared_casts.stack.pop()


def _cast_once_take(module, args):
    stack = getattr(_shared_casts, "stack", None)
    if not stack or not args:
        return None
    x, casts = stack[-1]
    if casts and args[0] is x and _autocast_target(x) == casts[-1].dtype:
        return (casts.pop(), *args[1:])
    return None


def _apply_cast_once(model: PreTrainedModel, state: dict) -> None:
    if "cast_once" in state:
        return
    hooks = []
    for module in model.modules():
        # fp32 weights: a model trained under autocast (a 16-bit model's hidden states need no cast: no hooks)
        linears = [child for child in module.children()
                   if type(child) is nn.Linear and child.weight.dtype == torch.float32]
        if len(linears) < 2:
            continue
        hooks.append(module.register_forward_pre_hook(
            functools.partial(_cast_once_enter, children=len(linears)), with_kwargs=True))
        hooks.append(module.register_forward_hook(_cast_once_leave, always_call=True))
        hooks += [child.register_forward_pre_hook(_cast_once_take) for child in linears]
    state["cast_once"] = hooks


def _revert_cast_once(state: dict) -> None:
    for hook in state.pop("cast_once", ()):
        hook.remove()


# The rotary function is a global of the modeling module that the attention classes call; ours replaces it in that
# module (while an applied model of that architecture is not reverted) and computes only inside the forward of an
# applied model's attention modules (flagged by forward hooks, which also run in a checkpointed layer's recompute):
# other models of the same architecture keep transformers' function.
_rotary_on: contextvars.ContextVar[bool] = contextvars.ContextVar("fusedlayers_rotary", default=False)
#: modeling module's name -> (its own apply_rotary_pos_emb, the applied models using ours there)
_rotary_patches: dict[str, tuple] = {}


def _fused_rotary(original):
    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        if not _rotary_on.get():
            return original(q, k, cos, sin, *args, **kwargs)
        if args or set(kwargs) - {"unsqueeze_dim"} or kwargs.get("unsqueeze_dim", 1) != 1:
            reason = "rotary_layout", "apply_rotary_pos_emb called with arguments other than unsqueeze_dim=1"
        else:
            reason = _rotary_fallback_reason(q, k, cos, sin)
        if reason is not None:
            _fallback(*reason)
            return original(q, k, cos, sin, *args, **kwargs)
        return _fl.rotary_embedding(q, k, cos, sin)

    apply_rotary_pos_emb.__wrapped__ = original
    return apply_rotary_pos_emb


def _rotary_fallback_reason(q, k, cos, sin) -> tuple[str, str] | None:
    tensors = (q, k, cos, sin)
    if not all(isinstance(t, torch.Tensor) and t.dtype in _DTYPES for t in tensors):
        return "rotary_dtype", "rotary embedding of non-floating tensors"
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or cos.shape != sin.shape:
        return "rotary_layout", "rotary embedding of tensors not laid out as (B, H, T, D) with cos/sin (B, T, D)"
    B, _, T, D = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (B, T, D) or cos.shape[0] not in (1, B) or cos.shape[1:] != (T, D):
        return "rotary_layout", "rotary embedding with cos/sin that broadcast other than over heads"
    if D % 2 or q.dtype != k.dtype or cos.dtype != sin.dtype or len({t.device for t in tensors}) > 1:
        return "rotary_layout", "rotary embedding of an odd head dim, mixed q/k dtypes or devices"
    if (cos.requires_grad or sin.requires_grad) and torch.is_grad_enabled():
        return "rotary_grad", "rotary embedding whose cos/sin require grad"
    return None


def _stock_llama_rotary():
    """transformers' Llama apply_rotary_pos_emb, the one our patch may have replaced."""
    return _rotary_patches.get(_llama.__name__, (_llama.apply_rotary_pos_emb,))[0]


def _flag_rotary(module: nn.Module) -> list:
    """Forward hooks that switch our rotary function on while ``module`` runs."""
    tokens = []

    def enter(mod, args):
        tokens.append(_rotary_on.set(True))

    def leave(mod, args, output):
        _rotary_on.reset(tokens.pop())

    return [module.register_forward_pre_hook(enter), module.register_forward_hook(leave, always_call=True)]


def _apply_rotary(model: PreTrainedModel, state: dict) -> None:
    if "rotary" in state:
        return
    names, hooks = [], []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        module = sys.modules.get(name)
        current = getattr(module, "apply_rotary_pos_emb", None)
        if name not in _rotary_patches:
            rotate_half = getattr(module, "rotate_half", None)  # the function's global (NanoChat's turns the other way)
            if (current is None or not _same_code(current, _stock_llama_rotary()) or rotate_half is None
                    or not _same_code(rotate_half, _llama.rotate_half)):
                continue
            _rotary_patches[name] = (current, weakref.WeakSet())
            module.apply_rotary_pos_emb = _fused_rotary(current)
        _rotary_patches[name][1].add(model)
        names.append(name)
    for m in model.modules():  # the modules whose own code calls the rotary function: the attention layers
        code = getattr(inspect.unwrap(type(m).forward), "__code__", None)
        if type(m).__module__ in names and code is not None and "apply_rotary_pos_emb" in code.co_names:
            hooks += _flag_rotary(m)
    state["rotary"] = names, hooks


def _revert_rotary(model: PreTrainedModel, state: dict) -> None:
    names, hooks = state.pop("rotary", ((), ()))
    for hook in hooks:
        hook.remove()
    for name in names:
        entry = _rotary_patches.get(name)
        if entry is None:
            continue
        entry[1].discard(model)
        if not entry[1]:
            sys.modules[name].apply_rotary_pos_emb = entry[0]
            del _rotary_patches[name]


# --------------------------------------------------------------------------------------------------------------
# public API


_PARTS = ("attention", "loss", "norm", "mlp", "rotary", "cast_once")


def apply(model: PreTrainedModel, attention: bool = True, loss: bool = True, norm: bool = True, mlp: bool = True,
          rotary: bool = True, cast_once: bool = True) -> PreTrainedModel:
    """Make ``model`` use fused attention (``attention``), the fused causal-LM loss (``loss``), fused RMSNorm /
    LayerNorm (``norm``), the fused SwiGLU gate (``mlp``) and the fused rotary embedding (``rotary``), and under
    autocast cast a hidden state that several linear layers of a module read once (``cast_once``), in place;
    returns the same model. Idempotent; enables what is asked and leaves the rest as it is (:func:`revert`
    undoes). See the module docstring for what each does and when it falls back to stock."""
    if not isinstance(model, PreTrainedModel):
        raise TypeError(f"model must be a transformers PreTrainedModel, got {type(model).__name__}")
    state = model.__dict__.setdefault(_STATE, {})
    if attention:
        _apply_attention(model, state)
    if loss:
        _apply_loss(model, state)
    if norm:
        _apply_module_forwards(model, state, "norm", _norm_forward)
    if mlp:
        _apply_module_forwards(model, state, "mlp", _mlp_forward)
    if rotary:
        _apply_rotary(model, state)
    if cast_once:
        _apply_cast_once(model, state)
    return model


def revert(model: PreTrainedModel, attention: bool = True, loss: bool = True, norm: bool = True, mlp: bool = True,
           rotary: bool = True, cast_once: bool = True) -> PreTrainedModel:
    """Undo :func:`apply` (what is asked of it): the attention implementations the model and its sub-models had, the
    stock forwards, transformers' own rotary function. Returns the same model; a model never applied is returned
    unchanged."""
    state = model.__dict__.get(_STATE)
    if state is None:
        return model
    if attention:
        _revert_attention(state)
    if loss:
        _revert_loss(model, state)
    for what, asked in (("norm", norm), ("mlp", mlp)):
        if asked:
            _revert_module_forwards(state, what)
    if rotary:
        _revert_rotary(model, state)
    if cast_once:
        _revert_cast_once(state)
    if not state:
        del model.__dict__[_STATE]
    return model


def is_applied(model: PreTrainedModel) -> dict[str, bool]:
    """{"attention": ..., "loss": ..., "norm": ..., "mlp": ..., "rotary": ..., "cast_once": ...}: what :func:`apply`
    currently has in place on ``model`` (a layer kind counts as applied even where the model has no layer of that
    kind)."""
    state = model.__dict__.get(_STATE, {})
    return {part: part in state for part in _PARTS}


class AutoFusedModelForCausalLM:
    """transformers' ``AutoModelForCausalLM`` returning applied models:
    ``AutoFusedModelForCausalLM.from_pretrained("meta-llama/Llama-3.2-1B", dtype=torch.bfloat16)`` is
    ``apply(AutoModelForCausalLM.from_pretrained(...))``. Every argument is transformers'; the parts to fuse are
    the keyword-only ``attention``, ``loss``, ``norm``, ``mlp``, ``rotary`` and ``cast_once`` (all True by default),
    as for :func:`apply`."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, attention: bool = True, loss: bool = True,
                        norm: bool = True, mlp: bool = True, rotary: bool = True, cast_once: bool = True,
                        **kwargs) -> PreTrainedModel:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        return apply(model, attention=attention, loss=loss, norm=norm, mlp=mlp, rotary=rotary, cast_once=cast_once)

    @classmethod
    def from_config(cls, config, *, attention: bool = True, loss: bool = True, norm: bool = True, mlp: bool = True,
                    rotary: bool = True, cast_once: bool = True, **kwargs) -> PreTrainedModel:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config, **kwargs)
        return apply(model, attention=attention, loss=loss, norm=norm, mlp=mlp, rotary=rotary, cast_once=cast_once)
