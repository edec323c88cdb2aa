"""Fused attention in transformers families whose attention predates the ``AttentionInterface``.

These families compute softmax(Q K^T + mask) V in their own module code, so selecting an attention implementation
does not reach them. Where that code is one of the families below (compared as bytecode, so "Copied from" classes
qualify), the attention module gets an instance-level ``forward`` (or ``_attn``, the family's attention core) that
does what the stock code does up to the scores, then hands query, key, value and the family's mask to
:func:`fusedlayers.integrations.transformers.attention_forward` (whose mask reading, fallbacks and op are the same as
for every other model). What each family adds to the scores becomes part of the mask: ALiBi (BLOOM, MPT; Falcon's
model already folds it in), GPT-Neo's local band (its ``sliding_window``: a mask that is exactly causal within a
window runs without it). Masks derived once per model forward are reused by every layer (:func:`_derived`). The
families' code is mirrored from transformers 5.24 and checked equal in 5.17 but for the cache's name (``cache`` /
``past_key_values``), which the MPT and BART-era forwards take either way.

A model forward that asks for the attention weights (``output_attentions``) runs the stock code throughout: the
fused op has no weights to return.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import math
import sys
import weakref

import torch
from torch import nn

from fusedlayers.integrations import transformers as _flt

#: True inside a model forward that returns attention weights (the stock attention code then runs)
_weights_wanted: contextvars.ContextVar[bool] = contextvars.ContextVar("fusedlayers_weights_wanted", default=False)


def _stock(self, name: str, *args, **kwargs):
    return getattr(type(self), name)(self, *args, **kwargs)


def _dropout(self, p: float) -> float:
    return p if self.training else 0.0


def _module_global(self, name: str):
    """A function of the module's own modeling file, looked up per call (our rotary patch may have replaced it)."""
    return getattr(sys.modules[type(self).__module__], name)


# The masks derived from the ones a model forward builds (one per forward, shared by its layers): a hit needs the same
# source tensors (weak references), unmodified since (their _version), and the same extra key. An entry goes when a
# source is freed (the forward and its graph done): a derived mask (ALiBi's is B x H x L x S) is not kept past it.
_recent: list = [[]]
RECENT = 4


def _forget(entry) -> None:
    _recent[0] = [e for e in _recent[0] if e is not entry]


def _derived(sources: tuple, key, build):
    """``build()`` once per (sources, key) while the sources live: every layer then passes the same mask tensor, which
    ``attention_forward`` reads once."""
    if all(s is None for s in sources) or any(
            s is not None and (torch.compiler.is_compiling() or s.is_inference()) for s in sources):
        return build()
    state = tuple((weakref.ref(s), s._version) if s is not None else None for s in sources)
    recent = _recent[0]
    for refs, key_, mask in recent:
        if key_ == key and len(refs) == len(state) and all(
                (a is None and b is None) or (a is not None and b is not None and a[0]() is b[0]() and a[1] == b[1])
                for a, b in zip(refs, state, strict=True)):
            return mask
    mask = build()
    entry = (state, key, mask)
    _recent[0] = [entry, *recent[:RECENT - 1]]
    for source in sources:
        if source is not None:
            weakref.finalize(source, _forget, entry)
    return mask


def _keep_band(attention_mask, band):
    """The model's mask with only the keys ``band`` (bool, True = keep) keeps."""
    if attention_mask is None:
        return band
    if attention_mask.dtype == torch.bool:
        return attention_mask & band
    return attention_mask.masked_fill(~band, torch.finfo(attention_mask.dtype).min)


def _heads_first(out):
    """attention_forward's (B, L, H, D) output as the (B, H, L, D) the families' cores return."""
    return out.transpose(1, 2)


# --------------------------------------------------------------------------------------------------------------
# the families' cores


