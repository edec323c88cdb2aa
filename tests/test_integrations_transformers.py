"""fusedlayers.integrations.transformers: fused attention and the fused causal-LM loss inside Hugging Face models.

Tiny models built from configs (no download). The applied model's loss and every parameter's gradient are
compared with an untouched deep copy (stock SDPA attention, or eager where the architecture has no SDPA), under
tests/parity.py's rule against a float64 reference (the float64 copy's logits through F.cross_entropy in
float64: stock's own loss rounds the logits to fp32), or tightly in float64.
"""

from __future__ import annotations

import copy
import gc
import itertools
import os
import pickle
import subprocess
import sys
import weakref

import pytest
import torch
import torch.nn.functional as F

from tests.parity import FLOOR, assert_parity, float64_hf_norms

try:
    import transformers
except ImportError:  # the optional extra is not installed
    transformers = None

needs_transformers = pytest.mark.skipif(
    transformers is None, reason='needs transformers (pip install -e ".[dev]" or "fusedlayers[transformers]")'
)
HAS_CUDA = torch.cuda.is_available()

if transformers is not None:
    from fusedlayers.integrations import transformers as flt

B, T, V = 3, 12, 128
COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              vocab_size=V, max_position_embeddings=64)


def _tiny(arch: str, attn: str | None = None, **overrides):
    """(a tiny randomly initialised model, its stock attention implementation)."""
    t = transformers
    if arch == "llama":
        cls, config = t.LlamaForCausalLM, t.LlamaConfig(**COMMON)
    elif arch == "qwen2":  # layer 1 uses a sliding window of 4 (shorter than the sequence)
        cls, config = t.Qwen2ForCausalLM, t.Qwen2Config(**COMMON, use_sliding_window=True, sliding_window=4,
                                                         max_window_layers=1)
    elif arch == "mistral":
        cls, config = t.MistralForCausalLM, t.MistralConfig(**COMMON, sliding_window=4)
    elif arch == "gemma":
        cls, config = t.GemmaForCausalLM, t.GemmaConfig(**COMMON, head_dim=16)
    elif arch == "gemma2":  # soft-capping of attention logits and final logits by default
        cls, config = t.Gemma2ForCausalLM, t.Gemma2Config(**COMMON, head_dim=16, sliding_window=4)
    elif arch == "gpt2":
        cls, config = t.GPT2LMHeadModel, t.GPT2Config(n_embd=64, n_layer=2, n_head=4, n_positions=64, vocab_size=V,
                                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    elif arch == "phi":  # lm_head has a bias
        cls, config = t.PhiForCausalLM, t.PhiConfig(**COMMON)
    elif arch == "cohere":  # scales the logits after lm_head
        cls, config = t.CohereForCausalLM, t.CohereConfig(**COMMON)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    stock = attn or ("eager" if arch == "gemma2" else "sdpa")
    config._attn_implementation = stock
    torch.manual_seed(0)
    return cls(config), stock


def _batch(padding: str = "none", device="cpu", seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    for row, n in enumerate((0, 3, 5)):
        if n and padding == "left":
            mask[row, :n] = 0
        elif n and padding == "right":
            mask[row, T - n:] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 2] = -100
    batch = {"input_ids": ids, "labels": labels}
    if padding != "none":
        batch["attention_mask"] = mask
    return {k: v.to(device) for k, v in batch.items()}


def _reference_loss(model, batch, num_items_in_batch=None):
    """ForCausalLMLoss from the model's logits, in their dtype (stock upcasts to fp32 first)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits
    labels = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    reduction = "mean" if num_items_in_batch is None else "sum"
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100,
                           reduction=reduction)
    return loss if num_items_in_batch is None else loss / num_items_in_batch


def _float64_reference(model):
    """A float64 copy of ``model`` whose RMSNorms compute in float64 too (tests/parity.py)."""
    return float64_hf_norms(copy.deepcopy(model).double())


def _grads(model):
    return {name: p.grad for name, p in model.named_parameters()}


@pytest.fixture
def counters(monkeypatch):
    """Calls of fl.scaled_dot_product_attention / fl.linear_cross_entropy, and the integration's fallbacks."""
    import fusedlayers.functional as flf

    calls = {"attention": [], "loss": 0, "rms_norm": 0, "layer_norm": 0, "swiglu": 0, "geglu": 0,
             "rotary_embedding": 0}
    attention, loss = flf.scaled_dot_product_attention, flf.linear_cross_entropy
    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name in ("rms_norm", "layer_norm", "swiglu", "geglu", "rotary_embedding"):
        monkeypatch.setattr(flf, name, counted(name, getattr(flf, name)))

    def counted_attention(*args, **kwargs):
        calls["attention"].append(kwargs)
        return attention(*args, **kwargs)

    def counted_loss(*args, **kwargs):
        calls["loss"] += 1
        return loss(*args, **kwargs)

    monkeypatch.setattr(flf, "scaled_dot_product_attention", counted_attention)
    monkeypatch.setattr(flf, "linear_cross_entropy", counted_loss)
    flt.fallbacks.clear()
    yield calls
    flt.fallbacks.clear()
    for name, (stock_rotary, _) in list(flt._rotary_patches.items()):  # models the test left applied
        sys.modules[name].apply_rotary_pos_emb = stock_rotary
        del flt._rotary_patches[name]


def _head_outputs(model):
    """Record the shapes lm_head's forward hooks see."""
    shapes = []
    model.get_output_embeddings().register_forward_hook(lambda mod, args, out: shapes.append(tuple(out.shape)))
    return shapes


def _check_parity(arch, padding, counters, dtype=torch.float32, **overrides):
    model, _ = _tiny(arch, **overrides)
    model = model.to(dtype)
    stock = copy.deepcopy(model)
    reference = _float64_reference(model)
    assert flt.apply(model) is model
    model.train()
    stock.train()
    reference.train()
    batch = _batch(padding)
    head_shapes = _head_outputs(model)

    out = model(**batch)
    assert out.logits is None  # never materialised
    assert head_shapes == [(B, T, 0)]  # lm_head was short-circuited: a zero-width placeholder only
    assert counters["loss"] == 1
    out.loss.backward()
    stock_loss = stock(**batch).loss
    stock_loss.backward()
    ref_loss = _reference_loss(reference, batch)
    ref_loss.backward()
    return model, stock, reference, out.loss, stock_loss, ref_loss


ARCHS = ["llama", "qwen2", "mistral", "gemma", "gpt2", "phi"]
LLAMA_LAYERS = dict(rms_norm=(2, 1), swiglu=(1, 0), rotary_embedding=(1, 0))
LAYERS = {  # arch -> {fused op: (calls per layer, other calls)} in one forward after apply
    "llama": LLAMA_LAYERS, "qwen2": LLAMA_LAYERS, "mistral": LLAMA_LAYERS,
    "gemma": dict(rms_norm=(2, 1), geglu=(1, 0), rotary_embedding=(1, 0)),  # (1 + weight) RMSNorm; a GELU gate
    "gpt2": dict(layer_norm=(2, 1)),
    "phi": dict(layer_norm=(1, 1), rotary_embedding=(1, 0)),  # parallel block, partial rotary; a GELU MLP
}


def test_import_fusedlayers_imports_no_framework():
    code = ("import sys, fusedlayers, fusedlayers.integrations; "
            "bad = [m for m in ('transformers', 'lightning', 'pytorch_lightning', 'hydra') if m in sys.modules]; "
            "assert not bad, bad")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)


