"""Fused attention in the transformers families whose attention predates the AttentionInterface
(fusedlayers/integrations/_legacy_attention.py). Each family and the variants of its code (GPT-Neo's local band
narrower than the sequence, ALiBi, Falcon's three head layouts, MPT's qkv clipping and softmax scale) through the
coverage sweep's comparison (tests/transformers_coverage.py: fp32, no padding and left padding, the loss and every
gradient under tests/parity.py's rule against a float64 copy, every attention call our op, no fallback); the families
whose stock code stays in float64 also fused against stock in float64 to 1e-10; greedy generation with the cache
token for token; ``output_attentions`` giving stock's weights bit for bit; revert; a dropped model freed without the
garbage collector."""

from __future__ import annotations

import gc
import warnings
import weakref

import pytest
import torch

pytest.importorskip("transformers", reason='needs transformers (pip install -e ".[dev]" or fusedlayers[transformers])')

from fusedlayers import functional as fl  # noqa: E402
from fusedlayers.integrations import transformers as flt  # noqa: E402
from tests.parity import FLOOR, assert_parity  # noqa: E402
from tests.transformers_coverage import (  # noqa: E402
    ARCH_OVERRIDES,
    architectures,
    make_batch,
    model_class,
    parity_text,
    run_arch,
    shrunk_config,
    summary_line,
)

# (model_type, config overrides): every family, then the variants of its code each override takes
CASES = [
    ("openai-gpt", {}),
    ("gpt_neo", {}),
    ("gpt_neo", {"window_size": 4}),  # the local layer keeps 4 keys of 12
    ("gpt_neox_japanese", {}),
    ("bloom", {}),
    ("falcon", {}),  # new decoder architecture, rotary
    ("falcon", {"alibi": True, "new_decoder_architecture": False, "multi_query": False}),
    ("falcon", {"new_decoder_architecture": False, "multi_query": True}),  # one key/value head
    ("mpt", {}),
    ("mpt", {"attn_config": {"clip_qkv": 0.05, "softmax_scale": 0.3}}),
    ("xglm", {}),
    ("trocr", {}),
    ("mvp", {}),
    ("rembert", {}),
    ("megatron-bert", {}),
    ("roformer", {}),  # its sinusoidal rotary embedding on query and key
    ("roformer", {"rotary_value": True}),  # and on value
]
IDS = [f"{arch}-{'-'.join(over) or 'default'}" for arch, over in CASES]
# the families whose stock attention stays in the model's dtype (GPT-Neo, BLOOM and MPT compute theirs in float32,
# XGLM's float64 masks overflow its float32 cast): also compared in float64
FLOAT64 = [(i, case) for i, case in enumerate(CASES)
           if case[0] in ("openai-gpt", "gpt_neox_japanese", "falcon", "trocr", "mvp", "rembert", "megatron-bert",
                          "roformer")]


def _model(arch, overrides, dtype=torch.float64):
    config = shrunk_config(arch)
    for key, value in overrides.items():
        if isinstance(value, dict):
            sub = getattr(config, key)
            for k, v in value.items():
                setattr(sub, k, v)
        else:
            setattr(config, key, value)
    torch.manual_seed(0)
    return model_class(architectures()[arch])._from_config(config, dtype=dtype).eval()


@pytest.fixture
def attention_calls(monkeypatch):
    calls = []
    op = fl.scaled_dot_product_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape)
        return op(*args, **kwargs)

    monkeypatch.setattr(fl, "scaled_dot_product_attention", counted)
    return calls


UNSHIFTED = ("trocr", "mvp")  # decoders whose loss is the cross-entropy of the labels as given