def _openai_attn(self, q, k, v, attention_mask=None, output_attentions=False):
    """OpenAI GPT: k arrives as (B, H, D, S); causal by the ``bias`` buffer (top-left), scores scaled only when
    ``scale``; the model's mask is additive (B, 1, 1, S)."""
    if output_attentions or _weights_wanted.get():
        return _stock(self, "_attn", q, k, v, attention_mask, output_attentions)
    key = k.transpose(-1, -2)
    L, S = q.shape[2], key.shape[2]
    mask, causal = None, True
    if attention_mask is not None:
        mask = _derived((attention_mask,), ("openai", L, S),
                        lambda: _keep_band(attention_mask.expand(-1, -1, L, -1), self.bias[:, :, :L, :S].bool()))
        causal = False
    out, _ = _flt.attention_forward(self, q, key, v, mask, dropout=_dropout(self, self.attn_dropout.p),
                                    scaling=v.shape[-1] ** -0.5 if self.scale else 1.0, is_causal=causal)
    return [_heads_first(out)]


def _gpt_neo_attn(self, query, key, value, attention_mask=None):
    """GPT-Neo: unscaled scores; causal (and, in its local layers, the last ``window_size`` keys) by the ``bias``
    buffer, bottom-right aligned; the model's mask on top."""
    if _weights_wanted.get():
        return _stock(self, "_attn", query, key, value, attention_mask)
    L, S = query.shape[2], key.shape[2]
    window = self.config.window_size if self.attention_type == "local" else None
    if attention_mask is None and window is None and L == S:
        mask, causal = None, True
    else:
        mask = _derived((attention_mask,), ("gpt_neo", window, L, S),
                        lambda: _keep_band(attention_mask, self.bias[:, :, S - L:S, :S]))
        causal = False
    out, _ = _flt.attention_forward(self, query, key, value, mask, dropout=_dropout(self, self.attn_dropout.p),
                                    scaling=1.0, is_causal=causal, sliding_window=window)
    return _heads_first(out), None


def _gpt_neox_japanese_attn(self, query, key, value, attention_mask=None):
    """GPT-NeoX-Japanese: scores / sqrt(head size), the model's (causal) mask added (none: no masking, as stock)."""
    if _weights_wanted.get():
        return _stock(self, "_attn", query, key, value, attention_mask)
    out, _ = _flt.attention_forward(self, query, key, value, attention_mask,
                                    dropout=_dropout(self, self.attention_dropout.p),
                                    scaling=1.0 / self.norm_factor, is_causal=False)
    return _heads_first(out), None


def _bloom_forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None, use_cache=False,
                   output_attentions=False, **kwargs):
    """BLOOM: scores beta * alibi + q k^T / sqrt(D) + mask; the ALiBi bias (one per head and key) joins the mask."""
    if output_attentions or _weights_wanted.get() or (self.pretraining_tp > 1 and self.slow_but_exact):
        return _stock(self, "forward", hidden_states, residual, alibi, attention_mask, layer_past, use_cache,
                      output_attentions, **kwargs)
    B, L, _ = hidden_states.shape
    query, key, value = self._reshape(self.query_key_value(hidden_states))
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    S = key.shape[2]

    def build():
        bias = alibi.view(B, self.num_heads, 1, S) * self.beta
        return bias if attention_mask is None else _flt._with_bias(attention_mask, bias)

    mask = _derived((alibi, attention_mask), ("bloom", self.beta, L), build)
    out, _ = _flt.attention_forward(self, query, key, value, mask, dropout=_dropout(self, self.attention_dropout.p),
                                    scaling=self.inv_norm_factor, is_causal=False)
    output = self.dense(out.reshape(B, L, self.hidden_size))
    return _module_global(self, "dropout_add")(output, residual, self.hidden_dropout, self.training), None


def _falcon_forward(self, hidden_states, alibi, attention_mask, position_ids=None, layer_past=None, use_cache=False,
                    output_attentions=False, position_embeddings=None, **kwargs):
    """Falcon, where its model runs SDPA: the same call (the model folded ALiBi into the mask) on our op."""
    if output_attentions or _weights_wanted.get() or self.config._attn_implementation != "sdpa":
        return _stock(self, "forward", hidden_states, alibi, attention_mask, position_ids, layer_past, use_cache,
                      output_attentions, position_embeddings, **kwargs)
    kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
    query, key, value = self._split_heads(self.query_key_value(hidden_states))
    B, L = query.shape[:2]
    query = query.transpose(1, 2).reshape(B, self.num_heads, L, self.head_dim)
    key = key.transpose(1, 2).reshape(B, kv_heads, L, self.head_dim)
    value = value.transpose(1, 2).reshape(B, kv_heads, L, self.head_dim)
    if alibi is None:
        cos, sin = position_embeddings
        query, key = _module_global(self, "apply_rotary_pos_emb")(query, key, cos, sin)
    if layer_past is not None:
        key, value = layer_past.update(key, value, self.layer_idx)
    dropout = 0.0 if alibi is None else _dropout(self, self.attention_dropout.p)  # as stock: none with rotary
    out, _ = _flt.attention_forward(self, query, key, value, attention_mask, dropout=dropout, is_causal=self.is_causal)
    return self.dense(out.reshape(B, L, self.num_heads * self.head_dim)), None