@needs_transformers
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("arch", ARCHS)
def test_loss_and_grads_match_stock(arch, padding, counters):
    model, stock, reference, loss, stock_loss, ref_loss = _check_parity(arch, padding, counters)
    layers = model.config.num_hidden_layers
    assert len(counters["attention"]) == layers  # every layer ran our attention
    assert not flt.fallbacks, dict(flt.fallbacks)
    swapped = {name: n for name, n in counters.items() if name not in ("attention", "loss") and n}
    assert swapped == {name: n * layers + extra for name, (n, extra) in LAYERS[arch].items()}
    if padding == "none" and arch in ("llama", "gemma", "gpt2"):  # no mask: causal through is_causal
        assert all(c["is_causal"] and c["attn_mask"] is None for c in counters["attention"])
    assert loss.dtype == stock_loss.dtype == torch.float32
    assert (model.get_output_embeddings().bias is not None) == (arch == "phi")
    assert_parity(loss.detach(), stock_loss.detach(), ref_loss.detach(), "loss")
    fused, stock_grads, ref = _grads(model), _grads(stock), _grads(reference)
    assert fused.keys() == stock_grads.keys()
    for name in fused:
        assert_parity(fused[name], stock_grads[name], ref[name], name)


@needs_transformers
@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "gemma", "gpt2", "phi"])
def test_float64_tight(arch, padding, counters):
    model, _ = _tiny(arch)
    model = model.double()
    reference = _float64_reference(model)
    flt.apply(model)
    batch = _batch(padding)
    loss = model(**batch).loss
    loss.backward()
    ref_loss = _reference_loss(reference, batch)
    ref_loss.backward()
    assert loss.dtype == torch.float64
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, _grads(reference)[name], rtol=1e-9, atol=1e-12, msg=name)
    assert len(counters["attention"]) == model.config.num_hidden_layers and not flt.fallbacks


@needs_transformers
@pytest.mark.parametrize("padding", ["none", "left"])
def test_sliding_window_is_applied(padding, counters):
    """Mistral's window of 4 (< 12 tokens) changes the result, and our attention follows it: without padding as the
    op's window (the mask transformers built is exactly the causal window: not passed, blocks outside skipped), with
    padding through the mask."""
    windowed, _ = _tiny("mistral")
    full = copy.deepcopy(windowed)
    full.config.sliding_window = None
    windowed = copy.deepcopy(windowed).double()
    reference = _float64_reference(windowed)
    flt.apply(windowed)
    batch = _batch(padding)
    loss = windowed(**batch).loss
    for c in counters["attention"]:
        if padding == "none":
            assert c["attn_mask"] is None and c["is_causal"] and c["window_size"] == (3, 0)
        else:
            assert c["attn_mask"] is not None and c["window_size"] == (-1, -1)
    torch.testing.assert_close(loss, _reference_loss(reference, batch), rtol=1e-12, atol=1e-12)
    assert abs(loss.item() - full.double()(**batch).loss.item()) > 1e-4


def _documents_mask(lengths, w=None):
    """The (L, L) bool mask transformers builds for packed documents of these lengths (and a sliding window w)."""
    L = sum(lengths)
    doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    i = torch.arange(L)
    keep = (doc[:, None] == doc[None, :]) & (i[None, :] <= i[:, None])
    return keep & (i[None, :] > i[:, None] - w) if w else keep


@needs_transformers
def test_mask_structure_is_read_once_per_mask_and_never_stale(monkeypatch):
    """_mask_structure: documents (cu_seqlens over the flattened rows) and the sliding window of an exact causal
    documents-and-window mask (any batch and head broadcast), None for any other mask; the answer is reused for the
    same unmodified tensor only (an in-place change, or a new tensor at the same address, is read again)."""
    L, w = 10, 4
    q = torch.empty(2, 4, L, 8)
    kw = {"sliding_window": w}
    window = _documents_mask([L], w)
    mask = window.expand(2, 1, L, L).clone()
    assert flt._mask_structure(mask, q, q, kw) == (w, None, None)  # one document a row: the window alone
    assert flt._mask_structure(window.expand(2, 4, L, L), q, q, kw) == (w, None, None)  # a broadcast view
    assert flt._mask_structure(mask, q, q, {"sliding_window": w + 1}) is None  # another window
    assert flt._mask_structure(_documents_mask([L]).expand(2, 1, L, L), q, q, {}) == (None, None, None)  # causal
    assert flt._mask_structure(mask, q, q, {}) is None and flt._mask_structure(None, q, q, kw) is None
    assert flt._mask_structure(mask.float(), q, q, kw) is None  # an additive mask stays a mask
    assert flt._mask_structure(mask, q, q[:, :, :L - 1], kw) is None  # keys other than the queries (a cache)
    mask[1, 0, 5, 4] = False  # row 5 of batch 1 loses a key, in place
    assert flt._mask_structure(mask, q, q, kw) is None
    mask[1, 0, 5, 4] = True
    assert flt._mask_structure(mask, q, q, kw) == (w, None, None)
    del mask
    padded = window.expand(2, 1, L, L).clone()
    padded[0, 0, :, 0] = False  # a new tensor (maybe at the freed one's address), left-padded
    assert flt._mask_structure(padded, q, q, kw) is None
    packed = torch.stack((_documents_mask([3, 1, 6]), _documents_mask([10])))[:, None]  # two rows, 3 + 1 documents
    cu = torch.tensor([0, 3, 4, 10, 20], dtype=torch.int32)
    for window_ in (None, 2):
        packed_w = packed & _documents_mask([L], window_) if window_ else packed
        got = flt._mask_structure(packed_w, q, q, {"sliding_window": window_})
        assert got[0] == window_ and torch.equal(got[1], cu) and got[2] == 10
    got = flt._mask_structure(_documents_mask([4, 6])[None, None], q, q, {})  # one mask for both rows
    assert torch.equal(got[1], torch.tensor([0, 4, 10, 14, 20], dtype=torch.int32)) and got[2] == 6
    with torch.inference_mode():
        assert flt._mask_structure(window.expand(2, 1, L, L).clone(), q, q, kw) is None  # no version counter
    monkeypatch.setattr(flt, "MASK_BLOCK_ELEMENTS", 3 * 2 * L)  # read in blocks of 3 query rows: the same answers
    assert flt._mask_structure(packed.clone(), q, q, {})[2] == 10
    assert flt._mask_structure(window.expand(2, 1, L, L).clone(), q, q, kw) == (w, None, None)
    bad = window.expand(2, 1, L, L).clone()
    bad[0, 0, L - 1, L - 2] = False  # in the last block only
    assert flt._mask_structure(bad, q, q, kw) is None
    # two masks alternating (Gemma 2's sliding and full layers): each is read once
    reads = []
    read = flt._read_mask_structure
    monkeypatch.setattr(flt, "_read_mask_structure", lambda *a: (reads.append(1), read(*a))[1])
    sliding, full = window.expand(2, 1, L, L).clone(), _documents_mask([L]).expand(2, 1, L, L).clone()
    for _ in range(3):
        assert flt._mask_structure(sliding, q, q, kw) == (w, None, None)
        assert flt._mask_structure(full, q, q, {}) == (None, None, None)
    assert len(reads) == 2


PACKED_POSITIONS = torch.tensor([[0, 1, 2, 0, 1, 2, 3, 4, 5, 6, 0, 1], list(range(7)) + list(range(5))])


