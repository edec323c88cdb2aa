"""A fixed sample of the coverage sweep (tests/transformers_coverage.py): tiny models from shrunk default configs of
diverse architectures, each applied with ``flt.apply`` and compared with the untouched model on the same batches
(no padding and left padding): attention and loss fused (or the documented fallback where the architecture cannot
be fused exactly), the layers we know to be swapped, and the loss and every gradient under tests/parity.py's rule
against a float64 copy. The whole sweep: ``python -m tests.transformers_coverage --out ...``.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason='needs transformers (pip install -e ".[dev]" or fusedlayers[transformers])')

from tests.transformers_coverage import (  # noqa: E402
    ATTENTION_REASONS,
    LOSS_REASONS,
    architectures,
    parity_text,
    run_arch,
    summary_line,
)

# model_type -> (the integration's fallback reasons over both batches, fused layer kinds that must be among those
# that ran). Fallbacks are compared exactly: a new one (or one that goes away) is a change to look at.
SAMPLE = {
    "llama": ({}, {"norm", "mlp", "rotary"}),
    "qwen2": ({}, {"norm", "mlp", "rotary"}),
    "qwen3": ({}, {"norm", "mlp", "rotary"}),  # its q/k norms are Llama's RMSNorm too
    "mistral": ({}, {"norm", "mlp", "rotary"}),  # sliding window 8 < 12 tokens
    "gemma": ({}, {"norm", "mlp", "rotary"}),  # (1 + weight) RMSNorm; a GELU (tanh form) gate: fl.geglu
    "gemma2": ({}, {"norm", "rotary"}),  # attention and final-logit soft-caps fused
    "gpt2": ({}, {"norm"}),  # nn.LayerNorm
    "phi": ({}, {"norm", "rotary"}),  # partial rotary, lm_head with a bias
    "olmo2": ({}, {"mlp"}),
    "granite": ({}, {"norm", "mlp", "rotary"}),  # logits_scaling after lm_head: the loss's logit_scale
    "cohere": ({}, {"mlp"}),  # logit_scale after lm_head
    "starcoder2": ({}, {"norm", "rotary"}),
    "mixtral": ({}, {"norm", "rotary"}),  # mixture of experts (experts stay stock)
    "qwen3_next": ({}, {"norm", "mlp"}),  # hybrid: a linear-attention layer and a full-attention one
    "gpt_oss": ({}, set()),  # attention sinks (s_aux): fl.scaled_dot_product_attention(sinks=...)
    "bart": ({}, {"norm"}),  # BART's decoder: its own cross-entropy of the labels unshifted
    "inkling_text": ({}, {"norm"}),  # a learned relative position bias: an additive mask of the attention op
}
UNSHIFTED = "other: cross-entropy of the unshifted labels"
LOSS_KINDS = {"bart": UNSHIFTED}


@pytest.mark.parametrize("model_type", list(SAMPLE))
def test_architecture_is_fused_with_parity(model_type):
    fallbacks, layers = SAMPLE[model_type]
    result = run_arch(model_type, architectures()[model_type], time_limit_s=None, candidates=False)
    assert result.builds, result.build_error
    assert not result.fused_error, f"{result.fused_error}\n{result.fused_error_trace}"
    assert result.paddings == ["none", "left"], result.padding_errors
    assert dict(result.fallbacks) == fallbacks, summary_line(result)
    assert not result.apply_warnings, result.apply_warnings
    assert result.attention_fused == (not set(ATTENTION_REASONS) & set(fallbacks)), summary_line(result)
    assert result.loss_fused == (not set(LOSS_REASONS) & set(fallbacks)), summary_line(result)
    assert result.loss_kind == LOSS_KINDS.get(model_type, "causal")
    fused = {part for part in ("norm", "mlp", "rotary") if result.fused(part)}
    assert layers <= fused, f"fused layers {sorted(fused)}, expected at least {sorted(layers)}"
    assert result.reference.startswith("float64"), result.reference
    bad = [c for c in result.parity if not c.ok]
    assert result.parity_ok, f"{parity_text(result)}: " + "; ".join(
        f"{c.padding} {c.name}: error {c.fused_err:.3e} > bound {c.bound:.3e}" for c in bad[:5])


# Architectures where the integration must stay stock for a part, each found by the sweep computing something else
# when that part was fused: the loss of ProphetNet's decoder, which feeds the head more positions than labels, and
# NanoChat's rotary, whose apply_rotary_pos_emb is Llama's but whose rotate_half turns the other way.
STAYS_STOCK = {
    "prophetnet": ({"loss_function": 2}, "loss"),
    "nanochat": ({}, "rotary"),
}


@pytest.mark.parametrize("model_type", list(STAYS_STOCK))
def test_parts_that_must_stay_stock(model_type):
    fallbacks, part = STAYS_STOCK[model_type]
    result = run_arch(model_type, architectures()[model_type], time_limit_s=None, candidates=False)
    assert result.builds and not result.fused_error, result.fused_error
    assert dict(result.fallbacks) == fallbacks, summary_line(result)
    if part == "loss":
        assert not result.loss_fused, summary_line(result)
    else:
        assert not result.fused(part), summary_line(result)
    assert result.parity_ok, parity_text(result)


def test_composite_model_switches_the_sub_models_that_can():
    """GOT-OCR2: its vision tower predates the AttentionInterface and cannot switch, its language model can: the
    language model's attention and the loss are fused (a text batch), the warning names the part left stock."""
    result = run_arch("got_ocr2", architectures()["got_ocr2"], time_limit_s=None, candidates=False)
    assert result.builds and not result.fused_error, result.fused_error
    assert result.attention_fused and result.loss_fused, summary_line(result)
    assert len(result.apply_warnings) == 1 and result.apply_warnings[0].startswith("vision_config cannot switch")
    assert result.parity_ok, parity_text(result)