@functools.cache
def _passes_cache_kwargs(cls) -> bool:
    """transformers 5.2x's forwards take ``cache`` and pass their keyword arguments on to its update; earlier ones take
    ``past_key_values`` and do not."""
    return "cache" in inspect.signature(inspect.unwrap(cls.forward)).parameters


def _cache_update(self, cache, key, value, kwargs):
    """``cache.update`` as the family's stock code calls it."""
    if _passes_cache_kwargs(type(self)):
        return cache.update(key, value, self.layer_idx, kwargs=kwargs)
    return cache.update(key, value, self.layer_idx)


def _mpt_forward(self, hidden_states, position_bias, cache=None, attention_mask=None, **kwargs):
    """MPT: optional qkv clipping, scores * softmax_scale + ALiBi bias, then the model's mask (True = drop)."""
    if _weights_wanted.get():
        given = {"cache": cache} if cache is not None else {}
        return _stock(self, "forward", hidden_states, position_bias, attention_mask=attention_mask, **given, **kwargs)
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    B, L = hidden_states.shape[:2]
    qkv = self.Wqkv(hidden_states)
    if self.clip_qkv:
        qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
    query, key, value = (t.reshape(B, L, self.n_heads, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=2))
    if cache is not None:
        key, value = _cache_update(self, cache, key, value, kwargs)
    query_length = L if cache is None else L + cache.get_seq_length()  # stock's slicing of the bias, as it is
    S = key.shape[2]

    def build():
        bias = position_bias
        if bias is not None:
            if bias.dim() != 3:
                raise ValueError(f"Expecting position_bias shape to be 3 dimensions, got {bias.dim()}")
            bias = bias[:, max(0, bias.size(1) - query_length):, max(0, bias.size(2) - S):]
        keep = ~attention_mask if attention_mask is not None else None
        if bias is None:
            return keep
        return bias if keep is None else _flt._with_bias(keep, bias)

    mask = _derived((position_bias, attention_mask), ("mpt", query_length, S), build)
    out, _ = _flt.attention_forward(self, query, key, value, mask, dropout=_dropout(self, self.attn_dropout_p),
                                    scaling=self.softmax_scale, is_causal=False)
    return self.out_proj(out.reshape(B, L, -1)), None


def _keys_values(self, key_proj, value_proj, head_dim, hidden_states, cross_states, cache, kwargs):
    """Keys and values (B, H, S, D) of self-attention (``cross_states`` None) or cross-attention, through the cache
    as the BART- and BERT-era stock code goes through it: an EncoderDecoderCache's cross part filled once."""
    is_cross = cross_states is not None
    current, two_caches = cache, cache is not None and hasattr(cache, "is_updated")  # an EncoderDecoderCache
    if two_caches:
        current = cache.cross_attention_cache if is_cross else cache.self_attention_cache
    if is_cross and two_caches and cache.is_updated.get(self.layer_idx):
        return current.layers[self.layer_idx].keys, current.layers[self.layer_idx].values
    states = cross_states if is_cross else hidden_states
    B, S = states.shape[:2]
    key = key_proj(states).view(B, S, -1, head_dim).transpose(1, 2)
    value = value_proj(states).view(B, S, -1, head_dim).transpose(1, 2)
    if cache is not None:
        key, value = _cache_update(self, current, key, value, kwargs)
        if is_cross and two_caches:
            cache.is_updated[self.layer_idx] = True
    return key, value