def _packed_run(arch, dtype, monkeypatch, **overrides):
    """(varlen calls, the fused model and its loss, the stock model's loss, the float64 reference's loss), after
    backward, for two rows of packed documents (position_ids restarting, no attention mask; no cache, as training)."""
    import fusedlayers.functional as flf

    calls = []
    varlen = flf.varlen_attention
    monkeypatch.setattr(flf, "varlen_attention", lambda *a, **k: (calls.append(k), varlen(*a, **k))[1])
    model, _ = _tiny(arch, **overrides)
    model = model.to(dtype)
    stock, reference = copy.deepcopy(model), _float64_reference(model)
    flt.apply(model)
    ids = torch.randint(0, V, (2, T), generator=torch.Generator().manual_seed(3))
    batch = {"input_ids": ids, "position_ids": PACKED_POSITIONS, "labels": ids, "use_cache": False}
    losses = [model(**batch).loss, _reference_loss(stock, batch), _reference_loss(reference, batch)]
    for loss in losses:
        loss.backward()
    return calls, model, stock, reference, losses


@needs_transformers
@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2"])
def test_packed_sequences_run_varlen(arch, counters, monkeypatch):
    """Padding-free packing: transformers builds a block-diagonal causal mask (with the layer's window: Mistral's
    every layer, Qwen2's second); ours runs fl.varlen_attention on the flattened rows instead, each layer, and the loss
    and every gradient match the float64 stock model."""
    calls, model, _, reference, (loss, _, ref_loss) = _packed_run(arch, torch.float64, monkeypatch)
    assert len(calls) == model.config.num_hidden_layers and not counters["attention"]
    windows = {"llama": [(-1, -1)] * 2, "mistral": [(3, 0)] * 2, "qwen2": [(-1, -1), (3, 0)]}[arch]
    assert [c["window_size"] for c in calls] == windows and all(c["is_causal"] for c in calls)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=1e-12)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, _grads(reference)[name], rtol=1e-9, atol=1e-12, msg=name)


@needs_transformers
def test_packed_gemma2_soft_capped_windows(counters, monkeypatch):
    """Gemma 2 packed: sliding and full layers, the attention soft-cap (0.01: the tiny model's scores are ~0.01),
    through fl.varlen_attention; the parity rule against the stock eager model and the float64 one."""
    calls, model, stock, reference, losses = _packed_run("gemma2", torch.float32, monkeypatch,
                                                         final_logit_softcapping=None, attn_logit_softcapping=0.01)
    assert [(c["window_size"], c["softcap"]) for c in calls] == [((3, 0), 0.01), ((-1, -1), 0.01)]
    assert not counters["attention"] and not flt.fallbacks
    assert_parity(*(loss.detach() for loss in losses), "loss")
    for name, grad in _grads(model).items():
        assert_parity(grad, _grads(stock)[name], _grads(reference)[name], name)


@needs_transformers
@pytest.mark.parametrize("padding", ["none", "left", "right"])
@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma2"])
def test_logits_without_labels_match_stock(arch, padding, counters):
    model, _ = _tiny(arch, attn_logit_softcapping=None) if arch == "gemma2" else _tiny(arch)
    stock = copy.deepcopy(model)
    reference = _float64_reference(model)
    flt.apply(model)
    inputs = {k: v for k, v in _batch(padding).items() if k != "labels"}
    logits = model(**inputs).logits
    assert logits.shape == (B, T, V)
    assert len(counters["attention"]) == model.config.num_hidden_layers and counters["loss"] == 0
    stock_logits, ref_logits = stock(**inputs).logits, reference(**inputs).logits
    assert_parity(logits.detach(), stock_logits.detach(), ref_logits.detach(), "logits")


@needs_transformers
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generate_matches_stock(arch, counters):
    """Greedy generation with a KV cache (decode steps: one query against the cache, GQA) and left padding."""
    model, _ = _tiny(arch)
    model = model.double().eval()
    stock = copy.deepcopy(model)
    flt.apply(model)
    batch = _batch("left")
    kwargs = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
    out = model.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    assert torch.equal(out, stock.generate(batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs))
    assert len(counters["attention"]) == 4 * model.config.num_hidden_layers and not flt.fallbacks


@needs_transformers
def test_num_items_in_batch_shift_labels_and_ignore_index(counters):
    model, _ = _tiny("llama")
    model = model.double()
    stock = _float64_reference(model)
    flt.apply(model)
    batch = _batch("right")
    n = torch.tensor(17)
    loss = model(**batch, num_items_in_batch=n).loss
    torch.testing.assert_close(loss, _reference_loss(stock, batch, num_items_in_batch=17), rtol=1e-12, atol=0)
    assert loss.dtype == torch.float64
    # pre-shifted labels (as context-parallel training passes them) and another ignore_index
    shift = F.pad(batch["labels"], (0, 1), value=-100)[..., 1:]
    shift = shift.masked_fill(shift == -100, 7)
    got = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                shift_labels=shift, ignore_index=7).loss
    want = stock(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], labels=batch["labels"],
                 shift_labels=shift, ignore_index=7).loss
    torch.testing.assert_close(got.float(), want, rtol=1e-6, atol=1e-6)
    assert counters["loss"] == 2


@needs_transformers
def test_return_dict_positional_labels_logits_to_keep_and_return_logits(counters):
    model, _ = _tiny("llama")
    model = model.double()
    stock = _float64_reference(model)
    flt.apply(model)
    batch = _batch("left")
    ids, mask, labels = batch["input_ids"], batch["attention_mask"], batch["labels"]
    # labels positional (input_ids, attention_mask, position_ids, cache, inputs_embeds, labels)
    out = model(ids, mask, None, None, None, labels, return_dict=False)
    assert isinstance(out, tuple) and out[0].dim() == 0  # (loss, cache, ...) with no logits
    torch.testing.assert_close(out[0], _reference_loss(stock, batch), rtol=1e-12, atol=1e-12)
    with_logits = model(**batch, return_logits=True)
    torch.testing.assert_close(with_logits.logits, stock(ids, attention_mask=mask).logits, rtol=1e-12, atol=1e-12)
    # logits_to_keep with labels needs labels for the kept positions only, as stock
    kept = model(ids, attention_mask=mask, labels=labels[:, -4:], logits_to_keep=4).loss
    want = stock(ids, attention_mask=mask, labels=labels[:, -4:], logits_to_keep=4).loss
    torch.testing.assert_close(kept.float(), want, rtol=1e-6, atol=1e-6)


@needs_transformers
@pytest.mark.parametrize("padding", ["none", "right"])
def test_gemma2_softcap_is_fused(padding, counters):
    """Gemma 2 soft-caps attention logits: our attention applies the cap (loss and every gradient against the float64
    eager model). The cap is 0.01 here: the tiny model's scaled scores are ~0.01, and Gemma's 50 would change nothing
    a test could see."""
    model, stock, reference, loss, stock_loss, ref_loss = _check_parity(
        "gemma2", padding, counters, final_logit_softcapping=None, attn_logit_softcapping=0.01)
    layers = model.config.num_hidden_layers
    assert [c["softcap"] for c in counters["attention"]] == [0.01] * layers and not flt.fallbacks
    assert_parity(loss.detach(), stock_loss.detach(), ref_loss.detach(), "loss")
    for name, grad in _grads(model).items():
        assert_parity(grad, _grads(stock)[name], _grads(reference)[name], name)
    # the cap matters: the same weights (same seed) without it give query-projection gradients far outside the
    # parity bound above (unpadded: float64 eager Gemma 2 gives NaN on fully masked padded rows without the cap)
    name = "model.layers.0.self_attn.q_proj.weight"
    grads = []
    for cap in (0.01, None):
        ref = _float64_reference(_tiny("gemma2", final_logit_softcapping=None, attn_logit_softcapping=cap)[0])
        _reference_loss(ref, _batch("none")).backward()
        grads.append(_grads(ref)[name])
    assert (grads[0] - grads[1]).abs().max() > 0.1 * grads[0].abs().max()