def _shifted_loss(model, batch):
    """The model's loss from the stock model's float64 logits (its own loss rounds them to float32 first)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs, use_cache=False).logits
    labels = batch["labels"]
    if model.config.model_type not in UNSHIFTED:
        labels = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
    return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def _loss_and_grads(model, batch, applied):
    model.zero_grad(set_to_none=True)
    loss = model(**batch, use_cache=False).loss if applied else _shifted_loss(model, batch)
    assert loss.dtype == torch.float64
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _pair(arch, overrides, dtype=torch.float64, **parts):
    stock = _model(arch, overrides, dtype)
    fused = _model(arch, overrides, dtype)
    fused.load_state_dict(stock.state_dict())
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        flt.apply(fused, **parts)
    assert not [str(r.message) for r in record if "fusedlayers" in str(r.message)], "the family was not recognised"
    return stock, fused


def _layers(model):
    return model.config.num_hidden_layers if hasattr(model.config, "num_hidden_layers") else model.config.n_layer


@pytest.mark.parametrize(("arch", "overrides"), CASES, ids=IDS)
def test_family_is_fused_with_parity(arch, overrides, monkeypatch):
    monkeypatch.setitem(ARCH_OVERRIDES, arch, {**ARCH_OVERRIDES.get(arch, {}), **overrides})
    result = run_arch(arch, architectures()[arch], time_limit_s=None, candidates=False)
    assert result.builds and not result.fused_error, f"{result.build_error}{result.fused_error}"
    assert result.paddings == ["none", "left"], result.padding_errors
    assert not result.fallbacks and not result.apply_warnings, summary_line(result)
    assert result.attention_fused and result.loss_fused, summary_line(result)
    assert result.parity_ok, parity_text(result)


@pytest.mark.parametrize("padding", ["none", "left"])
@pytest.mark.parametrize(("arch", "overrides"), [case for _, case in FLOAT64], ids=[IDS[i] for i, _ in FLOAT64])
def test_float64_tight(arch, overrides, padding, attention_calls):
    stock, fused = _pair(arch, overrides)
    batch = make_batch(stock, padding)
    loss_s, grads_s = _loss_and_grads(stock, batch, applied=False)
    assert not attention_calls
    loss_f, grads_f = _loss_and_grads(fused, batch, applied=True)
    assert len(attention_calls) == _layers(fused), "not every layer ran the fused attention op"
    torch.testing.assert_close(loss_f, loss_s, rtol=1e-10, atol=1e-12)
    assert grads_f.keys() == grads_s.keys()
    for name, g in grads_s.items():
        torch.testing.assert_close(grads_f[name], g, rtol=1e-9, atol=1e-10 * g.abs().max().item() + 1e-14,
                                   msg=lambda m, name=name: f"{name}: {m}")


def test_gpt_neo_local_band_matters(attention_calls):
    """The local layer's band is applied: the same model with its window as wide as the sequence differs."""
    stock, fused = _pair("gpt_neo", {"window_size": 4})
    batch = make_batch(stock, "none")
    loss_f = fused(**batch, use_cache=False).loss
    torch.testing.assert_close(loss_f, _shifted_loss(stock, batch), rtol=1e-10, atol=0)
    wide = _model("gpt_neo", {"window_size": 64})
    wide.load_state_dict(stock.state_dict())
    assert not torch.allclose(loss_f, _shifted_loss(wide, batch), rtol=1e-6)


@pytest.mark.parametrize(("arch", "overrides"), [CASES[i] for i in (0, 2, 3, 4, 5, 6, 8, 10, 16)],
                         ids=[IDS[i] for i in (0, 2, 3, 4, 5, 6, 8, 10, 16)])
def test_generate_matches_stock(arch, overrides, attention_calls):
    stock, fused = _pair(arch, overrides, torch.float32)
    batch = make_batch(stock, "left")
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], max_new_tokens=5,
                  do_sample=False, pad_token_id=0)
    if arch == "openai-gpt":  # no cache and no padding in its model
        kwargs.pop("attention_mask")
    expected = stock.generate(**kwargs)
    got = fused.generate(**kwargs)
    assert attention_calls
    assert torch.equal(got, expected)


@pytest.mark.parametrize("arch", ["gpt_neo", "bloom", "mpt", "falcon", "gpt_neox_japanese", "openai-gpt", "roformer"])
def test_output_attentions_runs_stock(arch, attention_calls):
    stock, fused = _pair(arch, {}, loss=False, norm=False, mlp=False, rotary=False)
    batch = make_batch(stock, "none")
    expected = stock(input_ids=batch["input_ids"], output_attentions=True).attentions
    got = fused(input_ids=batch["input_ids"], output_attentions=True).attentions
    assert not attention_calls
    assert len(got) == len(expected) and all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    fused(**batch)  # and the next call is fused again
    assert len(attention_calls) == _layers(fused)


def test_revert_restores_the_stock_code(attention_calls):
    stock, fused = _pair("bloom", {}, torch.float32)
    attention = fused.transformer.h[0].self_attention
    assert "forward" in attention.__dict__
    flt.revert(fused)
    assert "forward" not in attention.__dict__ and not fused._forward_pre_hooks
    batch = make_batch(stock, "left")
    assert torch.equal(fused(**batch).loss, stock(**batch).loss)  # both stock: the same code, bit for bit
    assert not attention_calls


def test_applied_model_is_freed_by_del():
    model = flt.apply(_model("gpt_neo", {}))
    batch = make_batch(model, "left")
    model(**batch).loss.backward()
    ref = weakref.ref(model)
    gc.disable()
    try:
        del model
        assert ref() is None, "the applied model is kept alive by a reference cycle"
    finally:
        gc.enable()