def _bart_era_forward(self, hidden_states, key_value_states=None, cache=None, attention_mask=None, attn_prompt=None,
                      output_attentions=False, **kwargs):
    """The BART-era attention of XGLM, TrOCR and MVP: scaled query, the model's mask added; self- and
    cross-attention; MVP's prompt keys and values (``attn_prompt``) before the others, kept by the mask."""
    if output_attentions or _weights_wanted.get():
        given = {"cache": cache} if cache is not None else {}
        if attn_prompt is not None:
            given["attn_prompt"] = attn_prompt
        if output_attentions:
            given["output_attentions"] = output_attentions
        return _stock(self, "forward", hidden_states, key_value_states, attention_mask=attention_mask, **given,
                      **kwargs)
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    B, L, _ = hidden_states.shape
    query = (self.q_proj(hidden_states) * self.scaling).view(B, L, self.num_heads, self.head_dim).transpose(1, 2)
    key, value = _keys_values(self, self.k_proj, self.v_proj, self.head_dim, hidden_states, key_value_states, cache,
                              kwargs)
    if attn_prompt is not None:
        key = torch.cat([attn_prompt[0].expand(B, -1, -1, -1), key], dim=2)
        value = torch.cat([attn_prompt[1].expand(B, -1, -1, -1), value], dim=2)
        if attention_mask is not None:
            prompt_mask = torch.zeros(B, 1, L, attn_prompt[0].size(1)).to(attention_mask.device)
            attention_mask = torch.cat([prompt_mask, attention_mask], dim=-1)
    if attention_mask is not None and attention_mask.shape != (B, 1, L, key.shape[2]):
        raise ValueError(f"Attention mask should be of size {(B, 1, L, key.shape[2])}, but is "
                         f"{tuple(attention_mask.shape)}")
    out, _ = _flt.attention_forward(self, query, key, value, attention_mask, dropout=_dropout(self, self.dropout),
                                    scaling=1.0, is_causal=False)
    return self.out_proj(out.reshape(B, L, -1)), None


def _bert_era_forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None, cache=None,
                      output_attentions=False, **kwargs):
    """The BERT-era self-attention of RemBERT and Megatron-BERT (as decoders): scores / sqrt(head size), the model's
    mask added; self- and cross-attention. Returns the heads merged, before the output projection (as stock)."""
    if output_attentions or _weights_wanted.get():
        given = {"cache": cache} if cache is not None else {}
        return _stock(self, "forward", hidden_states, attention_mask, encoder_hidden_states,
                      output_attentions=output_attentions, **given, **kwargs)
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    B, L, _ = hidden_states.shape
    d = self.attention_head_size
    query = self.query(hidden_states).view(B, L, -1, d).transpose(1, 2)
    key, value = _keys_values(self, self.key, self.value, d, hidden_states, encoder_hidden_states, cache, kwargs)
    out, _ = _flt.attention_forward(self, query, key, value, attention_mask, dropout=_dropout(self, self.dropout.p),
                                    scaling=1.0 / math.sqrt(d), is_causal=False)
    return out.reshape(B, L, self.all_head_size), None


def _roformer_forward(self, hidden_states, attention_mask=None, sinusoidal_pos=None, encoder_hidden_states=None,
                      cache=None, output_attentions=False, **kwargs):
    """RoFormer's self-attention: the BERT-era attention with its sinusoidal rotary embedding (the stock function) on
    query and key, and value with ``rotary_value``, before the cache; its cross-attention has none (BERT's)."""
    if output_attentions or _weights_wanted.get():
        given = {"cache": cache} if cache is not None else {}
        return _stock(self, "forward", hidden_states, attention_mask, sinusoidal_pos, encoder_hidden_states,
                      output_attentions=output_attentions, **given, **kwargs)
    if encoder_hidden_states is not None or sinusoidal_pos is None:
        return _bert_era_forward(self, hidden_states, attention_mask, encoder_hidden_states, cache, **kwargs)
    cache = cache if cache is not None else kwargs.pop("past_key_values", None)
    B, L, _ = hidden_states.shape
    d = self.attention_head_size
    query, key, value = (proj(hidden_states).view(B, L, -1, d).transpose(1, 2)
                         for proj in (self.query, self.key, self.value))
    if self.rotary_value:
        query, key, value = self.apply_rotary_position_embeddings(sinusoidal_pos, query, key, value)
    else:
        query, key = self.apply_rotary_position_embeddings(sinusoidal_pos, query, key)
    if cache is not None:
        current = cache.self_attention_cache if hasattr(cache, "is_updated") else cache
        key, value = _cache_update(self, current, key, value, kwargs)
    out, _ = _flt.attention_forward(self, query, key, value, attention_mask, dropout=_dropout(self, self.dropout.p),
                                    scaling=1.0 / math.sqrt(d), is_causal=False)
    return out.reshape(B, L, self.all_head_size), None