@needs_transformers
def test_gemma2_final_logit_softcap_is_fused(counters):
    """Gemma 2's defaults: attention soft-capped and the final logits soft-capped (fl.linear_cross_entropy's
    ``softcap``), both ours, from the first call (the config announces the cap)."""
    model, stock, reference, loss, stock_loss, ref_loss = _check_parity("gemma2", "left", counters,
                                                                        final_logit_softcapping=2.0)
    assert len(counters["attention"]) == model.config.num_hidden_layers and not flt.fallbacks
    assert_parity(loss.detach(), stock_loss.detach(), ref_loss.detach(), "loss")
    for name, grad in _grads(model).items():
        assert_parity(grad, _grads(stock)[name], _grads(reference)[name], name)


@needs_transformers
def test_softcap_whose_steps_round_is_not_a_new_transform(counters):
    """Gemma 2's x / cap * cap is 1 only up to a rounding for caps such as 49: still the config's transform, fused
    from the first call with no fallback."""
    assert (1 / 49) * 49 != 1.0
    model, _ = _tiny("gemma2", final_logit_softcapping=49.0)
    stock = copy.deepcopy(model)
    flt.apply(model)
    batch = _batch("left")
    torch.testing.assert_close(model(**batch).loss, stock(**batch).loss)
    assert not flt.fallbacks and counters["loss"] == 1


@needs_transformers
def test_gemma2_without_softcap_is_fused(counters):
    model, stock, reference, loss, stock_loss, ref_loss = _check_parity(
        "gemma2", "left", counters, attn_logit_softcapping=None, final_logit_softcapping=None)
    assert len(counters["attention"]) == model.config.num_hidden_layers and not flt.fallbacks
    assert_parity(loss.detach(), stock_loss.detach(), ref_loss.detach(), "loss")
    for name, grad in _grads(model).items():
        assert_parity(grad, _grads(stock)[name], _grads(reference)[name], name)


@needs_transformers
def test_odd_head_dim_runs_our_attention(counters):
    model, _ = _tiny("llama", hidden_size=48, head_dim=12)  # head dim 12: not a multiple of 8, still ours
    model = model.double()
    stock = _float64_reference(model)
    flt.apply(model)
    batch = _batch("left")
    loss = model(**batch).loss
    assert flt.fallbacks == {} and len(counters["attention"]) == model.config.num_hidden_layers
    assert counters["loss"] == 1
    torch.testing.assert_close(loss, _reference_loss(stock, batch), rtol=1e-12, atol=1e-12)