@pytest.mark.cuda
@pytest.mark.parametrize(("arch", "overrides"), CASES, ids=IDS)
def test_cuda_bfloat16_matches_stock(arch, overrides, attention_calls):
    """On the GPU in bfloat16 (the Triton kernels, masks built on the device): the fused model's loss and gradients
    within the parity rule against an fp32 copy of the stock model, beside the stock bfloat16 model's."""
    stock, fused = (m.to("cuda", torch.bfloat16) for m in _pair(arch, overrides, torch.float32))
    reference = _model(arch, overrides, torch.float32).to("cuda")
    reference.load_state_dict(stock.state_dict())
    batch = {k: v.cuda() for k, v in make_batch(stock, "none").items()}
    losses, grads = {}, {}
    for name, model in (("fused", fused), ("stock", stock), ("reference", reference)):
        model.zero_grad(set_to_none=True)
        losses[name] = model(**batch, use_cache=False).loss
        losses[name].backward()
        grads[name] = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert len(attention_calls) == _layers(fused)
    assert_parity(losses["fused"].detach().float(), losses["stock"].detach().float(), losses["reference"].detach(),
                  "loss", floor=FLOOR[torch.bfloat16])
    for name, g in grads["reference"].items():
        assert_parity(grads["fused"][name], grads["stock"][name], g, name)


@pytest.mark.parametrize("arch", ["bloom", "mpt", "xglm", "falcon"])
def test_forward_with_a_cache_is_fused_too(arch, attention_calls):
    """A training forward that fills a cache (use_cache left on) runs our op and gives the loss without one."""
    _, fused = _pair(arch, {}, torch.float32)
    batch = make_batch(fused, "left")
    without = fused(**batch, use_cache=False).loss
    out = fused(**batch, use_cache=True)
    cache = getattr(out, "cache", getattr(out, "past_key_values", None))  # the field's name before transformers 5.2x
    assert cache is not None and len(attention_calls) == 2 * _layers(fused)
    torch.testing.assert_close(out.loss, without, rtol=0, atol=0)


def test_mvp_prompts_in_the_encoder_decoder_model(attention_calls):
    """MVP's seq2seq model with prompts (keys and values of its own before the sequence's, in the encoder's,
    decoder's and cross attention): the swapped attention gives stock's logits in float64."""
    from transformers import MvpConfig, MvpForConditionalGeneration

    config = MvpConfig(vocab_size=64, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
                       decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, use_prompt=True,
                       prompt_length=3, prompt_mid_dim=16, max_position_embeddings=32)
    torch.manual_seed(0)
    stock = MvpForConditionalGeneration(config).double().eval()
    fused = MvpForConditionalGeneration(config).double().eval()
    fused.load_state_dict(stock.state_dict())
    flt.apply(fused, loss=False)
    ids = torch.randint(4, 64, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    kwargs = dict(input_ids=ids, attention_mask=mask, decoder_input_ids=ids[:, :7], use_cache=False)
    expected = stock(**kwargs).logits
    got = fused(**kwargs).logits
    assert len(attention_calls) == 3  # encoder self, decoder self, decoder cross
    torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("arch", ["rembert", "trocr", "roformer"])
def test_decoder_cross_attention_equals_stock(arch, attention_calls):
    """Decoders given an encoder's states (cross-attention layers, with the encoder's padding mask): the logits of
    stock in float64, self- and cross-attention both on our op (the BERT- and BART-era code, RoFormer's rotary
    self-attention; Megatron-BERT's stock
    cross-attention cannot take an encoder of another length, XGLM's overflows in float64)."""
    overrides = {"add_cross_attention": True, "is_decoder": True} if arch in ("rembert", "roformer") else {}
    stock, fused = _pair(arch, overrides, loss=False)
    batch = make_batch(stock, "left")
    hidden = stock.config.hidden_size if hasattr(stock.config, "hidden_size") else stock.config.d_model
    encoder_states = torch.randn(batch["input_ids"].shape[0], 5, hidden, dtype=torch.float64)
    encoder_mask = torch.ones(encoder_states.shape[:2], dtype=torch.long)
    encoder_mask[1, :2] = 0
    kwargs = dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False,
                  encoder_hidden_states=encoder_states, encoder_attention_mask=encoder_mask)
    expected = stock(**kwargs).logits
    got = fused(**kwargs).logits
    assert len(attention_calls) == 2 * _layers(fused)
    torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-10)


def test_derived_masks_are_not_kept_past_the_forward(attention_calls, monkeypatch):
    """BLOOM's ALiBi mask (B x H x L x S) is built once a forward for every layer, and not kept past the forward: the
    cache's entry goes with the model's own mask, the mask itself with the graph."""
    from fusedlayers.integrations import _legacy_attention

    built, stock_with_bias = [], flt._with_bias

    def with_bias(mask, bias):
        built.append(stock_with_bias(mask, bias))
        return built[-1]

    monkeypatch.setattr(flt, "_with_bias", with_bias)
    _, fused = _pair("bloom", {}, torch.float32)
    batch = make_batch(fused, "left")
    out = fused(**batch)
    assert len(built) == 1 and len(attention_calls) == 2  # one mask for both layers
    assert not _legacy_attention._recent[0]  # the model's mask is gone: so is the entry
    mask = weakref.ref(built.pop())
    assert mask() is not None  # held by the graph for the backward
    out.loss.backward()
    del out
    assert mask() is None