#: (modeling module, class, attribute replaced) -> our function
FAMILIES = {
    ("transformers.models.openai.modeling_openai", "Attention", "_attn"): _openai_attn,
    ("transformers.models.gpt_neo.modeling_gpt_neo", "GPTNeoSelfAttention", "_attn"): _gpt_neo_attn,
    ("transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese", "GPTNeoXJapaneseAttention", "_attn"):
        _gpt_neox_japanese_attn,
    ("transformers.models.bloom.modeling_bloom", "BloomAttention", "forward"): _bloom_forward,
    ("transformers.models.falcon.modeling_falcon", "FalconAttention", "forward"): _falcon_forward,
    ("transformers.models.mpt.modeling_mpt", "MptAttention", "forward"): _mpt_forward,
    ("transformers.models.xglm.modeling_xglm", "XGLMAttention", "forward"): _bart_era_forward,
    ("transformers.models.trocr.modeling_trocr", "TrOCRAttention", "forward"): _bart_era_forward,
    ("transformers.models.mvp.modeling_mvp", "MvpAttention", "forward"): _bart_era_forward,
    ("transformers.models.rembert.modeling_rembert", "RemBertSelfAttention", "forward"): _bert_era_forward,
    ("transformers.models.megatron_bert.modeling_megatron_bert", "MegatronBertSelfAttention", "forward"):
        _bert_era_forward,
    ("transformers.models.roformer.modeling_roformer", "RoFormerSelfAttention", "forward"): _roformer_forward,
}


def _code(fn):
    return inspect.unwrap(fn) if fn is not None else None


def _family(module: nn.Module):
    """(attribute, our function) if ``module``'s attention code is one of FAMILIES' (its modeling file imported)."""
    for (module_name, class_name, attribute), ours in FAMILIES.items():
        reference = getattr(sys.modules.get(module_name), class_name, None)
        if reference is None:
            continue
        mine = _code(getattr(type(module), attribute, None))
        if mine is not None and _flt._same_code(mine, _code(getattr(reference, attribute))):
            return attribute, ours
    return None


def _enter(model, args, kwargs):
    wanted = kwargs.get("output_attentions")
    if wanted is None:
        wanted = getattr(model.config, "output_attentions", False)
    wanted = bool(wanted) or _weights_wanted.get()  # an enclosing forward's wish holds for the models it calls
    model.__dict__.setdefault("_fusedlayers_weights_tokens", []).append(_weights_wanted.set(wanted))


def _leave(model, args, kwargs, output):
    _weights_wanted.reset(model.__dict__["_fusedlayers_weights_tokens"].pop())


def apply(model: nn.Module) -> tuple[list, list]:
    """Swap the attention code of every module of a family above: (the (module, attribute) swapped, the hooks that
    tell them when a forward wants the weights); nothing swapped where no family matched."""
    swapped = []
    for module in model.modules():
        found = _family(module)
        if found is not None and found[0] not in module.__dict__:
            setattr(module, found[0], _flt._WeakForward(found[1], module))
            swapped.append((module, found[0]))
    hooks = []
    if swapped:
        for sub in model.modules():
            if isinstance(sub, _flt.PreTrainedModel):
                hooks += [sub.register_forward_pre_hook(_enter, with_kwargs=True),
                          sub.register_forward_hook(_leave, with_kwargs=True, always_call=True)]
    return swapped, hooks


def revert(swapped, hooks) -> None:
    for hook in hooks:
        hook.remove()
    for module, attribute in swapped:
        module.__dict__.pop(attribute, None)