@needs_transformers
def test_attention_function_fallbacks_and_arguments(counters):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model, _ = _tiny("mistral")
    module = model.model.layers[0].self_attn
    q, k, v = (torch.randn(2, h, 12, 16, dtype=torch.float64) for h in (4, 2, 2))
    # a window the absent mask does not encode: stock SDPA's result (it ignores the window too)
    out, weights = flt.attention_forward(module, q, k, v, None, scaling=0.25, sliding_window=4)
    assert weights is None and flt.fallbacks == {"sliding_window": 1} and counters["attention"] == []
    torch.testing.assert_close(out, sdpa_attention_forward(module, q, k, v, None, scaling=0.25, sliding_window=4)[0])
    # supported: GQA without copies, a bool mask broadcast over heads, dropout passed through, (B, L, H, D) out
    mask = torch.rand(2, 1, 12, 12) > 0.3
    out, _ = flt.attention_forward(module, q, k, v, mask, dropout=0.0, scaling=0.25)
    call = counters["attention"][-1]
    assert call["enable_gqa"] and not call["is_causal"] and call["attn_mask"] is mask and call["scale"] == 0.25
    assert out.shape == (2, 12, 4, 16) and out.is_contiguous()
    torch.testing.assert_close(out, sdpa_attention_forward(module, q, k, v, mask, scaling=0.25)[0])
    # a longer (static) cache than the queries with no mask: keys cut to the queries, as stock
    k2, v2 = torch.cat([k, torch.randn_like(k)], 2), torch.cat([v, torch.randn_like(v)], 2)
    out, _ = flt.attention_forward(module, q, k2, v2, None)
    torch.testing.assert_close(out, sdpa_attention_forward(module, q, k2, v2, None)[0])
    # attention sinks, one per query head (gpt-oss's s_aux): ours; of another shape: the model's eager function
    sinks = torch.randn(4, dtype=torch.float64)
    out, _ = flt.attention_forward(module, q, k, v, mask, scaling=0.25, s_aux=sinks)
    assert counters["attention"][-1]["sinks"] is sinks and not flt.fallbacks.get("sinks")
    scores = torch.cat([(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25).masked_fill(~mask, float("-inf")),
                        sinks.view(1, 4, 1, 1).expand(2, 4, 12, 1)], -1)
    stock = (scores.softmax(-1)[..., :-1] @ v.repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(out, stock, rtol=1e-12, atol=1e-12)
    with pytest.raises(NotImplementedError, match="eager"):
        flt.attention_forward(torch.nn.Module(), q, k, v, None, s_aux=torch.zeros(2))
    assert flt.fallbacks["sinks"] == 1
    # one sink a query row (Inkling 2's (B, H, L, 1)) and a learned position bias (Inkling's), with their gradients
    row_sinks = torch.randn(2, 4, 12, 1, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(2, 4, 12, 12, dtype=torch.float64, requires_grad=True)
    out, _ = flt.attention_forward(module, q, k, v, mask, scaling=0.25, sinks=row_sinks, position_bias=bias)
    scores = (q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.25 + bias).masked_fill(~mask, float("-inf"))
    probs = torch.cat([scores, row_sinks], -1).softmax(-1)[..., :-1]
    stock = (probs @ v.repeat_interleave(2, 1)).transpose(1, 2)
    torch.testing.assert_close(out, stock, rtol=1e-12, atol=1e-12)
    grads = torch.autograd.grad(out.square().sum(), (row_sinks, bias))
    for got, want in zip(grads, torch.autograd.grad(stock.square().sum(), (row_sinks, bias)), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    assert not flt.fallbacks.get("position_bias")


@needs_transformers
def test_dropout_in_training_only(counters):
    model, _ = _tiny("llama", attention_dropout=0.5)
    flt.apply(model)
    batch = _batch("left")
    model.train()
    model(**batch).loss.backward()
    assert [c["dropout_p"] for c in counters["attention"]] == [0.5, 0.5]
    model.eval()
    model(**batch)
    assert [c["dropout_p"] for c in counters["attention"][2:]] == [0.0, 0.0]


@needs_transformers
def test_bfloat16_loss_is_fp32_and_matches_stock(counters):
    model, stock, reference, loss, stock_loss, ref_loss = _check_parity("llama", "left", counters,
                                                                        dtype=torch.bfloat16)
    assert loss.dtype == stock_loss.dtype == torch.float32  # stock upcasts the logits; we compute CE in fp32
    # the error is that of the bf16 computation before the loss: bf16's floor
    assert_parity(loss.detach(), stock_loss.detach(), ref_loss.detach().float(), "loss", floor=FLOOR[torch.bfloat16])
    for name, grad in _grads(model).items():
        assert_parity(grad, _grads(stock)[name], _grads(reference)[name], name)


@needs_transformers
@pytest.mark.parametrize("rotary", [False, True])
def test_autocast_over_fp32_weights_runs_our_attention(rotary, counters):
    """Mixed-precision training (fp32 weights, bf16 autocast): transformers' rotary embedding gives an fp32 query and
    key beside the bf16 value; the attention still runs our op (in bf16, as SDPA under autocast), every layer, with
    the stock model's loss and gradients under the same autocast (parity rule against the fp32 model)."""
    model, _ = _tiny("llama")
    stock, reference = copy.deepcopy(model), copy.deepcopy(model)
    flt.apply(model, rotary=rotary)
    batch = _batch("left")
    with torch.autocast("cpu", torch.bfloat16):
        loss = model(**batch).loss
        stock_loss = stock(**batch).loss
    assert len(counters["attention"]) == model.config.num_hidden_layers and not flt.fallbacks, dict(flt.fallbacks)
    ref_loss = reference(**batch).loss
    for value in (loss, stock_loss, ref_loss):
        value.backward()
    assert_parity(loss.detach(), stock_loss.detach(), ref_loss.detach(), "loss", floor=FLOOR[torch.bfloat16])
    for name, grad in _grads(model).items():
        assert_parity(grad, _grads(stock)[name], _grads(reference)[name], name, floor=FLOOR[torch.bfloat16])


@needs_transformers
def test_scaled_logits_are_fused(counters):
    """Cohere scales the logits after lm_head by its config's logit_scale: the fused loss takes the same scale (and
    return_logits gives the model's scaled logits)."""
    model, _ = _tiny("cohere", logit_scale=0.3)
    model = model.double()
    stock = copy.deepcopy(model)
    flt.apply(model)
    batch = _batch("left")
    for _ in range(2):  # fp64: the fused loss in fp64 (stock rounds the logits to fp32 first)
        out = model(**batch, return_logits=True)
        torch.testing.assert_close(out.loss, _reference_loss(stock, batch), rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(out.logits, stock(**batch).logits, rtol=1e-12, atol=1e-12)
    assert flt.fallbacks == {} and counters["loss"] == 2


@needs_transformers
def test_logit_transform_learned_from_the_model_not_its_config(counters):
    """A scale the config does not announce (changed on the module after construction) is found on the first call,
    which is recomputed by the stock forward; from the next call the fused loss takes it."""
    model, _ = _tiny("cohere")
    model = model.double()
    model.logit_scale = 0.7
    stock = copy.deepcopy(model)
    flt.apply(model)
    batch = _batch("left")
    assert model(**batch).loss.item() == stock(**batch).loss.item()  # the stock forward's
    for _ in range(2):
        torch.testing.assert_close(model(**batch).loss, _reference_loss(stock, batch), rtol=1e-12, atol=1e-12)
    assert flt.fallbacks == {"logit_transform": 1} and counters["loss"] == 3  # 1 discarded, then 2 kept


@needs_transformers
def test_logits_postprocessing_other_than_scale_and_cap_is_detected(counters):
    """A learned scale (a parameter: not a constant transform) is not ours: the first call finds it (after computing,
    inside the head's call, a fused loss that it then discards) and is recomputed by the stock forward; later calls
    go straight to stock, with the scale's gradient."""
    model, _ = _tiny("cohere")
    model = model.double()
    model.logit_scale = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
    stock = copy.deepcopy(model)
    flt.apply(model)
    batch = _batch("left")
    for _ in range(2):
        torch.testing.assert_close(model(**batch).loss, stock(**batch).loss, rtol=1e-12, atol=1e-12)
    assert flt.fallbacks == {"logits_postprocessed": 2} and counters["loss"] == 1


@needs_transformers
def test_apply_is_idempotent_and_revert_restores_stock(counters):
    import inspect

    from transformers.models.qwen2 import modeling_qwen2

    stock_rotary = modeling_qwen2.apply_rotary_pos_emb
    model, stock_impl = _tiny("qwen2")
    stock = copy.deepcopy(model)
    forward_signature = inspect.signature(model.forward)
    assert flt.apply(model) is model
    forward = model.forward
    assert flt.apply(model) is model and model.forward is forward
    assert flt.is_applied(model) == dict.fromkeys(flt._PARTS, True)
    assert model.config._attn_implementation == model.model.config._attn_implementation == "fusedlayers"
    assert inspect.signature(model.forward) == forward_signature  # generate / Trainer inspect it
    copied = copy.deepcopy(model)  # the copy's forward runs the copy
    assert copied.forward.owner is copied

    assert flt.revert(model) is model
    assert flt.is_applied(model) == dict.fromkeys(flt._PARTS, False)
    assert model.config._attn_implementation == stock_impl and "forward" not in model.__dict__
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert modeling_qwen2.apply_rotary_pos_emb is stock_rotary and modeling_qwen2.__name__ not in flt._rotary_patches
    batch = _batch("left")
    out = model(**batch)
    assert out.logits is not None and counters == {**dict.fromkeys(counters, 0), "attention": []}
    torch.testing.assert_close(out.loss, stock(**batch).loss, rtol=0, atol=0)
    # each part on its own: the loss, then the layers, then attention
    flt.apply(model, **{**dict.fromkeys(flt._PARTS, False), "loss": True})
    assert flt.is_applied(model) == {**dict.fromkeys(flt._PARTS, False), "loss": True}
    model(**batch)
    assert counters["attention"] == [] and counters["loss"] == 1 and counters["rms_norm"] == 0
    layers = model.config.num_hidden_layers
    for part, name, calls in (("norm", "rms_norm", 2 * layers + 1), ("mlp", "swiglu", layers),
                              ("rotary", "rotary_embedding", layers)):
        flt.apply(model, **{**dict.fromkeys(flt._PARTS, False), part: True})
        model(**batch)
        assert counters[name] == calls, part
    flt.apply(model, loss=False)
    flt.revert(model, **{**dict.fromkeys(flt._PARTS, False), "loss": True})
    assert flt.is_applied(model) == {**dict.fromkeys(flt._PARTS, True), "loss": False}
    assert model(**batch).logits is not None and len(counters["attention"]) == layers and counters["loss"] == 4


@needs_transformers
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_applied_model_is_freed_by_del(arch):
    """No reference cycle: with the garbage collector off, dropping an applied model (every part, every combination,
    and after a forward and backward) frees every module and parameter, as dropping a stock one does."""
    combos = [c for r in range(len(flt._PARTS) + 1) for c in itertools.combinations(flt._PARTS, r)]
    gc.collect()
    gc.disable()
    try:
        for combo in combos:
            model, _ = _tiny(arch)
            flt.apply(model, **{part: part in combo for part in flt._PARTS})
            model(**_batch("left")).loss.backward()
            refs = [weakref.ref(x) for x in (*model.modules(), *model.parameters())]
            del model
            alive = sum(ref() is not None for ref in refs)
            assert alive == 0, f"{arch} applied with {combo}: {alive} modules/parameters outlive del"
        model, _ = _tiny(arch)
        flt.revert(flt.apply(model))
        refs = [weakref.ref(x) for x in model.modules()]
        del model
        assert all(ref() is None for ref in refs), "a reverted model outlives del"
    finally:
        gc.enable()


@needs_transformers
def test_copies_of_an_applied_model_run_their_own_weights(counters):
    """The weakly bound forwards of a deep copy or an unpickled model are bound to the copy, not the original."""
    model, _ = _tiny("llama")
    flt.apply(model, rotary=False)  # the rotary hooks are closures, which pickle cannot save
    for twin in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        assert twin.forward.owner is twin and twin.model.norm.forward.owner is twin.model.norm
        assert twin.model.layers[0].mlp.forward.owner is twin.model.layers[0].mlp
        with torch.no_grad():
            twin.lm_head.weight.mul_(2)
        batch = _batch()
        assert not torch.equal(twin(**batch).loss, model(**batch).loss)
        stock_twin = flt.revert(copy.deepcopy(twin))
        torch.testing.assert_close(twin(**batch).loss, stock_twin(**batch).loss, rtol=1e-5, atol=1e-6)


@needs_transformers
def test_composite_model_sub_configs(counters):
    """A vision-language model: set_attn_implementation reaches the text and vision sub-configs (CLIP's attention is
    bidirectional), revert restores them, and the loss is fused on the language model's lm_head."""
    t = transformers
    config = t.LlavaConfig(
        vision_config=t.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, image_size=16, patch_size=8, projection_dim=32),
        text_config=t.LlamaConfig(**COMMON), image_token_index=V - 1, vision_feature_layer=-1,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    model = t.LlavaForConditionalGeneration(config).double()
    stock = _float64_reference(model)
    flt.apply(model)
    implementations = {type(c).__name__: c._attn_implementation for c in flt._configs(model)}
    assert implementations == {"LlavaConfig": "fusedlayers", "LlamaConfig": "fusedlayers",
                               "CLIPVisionConfig": "fusedlayers"}
    ids = _batch("none")["input_ids"].clamp(max=V - 2)
    ids[:, 1:5] = V - 1  # (16 / 8)**2 = 4 image tokens per image
    batch = {"input_ids": ids, "pixel_values": torch.randn(B, 3, 16, 16, dtype=torch.float64),
             "labels": ids.masked_fill(ids == V - 1, -100)}
    out = model(**batch)
    assert out.logits is None and counters["loss"] == 1 and not flt.fallbacks
    assert [c["is_causal"] for c in counters["attention"]] == [False, True, True]  # vision tower, then text
    out.loss.backward()
    ref_loss = _reference_loss(stock, batch)
    ref_loss.backward()
    torch.testing.assert_close(out.loss, ref_loss, rtol=1e-12, atol=1e-12)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, _grads(stock)[name], rtol=1e-9, atol=1e-12, msg=name)
    flt.revert(model)
    assert {c._attn_implementation for c in flt._configs(model)} == {"sdpa"}


@needs_transformers
def test_registered_name_works_from_config():
    flt.register()
    model, _ = _tiny("llama", attn="fusedlayers")
    assert model.config._attn_implementation == "fusedlayers"
    model(**_batch("left")).loss.backward()
    with pytest.raises(TypeError, match="PreTrainedModel"):
        flt.apply(torch.nn.Linear(2, 2))


@needs_transformers
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("arch", ["llama", "mistral", "gpt2"])
def test_cuda_matches_stock(arch, dtype, counters):
    """On the GPU: the Triton attention and linear-cross-entropy kernels inside a model, with padding."""
    model, _ = _tiny(arch)
    model = model.to("cuda", dtype)
    stock = copy.deepcopy(model)
    reference = _float64_reference(model)
    flt.apply(model)
    batch = _batch("left", device="cuda")
    out = model(**batch)
    assert out.logits is None and len(counters["attention"]) == 2 and counters["loss"] == 1 and not flt.fallbacks
    out.loss.backward()
    stock_loss = stock(**batch).loss
    stock_loss.backward()
    ref_loss = _reference_loss(reference, batch)
    ref_loss.backward()
    assert out.loss.dtype == stock_loss.dtype == torch.float32
    # the loss's error is that of the computation before it, in the model's dtype
    assert_parity(out.loss.detach(), stock_loss.detach(), ref_loss.detach().float(), "loss", floor=FLOOR[dtype])
    for name, grad in _grads(model).items():
        assert_parity(grad, _grads(stock)[name], _grads(reference)[name], name)


# ----------------------------------------------------------------------------- cast_once: one autocast copy a module


def _autocast_step(model, batch, device="cpu"):
    """Loss, every gradient, the bytes autograd saved for backward (each storage once) and the inputs the linear
    layers were given, of one step under bf16 autocast."""
    storages, inputs = {}, {}

    def pack(t):
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    hooks = [m.register_forward_pre_hook(lambda m, a, name=name: inputs.setdefault(name, a[0]))
             for name, m in model.named_modules() if type(m) is torch.nn.Linear]
    with torch.autocast(device, torch.bfloat16), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    for hook in hooks:
        hook.remove()
    grads = {name: p.grad for name, p in model.named_parameters()}
    return loss.detach(), grads, sum(storages.values()), inputs


@needs_transformers
@pytest.mark.parametrize("arch", ["llama", "phi"])
def test_cast_once_is_bitwise_stock_with_one_copy(arch, monkeypatch):
    """Under autocast over fp32 weights the q/k/v projections (and an MLP's gate and up) read one bf16 copy of their
    fp32 input instead of casting it each: the loss and every gradient bitwise the stock ones (their gradients summed
    in fp32 in autograd's order), fewer bytes saved for backward, nothing changed outside autocast or below the size
    where sharing pays."""
    monkeypatch.setattr(flt, "CAST_ONCE_MIN_ELEMENTS", 0)  # these activations are tiny
    model, _ = _tiny(arch)
    stock = copy.deepcopy(model)
    flt.apply(model, **{**dict.fromkeys(flt._PARTS, False), "cast_once": True})
    batch = _batch("left")
    loss, grads, saved, inputs = _autocast_step(model, batch)
    stock_loss, stock_grads, stock_saved, stock_inputs = _autocast_step(stock, batch)
    assert torch.equal(loss, stock_loss)
    for name, grad in grads.items():
        assert torch.equal(grad, stock_grads[name]), name
    layer = "model.layers.0"
    groups = [[f"{layer}.self_attn.{n}_proj" for n in "qkv"]]
    if arch == "llama":
        groups.append([f"{layer}.mlp.gate_proj", f"{layer}.mlp.up_proj"])
    for names in groups:  # one bf16 tensor behind the group's inputs; stock: an fp32 one each casts itself
        assert {inputs[n].dtype for n in names} == {torch.bfloat16}
        assert len({inputs[n].untyped_storage().data_ptr() for n in names}) == 1, names
        assert {stock_inputs[n].dtype for n in names} == {torch.float32}
    copies = sum(len(names) - 1 for names in groups) * model.config.num_hidden_layers
    assert stock_saved - saved == copies * B * T * model.config.hidden_size * 2  # the bf16 copies not kept
    # without autocast: the stock computation, in fp32
    model.zero_grad()
    stock.zero_grad()
    model(**batch).loss.backward()
    stock(**batch).loss.backward()
    for name, p in model.named_parameters():
        assert torch.equal(p.grad, _grads(stock)[name]), name
    # inputs smaller than the threshold: each child casts its own, as stock
    monkeypatch.setattr(flt, "CAST_ONCE_MIN_ELEMENTS", B * T * model.config.hidden_size + 1)
    model.zero_grad()
    _, _, small_saved, small_inputs = _autocast_step(model, batch)
    assert small_saved == stock_saved and small_inputs[groups[0][0]].dtype == torch.float32
    # a 16-bit model (no autocast casts to share): no hooks at all
    half = flt.apply(copy.deepcopy(stock).bfloat16(), **{**dict.fromkeys(flt._PARTS, False), "cast_once": True})
    assert flt.is_applied(half)["cast_once"] and not any(m._forward_pre_hooks for m in half.modules())


@needs_transformers
@pytest.mark.parametrize("reentrant", [False, True])
def test_cast_once_under_activation_checkpointing(reentrant, monkeypatch):
    """transformers' gradient checkpointing recomputes each layer in backward (with autocast restored): the shared
    cast is made again there, and the loss and every gradient stay bitwise stock's."""
    monkeypatch.setattr(flt, "CAST_ONCE_MIN_ELEMENTS", 0)
    model, _ = _tiny("llama")
    stock = copy.deepcopy(model)
    flt.apply(model, **{**dict.fromkeys(flt._PARTS, False), "cast_once": True})
    for m in (model, stock):
        m.train()
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
    made = []
    real = flt._SharedCast.apply
    flt._SharedCast.apply = lambda *a: (made.append(a[2]), real(*a))[1]
    try:
        loss, grads, _, _ = _autocast_step(model, _batch("left"))
    finally:
        flt._SharedCast.apply = real
    stock_loss, stock_grads, _, _ = _autocast_step(stock, _batch("left"))
    assert made == [4, 3] * model.config.num_hidden_layers * 2  # forward, then the recompute in backward
    assert torch.equal(loss, stock_loss)
    # reentrant: the layers' linear weights get no gradient, in stock too (autocast's weight casts, cached in the
    # no-grad forward, are reused by the recompute); the same gradients exist and are equal either way
    assert {n for n, g in grads.items() if g is None} == {n for n, g in stock_grads.items() if g is None}
    assert sum(g is not None for g in grads.values()) >= 3
    for name, grad in grads.items():
        assert grad is None or torch.equal(grad, stock_grads[name]), name


class _TwoHeads(torch.nn.Module):
    """Two linear layers on one input, the second with autocast off around it, and a third on another tensor."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = (torch.nn.Linear(8, 8) for _ in range(3))

    def forward(self, x):
        with torch.autocast("cpu", enabled=False):
            off = self.b(x)
        return self.a(x), off, self.c(x.clone())


def test_cast_once_only_where_autocast_would_cast(monkeypatch):
    """A child called with autocast off gets the fp32 input (no dtype mismatch), one given another tensor its own,
    an input that is already 16-bit or float64 is left alone; the hooks come off with ``revert``'s helper."""
    monkeypatch.setattr(flt, "CAST_ONCE_MIN_ELEMENTS", 0)
    module, state = _TwoHeads(), {}
    stock = copy.deepcopy(module)
    flt._apply_cast_once(module, state)
    x = torch.randn(4, 8, requires_grad=True)
    with torch.autocast("cpu", torch.bfloat16):
        outs, stock_outs = module(x), stock(x)
    assert [o.dtype for o in outs] == [torch.bfloat16, torch.float32, torch.bfloat16]
    for o, r in zip(outs, stock_outs, strict=True):
        assert torch.equal(o, r)
    sum(o.float().sum() for o in outs).backward()
    grad = x.grad.clone()
    x.grad = None
    sum(o.float().sum() for o in stock_outs).backward()
    assert torch.equal(grad, x.grad)
    with torch.autocast("cpu", torch.bfloat16):
        assert flt._autocast_target(x) == torch.bfloat16
        assert flt._autocast_target(x.detach().bfloat16()) is flt._autocast_target(x.detach().double()) is None
    assert flt._autocast_target(x) is None
    assert not getattr(flt._shared_casts, "stack", [])  # every module call popped what it pushed
    flt._revert_cast_once(state)
    assert not any(m._forward_pre_hooks or m._forward_hooks for m in module.modules())


@pytest.mark.parametrize("dtypes", [(torch.bfloat16,) * 2, (torch.float16, torch.bfloat16, torch.float16),
                                    (torch.bfloat16, torch.float32, torch.bfloat16, torch.float16),
                                    (torch.float16,) * 5])
def test_shared_cast_gradient_sum_kernel(dtypes):
    """The fp32 sum of the gradients (the Triton kernel; interpreted on CPU): bitwise autograd's ((g0 + g1) + g2)...
    in fp32, at a size that is not a multiple of the block."""
    from fusedlayers import use_backend
    from fusedlayers.kernels.shared_cast import sum_fp32

    device = "cuda" if HAS_CUDA else "cpu"
    grads = [torch.randn(3, 1001, device=device).to(d) for d in dtypes]
    expected = grads[0].float()
    for g in grads[1:]:
        expected = expected + g.float()
    with use_backend("triton"):
        out = sum_fp32(grads)
    assert out.dtype == torch.float32 and torch.equal(out, expected)
    assert sum_fp32([g[:0] for g in grads]).shape == (0, 1001)


@needs_transformers
@pytest.mark.cuda
def test_cuda_cast_once_is_bitwise_stock(monkeypatch):
    """On the GPU (the gradient sum's kernel compiled): a tiny Llama with eager attention (deterministic), autocast
    over fp32 weights: loss and every gradient bitwise stock's."""
    monkeypatch.setattr(flt, "CAST_ONCE_MIN_ELEMENTS", 0)
    model, _ = _tiny("llama", attn="eager")
    model = model.cuda()
    stock = copy.deepcopy(model)
    flt.apply(model, **{**dict.fromkeys(flt._PARTS, False), "cast_once": True})
    batch = _batch("left", device="cuda")
    loss, grads, saved, _ = _autocast_step(model, batch, "cuda")
    stock_loss, stock_grads, stock_saved, _ = _autocast_step(stock, batch, "cuda")
    assert torch.equal(loss, stock_loss) and saved < stock_saved
    for name, grad in grads.items():
        assert torch.equal(grad, stock_grads[name]), name


# ----------------------------------------------------------------------------- sharded training (FSDP2, CPU, gloo)


def _fsdp2_worker(rank: int, world: int, init_file: str, head_unit: str) -> None:
    """One rank: a tiny Llama applied and sharded with FSDP2 (every decoder layer a unit; the head a unit of its own,
    or in the root unit), against the unsharded stock model on the same batch (every rank sees the same batch, so
    the averaged gradients are the single model's)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    import fusedlayers.functional as flf

    head_weights = []
    linear_cross_entropy = flf.linear_cross_entropy

    def recorded(input, linear_weight, *args, **kwargs):
        head_weights.append((type(linear_weight).__name__, tuple(linear_weight.shape)))
        return linear_cross_entropy(input, linear_weight, *args, **kwargs)

    flf.linear_cross_entropy = recorded
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, _ = _tiny("llama", tie_word_embeddings=False)
        stock = copy.deepcopy(model)
        flt.apply(model)
        for layer in model.model.layers:
            fully_shard(layer)
        if head_unit == "own":
            fully_shard(model.lm_head)
        fully_shard(model)
        assert type(model.lm_head.weight).__name__ == "DTensor"  # sharded outside forward
        batch = _batch("left")
        for step in range(2):  # the second step runs on the state the first one left (resharded, grads reduced)
            loss, stock_loss = model(**batch).loss, stock(**batch).loss
            loss.backward()
            stock_loss.backward()
            torch.testing.assert_close(loss, stock_loss)
            for (name, p), q in zip(model.named_parameters(), stock.parameters(), strict=True):
                torch.testing.assert_close(p.grad.full_tensor(), q.grad, msg=f"step {step}: {name}")
        # the fused loss ran, once a step, on the whole head weight (a plain tensor of the full shape)
        assert not flt.fallbacks, flt.fallbacks
        assert head_weights == [("Parameter", tuple(stock.lm_head.weight.shape))] * 2, head_weights
        dist.barrier()  # neither rank tears gloo down while the other still talks to it
    finally:
        dist.destroy_process_group()
    # Every check passed. At interpreter exit, a thread left behind by the gloo/DTensor collectives (full_tensor)
    # aborts the process ("terminate called without an active exception", no Python frame) in about one run of
    # four on a 2-core CPU: leave without running the interpreter's teardown.
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)


@needs_transformers
@pytest.mark.parametrize("head_unit", ["own", "root"])
def test_fsdp2_sharded_head_matches_stock(head_unit, tmp_path):
    """The fused loss under FSDP2 on 2 CPU processes: with the head sharded on its own (its weight is whole only
    inside its own module call, which is where the loss runs) and with the head in the root unit, the loss and every
    gradient equal the unsharded stock model's."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    mp.spawn(_fsdp2_worker, args=(2, str(tmp_path / "init"), head_unit), nprocs=2, join=True)


def _zero3_worker(rank: int, world: int, init_file: str, device: str = "cpu") -> None:
    """One rank: a tiny Llama applied and wrapped by DeepSpeed ZeRO-3 (every parameter partitioned across the ranks
    outside its module's call: the head's weight is empty there), against the same stock model wrapped the same way
    (ZeRO-3's own reduction and optimizer step on both sides), on the same batches."""
    import deepspeed
    import torch.distributed as dist

    import fusedlayers.functional as flf

    head_weights = []
    linear_cross_entropy = flf.linear_cross_entropy

    def recorded(input, linear_weight, *args, **kwargs):
        head_weights.append(tuple(linear_weight.shape))
        return linear_cross_entropy(input, linear_weight, *args, **kwargs)

    flf.linear_cross_entropy = recorded
    os.environ.update(LOCAL_RANK=str(rank), RANK=str(rank), WORLD_SIZE=str(world))
    if device == "cuda":
        torch.cuda.set_device(rank)
        device = f"cuda:{rank}"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        model, _ = _tiny("llama", tie_word_embeddings=False)
        model.to(device)
        stock = copy.deepcopy(model)
        head_shape = tuple(model.lm_head.weight.shape)
        flt.apply(model)
        config = {"train_micro_batch_size_per_gpu": B, "zero_optimization": {"stage": 3},
                  "zero_allow_untested_optimizer": True, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
        engine, *_ = deepspeed.initialize(model=model, config=config)
        stock_engine, *_ = deepspeed.initialize(model=stock, config=config)
        assert engine.module.lm_head.weight.numel() == 0  # partitioned outside forward
        for step in range(3):  # each step on the weights the previous one left (gathered, stepped, partitioned)
            batch = _batch("left", device=device, seed=1 + rank + 2 * step)
            loss, stock_loss = engine(**batch).loss, stock_engine(**batch).loss
            torch.testing.assert_close(loss, stock_loss, msg=f"step {step}")
            for e, value in ((engine, loss), (stock_engine, stock_loss)):
                e.backward(value)
                e.step()
        params = list(engine.module.parameters()) + list(stock_engine.module.parameters())
        with deepspeed.zero.GatheredParameters(params):
            for (name, p), q in zip(engine.module.named_parameters(), stock_engine.module.parameters(), strict=True):
                assert p.shape == q.shape and p.numel() > 0, name
                torch.testing.assert_close(p, q, msg=name)
        assert not flt.fallbacks, flt.fallbacks
        assert head_weights == [head_shape] * 3, head_weights  # the whole head, each step
        dist.barrier()
    finally:
        dist.destroy_process_group()
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(0)  # as the FSDP2 worker: no interpreter teardown after the collectives


@needs_transformers
def test_deepspeed_zero3_matches_stock(tmp_path):
    """The fused loss under DeepSpeed ZeRO-3 on 2 CPU processes (gloo): it runs inside the head's module call, where
    ZeRO-3's hooks have gathered the head, and its gradient flows back through the head's (wrapped) output, where
    ZeRO-3's hook gathers the head again for the backward; the losses of three steps (each rank its own batch) and
    the weights after them equal the stock model's under ZeRO-3. Needs DeepSpeed (``pip install deepspeed``; not in
    the dev extra: it builds from source)."""
    pytest.importorskip("deepspeed", reason="needs DeepSpeed")
    import torch.multiprocessing as mp

    mp.spawn(_zero3_worker, args=(2, str(tmp_path / "init")), nprocs=2, join=True)


@needs_transformers
@pytest.mark.cuda
def test_cuda_deepspeed_zero3_matches_stock(tmp_path):
    """As the CPU test, on the GPUs (NCCL, one process each, at most 2; one GPU still partitions: ZeRO-3 frees every
    parameter outside its module's call), the kernels computing the fused loss and attention."""
    pytest.importorskip("deepspeed", reason="needs DeepSpeed")
    import torch.multiprocessing as mp

    world = min(2, torch.cuda.device_count())
    mp.spawn(_zero3_worker, args=(world, str(tmp_path / "init"), "cuda"), nprocs=world, join=True)


@needs_transformers
def test_auto_fused_model_from_pretrained_and_from_config(tmp_path, counters):
    """AutoFusedModelForCausalLM takes AutoModelForCausalLM's arguments and returns the loaded model applied."""
    model, _ = _tiny("llama")
    model.save_pretrained(tmp_path)
    loaded = flt.AutoFusedModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64, mlp=False)
    assert type(loaded) is type(model) and loaded.dtype == torch.float64
    assert flt.is_applied(loaded) == {**dict.fromkeys(flt._PARTS, True), "mlp": False}
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    batch = _batch("left")
    reference = _float64_reference(stock)  # its RMSNorms in float64, as ours
    torch.testing.assert_close(loaded(**batch).loss, _reference_loss(reference, batch), rtol=1e-12, atol=1e-12)
    assert counters["loss"] == 1 and counters["swiglu"] == 0
    built = flt.AutoFusedModelForCausalLM.from_config(model.config, loss=False)
    assert flt.is_applied(built) == {**dict.fromkeys(flt._PARTS, True), "loss": False}


@needs_transformers
def test_labels_for_positions_the_head_does_not_see_fall_back_for_that_call(counters):
    """logits_to_keep with labels for every position: the head sees fewer positions than there are labels, so that call
    runs the stock forward (which raises or not as stock does), and the next ordinary call is fused again."""
    model, _ = _tiny("llama")
    stock = copy.deepcopy(model)
    flt.apply(model)
    batch = _batch()
    with pytest.raises(Exception) as fused_error:
        model(**batch, logits_to_keep=4)
    with pytest.raises(type(fused_error.value)):
        stock(**batch, logits_to_keep=4)
    assert flt.fallbacks == {"label_count": 1} and counters["loss"] == 0
    torch.testing.assert_close(model(**batch).loss, stock(**batch).loss)
    assert counters["loss"] == 1 and flt.fallbacks == {"label_count": 1}
