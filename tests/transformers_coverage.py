"""Coverage sweep of ``fusedlayers.integrations.transformers`` over every causal-LM architecture of the installed
transformers.

    python -m tests.transformers_coverage --out benchmarks/results/cpu-transformers-coverage.md [--only llama gpt2]
    python -m tests.transformers_coverage --cast-once --out benchmarks/results/cpu-cast_once-coverage.md

For each ``model_type -> class`` of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES``: a tiny model from a *shrunk default config*
(the config class's own defaults, with the width, depth, heads, FFN, vocabulary, positions, experts... set small by
:func:`shrunk_config`, plus :data:`ARCH_OVERRIDES`), fp32, eval mode (dropout 0), stock attention ``sdpa`` (``eager``
where the class has no SDPA). An architecture that does not build, or whose stock forward with labels fails, is
listed as such and not counted. Otherwise an applied deep copy (``flt.apply``) and the untouched model get the same
batches (labels with some -100; without padding, and with left padding where the stock model accepts it), and
:func:`run_arch` records which fused ops ran (calls of ``fusedlayers.functional``'s attention, loss, norm, SwiGLU and
rotary functions), the integration's fallbacks (``flt.fallbacks``), and parity: the loss and every parameter
gradient of the fused fp32 model against the stock fp32 model, both against a float64 copy (tests/parity.py's rule:
fused error <= 2 x stock error + floor), or, where a float64 copy cannot run, fused against stock within
:data:`NO_REFERENCE_RTOL`. Every architecture runs under a time limit and inside try/except: one failure does not
stop the sweep. tests/test_transformers_coverage.py runs a fixed sample of architectures through the same functions.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
import dataclasses
import datetime
import inspect
import math
import os
import platform
import re
import signal
import subprocess
import sys
import time
import traceback
import warnings

import torch
import torch.nn.functional as F

from tests.parity import FLOOR, float64_hf_norms, loss_floor, max_error

B, T = 3, 12  # batch rows and tokens of every batch
LEFT_PADDING = (0, 3, 5)  # padded tokens of each row with left padding
VOCAB = 256
RESERVED = 16  # the top RESERVED ids hold the special tokens (image, audio, ...): never sampled as input
TIME_LIMIT_S = 60  # per architecture
REL_DIFF_IGNORE = 1e-4  # see Result.max_rel_diff
NO_REFERENCE_RTOL = 1e-4  # fused vs stock (both fp32) where no float64 copy runs: max|f - s| <= rtol max|s| + floor
COUNTED = ("scaled_dot_product_attention", "varlen_attention", "linear_cross_entropy", "rms_norm", "layer_norm",
           "swiglu", "geglu", "rotary_embedding")
ATTENTION_REASONS = ("softcap", "sinks", "position_bias", "mask_type", "layout", "dtype", "head_dim",
                     "sliding_window", "mask_shape")
LOSS_REASONS = ("lm_head", "loss_function", "logits_postprocessed")

# Config fields set small where the config class has them (with an int default larger than this, or None where
# marked in SHRINK_EVEN_IF_NONE). Values chosen so that the usual constraints hold: hidden = heads x head_dim,
# heads a multiple of kv heads, experts >= experts per token.
SHRINK = {
    # width
    "hidden_size": 64, "n_embd": 64, "d_model": 64, "n_embed": 64, "embed_dim": 64, "dim": 64, "model_dim": 64,
    "word_embed_proj_dim": 64, "embedding_size": 64, "hidden_size_per_layer_input": 16, "backbone_hidden_size": 64,
    # depth
    "num_hidden_layers": 2, "n_layer": 2, "num_layers": 2, "n_layers": 2, "decoder_layers": 2, "encoder_layers": 2,
    "num_decoder_layers": 2, "num_encoder_layers": 2,
    # attention heads
    "num_attention_heads": 4, "n_head": 4, "num_heads": 4, "n_heads": 4, "decoder_attention_heads": 4,
    "encoder_attention_heads": 4, "attention_heads": 4, "num_encoder_attention_heads": 4,
    "num_decoder_attention_heads": 4, "swa_num_attention_heads": 4,
    "num_key_value_heads": 2, "num_kv_heads": 2, "n_kv_heads": 2, "multi_query_group_num": 2,
    "swa_num_key_value_heads": 2,
    "head_dim": 16, "kv_channels": 16, "dim_head": 16, "swa_head_dim": 16, "attention_head_size": 16,
    # feed-forward
    "intermediate_size": 128, "ffn_dim": 128, "d_ff": 128, "dim_ff": 128, "dff": 128, "ffn_hidden_size": 128,
    "decoder_ffn_dim": 128, "encoder_ffn_dim": 128, "intermediate_size_mlp": 128, "dense_intermediate_size": 128,
    "feed_forward_size": 128, "d_inner": 128,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "shared_intermediate_size": 32,
    "shared_experts_intermediate_size": 32, "moe_shared_expert_intermediate_size": 32, "expert_ffn_hidden_size": 32,
    # mixture of experts
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "moe_num_experts": 4, "num_experts_per_tok": 2,
    "moe_topk": 2, "n_group": 1, "topk_group": 1, "first_k_dense_replace": 1,
    # vocabulary and positions
    "vocab_size": VOCAB, "max_position_embeddings": 128, "n_positions": 128, "n_ctx": 128, "max_seq_len": 128,
    "max_sequence_length": 128, "max_target_positions": 128, "max_source_positions": 128,
    "original_max_position_embeddings": 128,
    "sliding_window": 8, "sliding_window_size": 8,
    # multi-head latent attention and its indexer
    "kv_lora_rank": 16, "q_lora_rank": 32, "o_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8,
    "v_head_dim": 16, "index_head_dim": 16, "index_n_heads": 2, "index_topk": 8,
    # linear attention / state space layers
    "linear_key_head_dim": 16, "linear_value_head_dim": 16, "linear_num_value_heads": 4, "linear_num_key_heads": 2,
    "linear_head_dim": 16, "linear_num_heads": 4,
    "mamba_d_state": 8, "state_size": 8, "ssm_state_size": 8, "mamba_n_heads": 8, "mamba_num_heads": 8,
    "mamba_head_dim": 16, "mamba_d_head": 16, "mamba_chunk_size": 16, "chunk_size": 16,
    # odds and ends
    "rotary_dim": 8, "moe_k": 2, "vocab_size_per_layer_input": VOCAB, "adapter_in_dim": 64, "emb_dim": 64,
    "unpadded_vocab_size": VOCAB, "shape_vocab_size": 64, "pronunciation_vocab_size": 64,
}
SHRINK_EVEN_IF_NONE = {"num_key_value_heads", "head_dim"}
# Per-architecture changes, applied after SHRINK: {model_type: {field: value}}, to the text config where the
# architecture nests one (else to the top config), or {"<sub-config key>": {...}} for a named sub-config.
ARCH_OVERRIDES: dict[str, dict] = {
    "bamba": dict(attn_layer_indices=[1]),  # one Mamba layer, one attention layer
    "deepseek_v2": dict(num_experts_per_tok=2),
    "dots1": dict(n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1),
    "dots3_note": dict(num_key_value_heads=4),  # no grouped-query attention
    "dots3_note_text": dict(num_key_value_heads=4),
    "gemma3n_text": dict(num_kv_shared_layers=0),
    "gemma4_assistant": dict(hidden_size_per_layer_input=0, vocab_size_per_layer_input=0),
    "granitemoehybrid": dict(layer_types=["mamba", "attention"]),  # (default: all Mamba)
    "gpt_neo": dict(attention_types=[[["global", "local"], 1]]),
    "jamba": dict(attn_layer_period=2, attn_layer_offset=1),
    "lfm2_moe": dict(num_dense_layers=1, layer_types=["conv", "full_attention"]),  # (default: no layer types)
    "mamba2": dict(num_heads=8),  # hidden 64 x expand 2 = 8 heads x 16
    "nemotron_h": dict(layer_types=["full_attention", "moe"]),  # (default 2 layers: Mamba, MoE)
    "recurrent_gemma": dict(block_types=["recurrent", "attention"]),
    # its indexed (sparse) attention layers need an indexer (default: none, and 2 linear-attention layers)
    "qwen4_exp": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                      indexer_compress_ratio=2),
    "qwen4_exp_text": dict(indexer_n_heads=2, indexer_kv_heads=1, indexer_head_dim=16, indexer_budget=8,
                           indexer_compress_ratio=2),
    "reformer": dict(is_decoder=True, attn_layers=["local", "local"], axial_pos_shape=[3, 4],
                     axial_pos_embds_dim=[16, 48], local_attn_chunk_length=4),
    "zamba": dict(layers_block_type=["hybrid", "hybrid"]),  # (the hybrid layers share one attention block)
    "zamba2": dict(layers_block_type=["mamba", "hybrid"]),
}
# Calls after building (model -> None), e.g. state a model needs before its first forward.
POST_BUILD = {
    "xmod": lambda model: model.set_default_language(next(iter(model.config.languages))),
    "reformer": lambda model: model.train(),  # its reversible layers' backward needs training mode (dropout is 0)
}


# --------------------------------------------------------------------------------------------------------------
# configs and models


def _field_defaults(cls) -> dict:
    out = {}
    if not dataclasses.is_dataclass(cls):
        return out
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            try:
                out[f.name] = f.default_factory()
            except Exception:  # a factory we cannot call: the field keeps its default
                pass
    return out


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _sub_config_classes(cls) -> dict:
    """{field: (config class, its spec's default kwargs)} of a composite config class."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    out = {}
    specs = getattr(cls, "sub_configs_defaults", None) or getattr(cls, "sub_configs", None) or {}
    for key, spec in specs.items():
        config_class = getattr(spec, "config_class", spec)
        try:
            if not (isinstance(config_class, type) and hasattr(config_class, "__dataclass_fields__")
                    and getattr(config_class, "model_type", "")):
                config_class = CONFIG_MAPPING[spec.model_type]
        except Exception:  # an unresolvable spec: left to its default
            continue
        out[key] = (config_class, dict(getattr(spec, "init_kwargs", {}) or {}))
    return out


def _two_layer_lists(cls, base: dict | None) -> dict:
    """Per-layer lists for 2 layers that keep two of the default model's kinds of layer: the full default config's
    per-layer lists (``layer_types``, ``mlp_layer_types``...) at layer 0 and at the first layer that differs from it
    in any of them (e.g. Qwen3-Next's linear-attention and full-attention layers, Gemma 3's sliding and global ones),
    where the config class computes such lists (None by default)."""
    try:
        full = cls(**(base or {}))
    except Exception:  # a default config that does not construct: nothing to keep
        return {}
    n = next((getattr(full, k) for k in ("num_hidden_layers", "num_layers", "n_layer")
              if _is_int(getattr(full, k, None))), None)
    defaults = _field_defaults(cls)
    lists = {k: getattr(full, k, None) for k, v in defaults.items() if v is None and k != "per_layer_config"}
    lists = {k: list(v) for k, v in lists.items() if isinstance(v, (list, tuple)) and n and len(v) == n and n > 2}
    if not lists:
        return {}
    primary = {k: v for k, v in lists.items() if "mlp" not in k} or lists  # attention kinds first
    other = next((i for i in range(1, n) if any(v[i] != v[0] for v in primary.values())),
                 next((i for i in range(1, n) if any(v[i] != v[0] for v in lists.values())), 1))
    return {k: [v[0], v[other]] for k, v in lists.items()}


def shrunk_kwargs(cls, base: dict | None = None) -> dict:
    """Keyword arguments that make ``cls()`` tiny: :data:`SHRINK` where ``cls`` has the field, dropout 0, router
    logits off, special token ids moved into the reserved top of the vocabulary, starting from ``base``."""
    defaults = {**_field_defaults(cls), **(base or {})}
    kwargs = dict(base or {})
    for name, small in SHRINK.items():
        if name not in defaults:
            continue
        value = defaults[name]
        if (_is_int(value) and value > small) or (value is None and name in SHRINK_EVEN_IF_NONE):
            kwargs[name] = small
        elif name == "head_dim" and _is_int(value):
            kwargs[name] = small
    if "kv_lora_rank" in defaults:  # multi-head latent attention: as many key/value heads as query heads, rotary
        kwargs.update({k: SHRINK["num_attention_heads"] for k in ("num_key_value_heads",) if k in defaults})
        kwargs.update({k: SHRINK["qk_rope_head_dim"] for k in ("head_dim",) if k in defaults})  # over qk_rope dims
    kwargs.update(_two_layer_lists(cls, base))
    vocab = kwargs.get("vocab_size", defaults.get("vocab_size"))
    vocab = vocab if _is_int(vocab) else VOCAB
    slot = vocab - 1
    for name, value in defaults.items():
        if "dropout" in name or "pdrop" in name or name in ("layerdrop", "hidden_dropout", "attention_dropout"):
            if isinstance(value, float) and value:
                kwargs[name] = 0.0
        elif name in ("output_router_logits",) and value:
            kwargs[name] = False
        elif name.endswith(("token_id", "token_index")) and _is_int(value) and value >= vocab - RESERVED:
            kwargs[name], slot = slot, slot - 1
        elif name.endswith("token_ids") and isinstance(value, (list, tuple)):
            ids = []
            for v in value:
                if _is_int(v) and v >= vocab - RESERVED:
                    v, slot = slot, slot - 1
                ids.append(v)
            kwargs[name] = type(value)(ids)
        elif name == "eos_token_id" and isinstance(value, (list, tuple)):
            kwargs[name] = [v if v < vocab - RESERVED else vocab - 1 for v in value]
    return kwargs


def shrunk_config(model_type: str):
    """The config class of ``model_type`` with its defaults shrunk (sub-configs too) and ARCH_OVERRIDES applied."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    overrides = copy.deepcopy(ARCH_OVERRIDES.get(model_type, {}))
    subs = _sub_config_classes(cls)
    text_key = "text_config" if "text_config" in subs else None
    kwargs = {}
    for key, (sub_cls, init_kwargs) in subs.items():
        sub_over = overrides.pop(key, {})
        if key == text_key:
            sub_over = {**{k: v for k, v in overrides.items() if not isinstance(v, dict)}, **sub_over}
        sub_kwargs = {**shrunk_kwargs(sub_cls, init_kwargs), **sub_over}
        kwargs[key] = sub_cls(**sub_kwargs)
    if text_key is not None:
        overrides = {k: v for k, v in overrides.items() if isinstance(v, dict)}
    kwargs = {**shrunk_kwargs(cls), **kwargs, **overrides}
    return cls(**kwargs)


def model_class(class_name: str):
    import transformers

    return getattr(transformers, class_name)


def build(model_type: str, class_name: str, seed: int = 0):
    """(a tiny fp32 eval-mode model of ``model_type``, its stock attention implementation)."""
    config = shrunk_config(model_type)
    cls = model_class(class_name)
    wanted = getattr(cls, "config_class", None)
    if isinstance(wanted, type) and not isinstance(config, wanted):  # e.g. Llama4ForCausalLM of a Llama4Config:
        subs = [getattr(config, key, None) for key in _sub_config_classes(type(config))]  # its text config
        config = next((c for c in subs if isinstance(c, wanted)), config)
    errors = []
    for attn in ("sdpa", "eager"):
        torch.manual_seed(seed)
        try:
            model = cls._from_config(config, attn_implementation=attn, dtype=torch.float32)
        except (ValueError, ImportError) as e:  # no SDPA for this class: eager
            errors.append(e)
            continue
        model = model.float().eval()
        if model_type in POST_BUILD:
            POST_BUILD[model_type](model)
        return model, attn
    raise errors[-1]


def vocab_size(model) -> int:
    """The ids both embeddings accept (the input embedding may be larger, e.g. CPM-Ant's prompt tokens)."""
    sizes = []
    emb = model.get_input_embeddings()
    if isinstance(getattr(emb, "weight", None), torch.Tensor):
        sizes.append(emb.weight.shape[0])
    head = model.get_output_embeddings()
    if isinstance(head, torch.nn.Linear):
        sizes.append(head.out_features)
    return int(min(sizes)) if sizes else VOCAB


def make_batch(model, padding: str, seed: int = 1) -> dict:
    """input_ids from the ordinary ids (never a special token), labels with -100 at padding and one more position;
    an attention mask with ``padding`` ("none": none passed, "left": rows padded 0 / 3 / 5 tokens)."""
    vocab = vocab_size(model)
    g = torch.Generator().manual_seed(seed)
    low, high = min(4, vocab - 1), max(5, vocab - RESERVED)
    ids = torch.randint(low, high, (B, T), generator=g)
    mask = torch.ones(B, T, dtype=torch.long)
    if padding == "left":
        for row, n in enumerate(LEFT_PADDING):
            mask[row, :n] = 0
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, 2] = -100
    if padding == "left":  # nor the first real token (predicted from a padding position, which eager and SDPA
        for row, n in enumerate(LEFT_PADDING):  # attention fill differently: they attend to no key)
            labels[row, n] = -100 if n else labels[row, n]
    batch = {"input_ids": ids, "labels": labels}
    if padding != "none":
        batch["attention_mask"] = mask
    return batch


def _call(model, batch: dict):
    """``model(**batch)`` without a cache (training-style)."""
    params = inspect.signature(model.forward).parameters
    kwargs = dict(batch)
    if "use_cache" in params:
        kwargs["use_cache"] = False
    return model(**kwargs)


# --------------------------------------------------------------------------------------------------------------
# counting the fused ops


@contextlib.contextmanager
def counting():
    """Count calls of fusedlayers.functional's ops (the integration looks them up at call time)."""
    import fusedlayers.functional as flf

    calls = collections.Counter()
    originals = {name: getattr(flf, name) for name in COUNTED}

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(flf, name, counted(name, fn))
    try:
        yield calls
    finally:
        for name, fn in originals.items():
            setattr(flf, name, fn)


class Timeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise Timeout in the main thread after ``seconds`` (SIGALRM; Python-level code only)."""
    if seconds is None or not hasattr(signal, "SIGALRM") or sys.platform == "win32":
        yield
        return

    def handler(signum, frame):
        raise Timeout(f"over the time limit of {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# --------------------------------------------------------------------------------------------------------------
# one architecture


class Check(collections.namedtuple("Check", "padding name fused_err bound ok diff scale")):
    """One tensor's parity: the fused error (against the float64 reference, or stock without one), its bound, whether
    it holds, and max|fused - stock| and max|stock|."""


@dataclasses.dataclass
class Result:
    model_type: str
    class_name: str
    builds: bool = False
    build_error: str = ""
    stock_attention: str = ""
    params: int = 0
    paddings: list = dataclasses.field(default_factory=list)  # paddings the stock model ran
    padding_errors: dict = dataclasses.field(default_factory=dict)
    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    fallbacks: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    apply_warnings: list = dataclasses.field(default_factory=list)
    applied: dict = dataclasses.field(default_factory=dict)  # flt.is_applied
    swapped: dict = dataclasses.field(default_factory=dict)  # part -> sorted class names swapped
    fused_error: str = ""  # an exception raised by the applied model (or apply) where stock ran
    fused_error_in_library: bool = False
    fused_error_trace: str = ""
    reference: str = ""  # "float64", or why not (then fused vs stock within NO_REFERENCE_RTOL)
    reference_loss: str = ""  # how the float64 loss was computed
    loss_kind: str = ""  # stock_loss_kind: "causal" where the stock loss is ForCausalLMLoss
    parity: list = dataclasses.field(default_factory=list)  # [Check]
    reference_nan: set = dataclasses.field(default_factory=set)  # paddings where the float64 copy gave NaN
    candidates: list = dataclasses.field(default_factory=list)  # undetected layers (see find_candidates)
    impl_branches: list = dataclasses.field(default_factory=list)  # see implementation_branches
    seconds: float = 0.0
    timed_out: bool = False

    @property
    def attention_fused(self) -> bool:
        """Every attention call ran our op (at least one)."""
        fused, total = self.attention_calls
        return bool(fused) and fused == total

    @property
    def attention_calls(self) -> tuple[int, int]:
        """(attention calls that ran our op, all attention calls through the integration)."""
        fused = self.calls["scaled_dot_product_attention"] + self.calls["varlen_attention"]
        return fused, fused + sum(self.fallbacks[k] for k in ATTENTION_REASONS)

    @property
    def loss_fused(self) -> bool:
        """Our loss ran and was kept (a model found to post-process its logits runs it once, then discards it)."""
        return bool(self.calls["linear_cross_entropy"]) and not any(self.fallbacks[k] for k in LOSS_REASONS)

    def fused(self, part: str) -> bool:
        c = self.calls
        return {"attention": self.attention_fused, "loss": self.loss_fused,
                "norm": bool(c["rms_norm"] + c["layer_norm"]), "mlp": bool(c["swiglu"] + c["geglu"]),
                "rotary": bool(c["rotary_embedding"])}[part]

    @property
    def parity_ok(self) -> bool | None:
        if not self.parity:
            return None
        return all(c.ok for c in self.parity)

    @property
    def max_rel_diff(self) -> tuple[float, str]:
        """(max|fused - stock| / max|stock|, where) over the loss and the gradients, leaving out gradients that are
        zero up to rounding (max|stock| under REL_DIFF_IGNORE x the largest gradient's: e.g. a key bias's, which the
        softmax cancels; their relative differences are noise over noise)."""
        if not self.parity:
            return 0.0, ""
        top = max(c.scale for c in self.parity if c.name != "loss")
        kept = [c for c in self.parity if c.name == "loss" or c.scale >= REL_DIFF_IGNORE * top]
        worst = max(kept, key=lambda c: c.diff / c.scale if c.scale else (0 if c.diff == 0 else math.inf))
        rel = worst.diff / worst.scale if worst.scale else (0.0 if worst.diff == 0 else math.inf)
        return rel, f"{worst.padding}: {worst.name}"

    @property
    def counted(self) -> bool:
        """Built, and the applied model ran."""
        return self.builds and bool(self.parity) and not self.fused_error


def _short(e: BaseException, limit: int = 160) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ").replace("|", "/")
    return text if len(text) <= limit else text[:limit - 3] + "..."


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _paths(text: str) -> str:
    """Tracebacks without this machine's paths: the repository's files relative to it, installed packages'
    from site-packages."""
    text = re.sub(r"[^\s\"']*[/\\]site-packages[/\\]", "", text)
    return text.replace(ROOT + os.sep, "")


def _library_frame(e: BaseException) -> tuple[bool, str]:
    """(whether the innermost frame of ``e`` is fusedlayers' own code, the last frames as text)."""
    frames = traceback.extract_tb(e.__traceback__)
    in_library = bool(frames) and f"{os.sep}fusedlayers{os.sep}" in frames[-1].filename
    tail = "".join(traceback.format_list(frames[-4:]))
    return in_library, _paths(tail)


def _shifted_cross_entropy(logits, labels):
    """transformers' ForCausalLMLoss (mean over the non-ignored shifted labels), in the logits' dtype."""
    labels = F.pad(labels, (0, 1), value=-100)[..., 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)


def stock_loss_kind(model, batch) -> str:
    """"causal": the model's loss with labels is ForCausalLMLoss of its logits (labels shifted left), as the fused loss
    computes; else "other: ..." (e.g. BART's decoder: cross-entropy of the unshifted labels)."""
    out = _call(model, batch)
    logits = _call(model, {k: v for k, v in batch.items() if k != "labels"}).logits
    if logits is None or logits.shape[:2] != batch["labels"].shape:
        return "other: logits of shape " + ("None" if logits is None else str(tuple(logits.shape)))
    shifted = _shifted_cross_entropy(logits.float(), batch["labels"]).item()
    unshifted = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), batch["labels"].reshape(-1)).item()
    own = out.loss.item()
    if abs(own - shifted) <= 1e-5 * abs(shifted) + 1e-6:
        return "causal"
    if abs(own - unshifted) <= 1e-5 * abs(unshifted) + 1e-6:
        return "other: cross-entropy of the unshifted labels"
    return f"other: {own:.6g} (shifted cross-entropy of its logits: {shifted:.6g})"


def _reference_loss(model, batch, kind: str):
    """(float64 loss, how): transformers' ForCausalLMLoss computed in the logits' dtype (stock's own rounds them to
    fp32) where the model's loss is that (``kind`` "causal"), else the float64 model's own loss."""
    if kind == "causal":
        logits = _call(model, {k: v for k, v in batch.items() if k != "labels"}).logits
        return _shifted_cross_entropy(logits, batch["labels"]), "float64 logits, ForCausalLMLoss in float64"
    return _call(model, batch).loss, "the float64 model's own loss"


def _float64_copy(stock, batch, result: Result):
    """A float64 copy of ``stock`` that runs ``batch`` (its Llama/Gemma RMSNorms in float64; MoE experts as the eager
    loop where grouped_mm has no float64), or None (``result.reference`` says why)."""
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    error = None
    for experts in (None, "eager"):
        try:
            reference = float64_hf_norms(copy.deepcopy(stock).double())
            if experts is not None:
                reference.set_experts_implementation(experts)
            _call(reference, inputs)
            result.reference = "float64" + ("" if experts is None else " (experts: eager)")
            return reference
        except Timeout:
            raise
        except Exception as e:
            error = error or e
    result.reference = "no float64 copy: " + _short(error, 100)
    return None


def _warning_reason(message: str) -> str:
    """A warning from flt.apply, without the model's name: "cannot switch its attention implementation (...)"."""
    message = message.split(";")[0]
    return re.sub(r"^fusedlayers: \S+ ", "", message)


def _zero_grads(*models):
    for m in models:
        if m is not None:
            m.zero_grad(set_to_none=True)


def _check(result: Result, padding: str, name: str, fused, stock, ref, floor=None):
    """Append the parity check of one tensor: fused error against ``ref`` at most 2x stock's plus ``floor``
    (tests/parity.py's rule), or, without a usable reference, fused within NO_REFERENCE_RTOL of stock."""
    fused, stock = fused.detach(), stock.detach()
    scale = stock.abs().max().item() if stock.numel() else 0.0
    diff = max_error(fused, stock)
    floor = FLOOR[fused.dtype] if floor is None else floor
    if ref is not None and bool((ref.isnan() & ~stock.isnan()).any()):  # a float64 model that overflows (eager
        result.reference_nan.add(padding)  # attention's float64 mask in an fp32 softmax): no reference
        ref = None
    if ref is not None:
        ref = ref.detach()
        fused_err, stock_err = max_error(fused, ref), max_error(stock, ref)
        bound = 2 * stock_err + floor
    else:
        fused_err, bound = diff, NO_REFERENCE_RTOL * scale + floor
    result.parity.append(Check(padding, name, fused_err, bound, fused_err <= bound, diff, scale))  # NaN fails


def run_arch(model_type: str, class_name: str, paddings=("none", "left"), time_limit_s: float = TIME_LIMIT_S,
             candidates: bool = True) -> Result:
    """Build, apply, compare; never raises (everything goes into the Result)."""
    result = Result(model_type, class_name)
    start = time.perf_counter()
    try:
        with time_limit(time_limit_s):
            _run_arch(result, paddings, candidates)
    except Timeout as e:
        result.timed_out = True
        if not result.builds:
            result.build_error = result.build_error or _short(e)
        elif not result.fused_error:
            result.fused_error = _short(e)
    except Exception as e:  # recorded, never stops the sweep
        if not result.builds:
            result.build_error = result.build_error or _short(e)
        else:
            result.fused_error = result.fused_error or _short(e)
            result.fused_error_trace = _paths(traceback.format_exc(limit=-6))
    finally:
        result.seconds = time.perf_counter() - start
    return result


def _run_arch(result: Result, paddings, candidates: bool) -> None:
    from fusedlayers.integrations import transformers as flt

    # 1. the stock model, its copies (before any forward: some models keep non-leaf state), and the stock forward
    #    (+ backward) with labels of each batch
    try:
        stock, result.stock_attention = build(result.model_type, result.class_name)
    except Exception as e:
        result.build_error = _short(e)
        return
    result.params = sum(p.numel() for p in stock.parameters())
    fused = copy.deepcopy(stock)
    reference = copy.deepcopy(stock)
    batches = {}
    for padding in paddings:
        batch = make_batch(stock, padding)
        try:
            out = _call(stock, batch)
            if out.loss is None or not torch.isfinite(out.loss):
                raise RuntimeError(f"stock loss is {out.loss}")
            out.loss.backward()
        except Timeout:
            raise
        except Exception as e:
            result.padding_errors[padding] = _short(e)
            continue
        batches[padding] = batch
    _zero_grads(stock)
    if "none" not in batches:
        result.build_error = "stock forward with labels fails: " + result.padding_errors.get("none", "?")
        return
    with torch.no_grad():
        result.loss_kind = stock_loss_kind(stock, batches["none"])
    result.builds = True
    result.paddings = list(batches)

    # 2. the applied copy and the float64 reference
    flt.fallbacks.clear()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                flt.apply(fused)
            except Exception as e:
                result.fused_error = f"apply: {_short(e)}"
                result.fused_error_in_library, result.fused_error_trace = _library_frame(e)
                return
        result.apply_warnings = sorted({_warning_reason(str(w.message)) for w in caught
                                        if "fusedlayers" in str(w.message)})
        result.applied = flt.is_applied(fused)
        state = fused.__dict__.get(flt._STATE, {})
        for part in ("norm", "mlp"):
            result.swapped[part] = sorted({type(m).__name__ for m in state.get(part, ())})
        result.swapped["rotary"] = list(state.get("rotary", ((), ()))[0])
        reference = _float64_copy(reference, batches["none"], result)

        # 3. the same batches through the three models
        for padding, batch in batches.items():
            _zero_grads(fused, stock, reference)
            with counting() as calls:
                try:
                    out = _call(fused, batch)
                    out.loss.backward()
                except Timeout:
                    raise
                except Exception as e:
                    result.fused_error = f"{padding}: {_short(e)}"
                    result.fused_error_in_library, result.fused_error_trace = _library_frame(e)
                    return
            result.calls.update(calls)
            stock_loss = _call(stock, batch).loss
            stock_loss.backward()
            ref_loss = None
            if reference is not None:
                try:
                    ref_loss, result.reference_loss = _reference_loss(reference, batch, result.loss_kind)
                    ref_loss.backward()
                except Timeout:
                    raise
                except Exception as e:
                    reference, ref_loss, result.reference = None, None, "float64 copy fails: " + _short(e, 100)
            _check(result, padding, "loss", out.loss, stock_loss, ref_loss,
                   floor=loss_floor(stock_loss, ref_loss if ref_loss is not None else stock_loss))
            ref_params = dict(reference.named_parameters()) if reference is not None else {}
            for name, p in stock.named_parameters():
                q = fused.get_parameter(name)
                if p.grad is None and q.grad is None:
                    continue
                if (p.grad is None) != (q.grad is None):
                    result.parity.append(Check(padding, name + " (gradient on one side only)", math.inf, 0.0, False,
                                               math.inf, 1.0))
                    continue
                r = ref_params.get(name)
                _check(result, padding, name, q.grad, p.grad, None if r is None else r.grad)
        if candidates:
            result.candidates = find_candidates(fused, state)
            result.impl_branches = implementation_branches(fused)
    finally:
        result.fallbacks = collections.Counter(flt.fallbacks)
        flt.fallbacks.clear()
        flt.revert(fused)


# --------------------------------------------------------------------------------------------------------------
# layers the integration does not swap: are they mathematically what our ops compute?


def _llama_rms(x, w, eps):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _classify_norm(module) -> str:
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 1:
        return "no 1-D weight"
    eps = next((getattr(module, a) for a in ("variance_epsilon", "eps", "epsilon", "rms_norm_eps")
                if isinstance(getattr(module, a, None), float)), None)
    if eps is None:
        return "no eps attribute"
    m = copy.deepcopy(module).double()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        m.weight.copy_(torch.randn(m.weight.shape, generator=g, dtype=torch.float64) * 0.5)
        bias = getattr(m, "bias", None)
        if isinstance(bias, torch.Tensor):
            bias.copy_(torch.randn(bias.shape, generator=g, dtype=torch.float64))
        x = torch.randn(2, 5, w.shape[0], generator=g, dtype=torch.float64) * 3 + 0.5
        try:
            y = m(x)
        except Exception as e:
            return f"forward({type(e).__name__})"
        if isinstance(y, tuple):
            y = y[0]
        y = y.double()
        weight = m.weight
        forms = {"Llama RMSNorm": _llama_rms(x, weight, eps), "Gemma (1 + w) RMSNorm": _llama_rms(x, 1 + weight, eps),
                 "unit-weight RMSNorm": _llama_rms(x, torch.ones_like(weight), eps)}
        if isinstance(bias, torch.Tensor):
            forms["LayerNorm"] = F.layer_norm(x, weight.shape, weight, bias, eps)
        else:
            forms["LayerNorm without bias"] = F.layer_norm(x, weight.shape, weight, None, eps)
        for name, want in forms.items():
            if y.shape == want.shape and torch.allclose(y, want, rtol=1e-5, atol=1e-6):
                return "= " + name
    return "other"


def _classify_mlp(module) -> str:
    act = getattr(module, "act_fn", None) or getattr(module, "activation_fn", None) or getattr(module, "act", None)
    act_name = type(act).__name__ if act is not None else "?"
    hidden = None
    for attr in ("gate_proj", "gate_up_proj", "up_proj", "fc1", "w1", "c_fc"):
        lin = getattr(module, attr, None)
        if isinstance(lin, torch.nn.Linear):
            hidden = lin.in_features
            break
    if hidden is None:
        return f"no gate/up Linear (act {act_name})"
    m = copy.deepcopy(module).double()
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, hidden, generator=g, dtype=torch.float64)
    with torch.no_grad():
        try:
            y = m(x)
        except Exception as e:
            return f"forward({type(e).__name__}; act {act_name})"
        y = y[0] if isinstance(y, tuple) else y
        down = getattr(m, "down_proj", None) or getattr(m, "fc2", None) or getattr(m, "w2", None)
        if not isinstance(down, torch.nn.Linear):
            return f"no down Linear (act {act_name})"
        if isinstance(getattr(m, "gate_up_proj", None), torch.nn.Linear):
            gate, up = m.gate_up_proj(x).chunk(2, dim=-1)
            forms = {"SwiGLU (fused gate_up_proj, [gate, up])": (gate, up), "SwiGLU (fused gate_up_proj, [up, gate])":
                     (up, gate)}
        elif isinstance(getattr(m, "gate_proj", None), torch.nn.Linear) and isinstance(getattr(m, "up_proj", None),
                                                                                      torch.nn.Linear):
            forms = {"SwiGLU (gate_proj, up_proj)": (m.gate_proj(x), m.up_proj(x))}
        elif isinstance(getattr(m, "w1", None), torch.nn.Linear) and isinstance(getattr(m, "w3", None),
                                                                                torch.nn.Linear):
            forms = {"SwiGLU (w1, w3)": (m.w1(x), m.w3(x))}
        else:
            return f"not gated (act {act_name})"
        for name, (gate, up) in forms.items():
            want = down(F.silu(gate) * up)
            if y.shape == want.shape and torch.allclose(y, want, rtol=1e-6, atol=1e-9):
                return "= " + name
    return f"other gated (act {act_name})"


def _classify_rotary(fn) -> str:
    """What ``fn(q, k, cos, sin)`` computes, against transformers' Llama apply_rotary_pos_emb (rotate_half)."""
    from fusedlayers.integrations import transformers as flt

    llama = flt._stock_llama_rotary()
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 5, 16, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 5, 16, generator=g, dtype=torch.float64)

    def angles(width):
        a = torch.randn(2, 5, width // 2, generator=g, dtype=torch.float64)
        a = torch.cat((a, a), -1)
        return a.cos(), a.sin()

    def same(got, want):
        return all(a.shape == b.shape and torch.allclose(a.double(), b, rtol=1e-9, atol=1e-12)
                   for a, b in zip(got, want, strict=True))

    cos, sin = angles(16)
    try:
        got = fn(q, k, cos, sin)
    except Exception as e:
        return f"other signature ({type(e).__name__})"
    try:
        if not same(got, llama(q, k, cos, sin)):
            return "other (e.g. interleaved pairs, another rotate_half)"
    except Exception:
        return "other output"
    cos, sin = angles(8)  # partial rotary: cos/sin over the first 8 of 16 dims
    try:
        q8, k8 = llama(q[..., :8], k[..., :8], cos, sin)
        if same(fn(q, k, cos, sin), (torch.cat((q8, q[..., 8:]), -1), torch.cat((k8, k[..., 8:]), -1))):
            return "= Llama rotary; partial (rotates the first cos.shape[-1] dims, passes the rest)"
    except Exception:
        pass
    return "= Llama rotary"


IMPL_BRANCH = re.compile(r"_attn_implementation\s*(?:==|!=|not in|in)\s*(?:\([^)]*\)|\"[^\"]*\"|'[^']*')")


def implementation_branches(model) -> list:
    """The lines of the model's modeling modules that compare ``_attn_implementation`` with names ("eager", "sdpa"
    ...): under "fusedlayers" such code takes the branch for other implementations (flash attention's, usually)."""
    out = []
    for name in sorted({type(m).__module__ for m in model.modules()}):
        if not name.startswith("transformers.models."):
            continue
        try:
            source = inspect.getsource(sys.modules[name])
        except (OSError, TypeError, KeyError):
            continue
        for line in source.splitlines():
            if IMPL_BRANCH.search(line):
                out.append(f"{name.rsplit('.', 1)[-1]}: {line.strip()}")
    return out


def diagnose(r: Result) -> list:
    """Likely causes of a parity failure or an exception, from what the run recorded."""
    out = []
    if r.loss_kind and r.loss_kind != "causal" and r.calls["linear_cross_entropy"]:
        out.append(f"the stock loss is not ForCausalLMLoss ({r.loss_kind[7:]}) but the fused loss ran: it computes "
                   "ForCausalLMLoss (labels shifted left), or the unshifted cross-entropy where the forward's source "
                   "is that")
    for kind, name, what in r.candidates:
        if what.startswith("SWAPPED"):
            out.append(f"{kind} `{name}` was swapped, {what[9:]}")
    sparse = [b for b in r.impl_branches if '("eager", "sdpa")' in b]
    if sparse:
        out.append("the model branches on its attention implementation's name (`" + sparse[0].split(": ", 1)[1]
                   + "`): under \"fusedlayers\" it skips the eager/SDPA branch (here the sparse top-k index mask; "
                   "the attention function gets `indices=` instead, and ignores it)")
    if r.stock_attention == "eager" and r.parity_ok is False and r.attention_calls[1] and not out:
        out.append("possibly: an eager-only model (no SDPA): under \"fusedlayers\" its code gets the boolean masks "
                   "of SDPA's mask builder where it was written for eager's additive float masks (DeepSeek-V4 "
                   "concatenates its float block bias onto the mask with `.to(attention_mask.dtype)`: to bool, that "
                   "inverts it)")
    if "modified inplace" in r.fused_error:
        out.append("the model modifies a fused norm's output in place (fl.layer_norm / fl.rms_norm return a view "
                   "of a multi-output autograd function)")
    if "positions of hidden states" in r.fused_error:
        out.append("the output embedding gets more rows than there are labels (ProphetNet's n-gram streams); the "
                   "fused loss raises instead of falling back to stock")
    return out


def find_candidates(model, state) -> list:
    """[(kind, class name, classification)] of the norm / MLP / expert / rotary code the integration left stock."""
    from fusedlayers.integrations import transformers as flt

    swapped = {id(m) for part in ("norm", "mlp") for m in state.get(part, ())}
    seen, out = set(), []
    for m in model.modules():
        cls = type(m)
        if id(m) in swapped or cls in seen or cls.__module__.startswith("torch."):
            continue
        name = cls.__name__
        lname = name.lower()
        kind = None
        if "norm" in lname and isinstance(getattr(m, "weight", None), torch.Tensor):
            kind = "norm"
        elif "experts" in lname:
            kind = "experts"
        elif (lname.endswith(("mlp", "feedforward", "ffn")) or "mlp" in lname) and not list(m.children()) == []:
            kind = "mlp"
        if kind is None:
            continue
        seen.add(cls)
        try:
            with time_limit(None):
                if kind == "norm":
                    what = _classify_norm(m)
                elif kind == "mlp":
                    what = _classify_mlp(m)
                else:
                    act = getattr(m, "act_fn", None)
                    what = f"act {type(act).__name__ if act is not None else '?'}" + (
                        ", gate_up_proj " + "x".join(map(str, m.gate_up_proj.shape))
                        if isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) else "")
        except Exception as e:
            what = f"error {type(e).__name__}"
        out.append((kind, name, what))
    patched = set(state.get("rotary", ((), ()))[0])
    for modname in sorted({type(m).__module__ for m in model.modules()}):
        mod = sys.modules.get(modname)
        fn = getattr(mod, "apply_rotary_pos_emb", None)
        if fn is None or not modname.startswith("transformers."):
            continue
        fn = getattr(fn, "__wrapped__", fn)
        what = _classify_rotary(fn)
        if modname in patched:  # swapped: its own function had better compute what ours does
            if what.startswith("= Llama rotary"):
                continue
            what = "SWAPPED, but its own function computes: " + what
        out.append(("rotary", modname.rsplit(".", 1)[-1] + ".apply_rotary_pos_emb", what))
    # the swapped norms and MLPs, checked the same way
    for m in state.get("norm", ()):
        if type(m) not in seen and type(m) is not torch.nn.LayerNorm:
            seen.add(type(m))
            clone = copy.deepcopy(m)
            clone.__dict__.pop("forward", None)  # its class's forward, not ours
            what = _classify_norm(clone)
            if not what.startswith(("= Llama RMSNorm", "= Gemma")):
                out.append(("norm", type(m).__name__, "SWAPPED, but its own forward computes: " + what))
    for m in state.get("mlp", ()):
        if type(m) not in seen:
            seen.add(type(m))
            clone = copy.deepcopy(m)
            clone.__dict__.pop("forward", None)
            what = _classify_mlp(clone)
            if not what.startswith("= SwiGLU"):
                out.append(("mlp", type(m).__name__, "SWAPPED, but its own forward computes: " + what))
    del flt
    return out


# --------------------------------------------------------------------------------------------------------------
# the sweep and its report


def architectures() -> dict:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def sweep(only=None, time_limit_s: float = TIME_LIMIT_S, log=print) -> list[Result]:
    results = []
    for model_type, class_name in architectures().items():
        if only and model_type not in only:
            continue
        r = run_arch(model_type, class_name, time_limit_s=time_limit_s)
        results.append(r)
        if log:
            log(f"{model_type:28s} {summary_line(r)} ({r.seconds:.1f} s)")
    return results


def parts_text(r: Result) -> str:
    return "/".join(p for p in ("norm", "mlp", "rotary") if r.fused(p)) or "-"


def _ratio(c: Check) -> float:
    return c.fused_err / c.bound if c.bound else (0.0 if c.fused_err == 0 else math.inf)


def parity_text(r: Result) -> str:
    if r.parity_ok is None:
        return "-"
    rel, _ = r.max_rel_diff
    note = "" if r.reference.startswith("float64") else " (no float64 copy)"
    if r.reference_nan:
        note += f" (float64 copy NaN with {'/'.join(sorted(r.reference_nan))} padding: fused vs stock there)"
    if r.parity_ok:
        return f"pass ({rel:.1e}){note}"
    bad = [c for c in r.parity if not c.ok]
    worst = max(bad, key=_ratio)
    return (f"**FAIL** {len(bad)} of {len(r.parity)} ({worst.padding}: {worst.name}: error {worst.fused_err:.1e} > "
            f"bound {worst.bound:.1e}) ({rel:.1e}){note}")


def fallback_text(r: Result) -> str:
    items = [f"{k} x{v}" for k, v in sorted(r.fallbacks.items())]
    items += [f"warn: {w}" for w in r.apply_warnings]
    return ", ".join(items) or "-"


def summary_line(r: Result) -> str:
    if not r.builds:
        return f"does not build: {r.build_error}"
    if r.fused_error:
        return f"FUSED ERROR{' (in fusedlayers)' if r.fused_error_in_library else ''}: {r.fused_error}"
    return (f"attn {'Y' if r.attention_fused else 'n'} loss {'Y' if r.loss_fused else 'n'} "
            f"layers {parts_text(r)} fallbacks {fallback_text(r)} parity {parity_text(r)}")


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def render(results: list[Result], header: dict) -> str:
    n = len(results)
    built = [r for r in results if r.builds]
    ran = [r for r in built if r.counted]
    both = [r for r in ran if r.attention_fused and r.loss_fused and r.parity_ok]
    att = [r for r in ran if r.attention_fused]
    partly = [r for r in ran if not r.attention_fused and r.attention_calls[0]]
    loss = [r for r in ran if r.loss_fused]
    passing = [r for r in ran if r.parity_ok]

    def pct(k, d):
        return f"{k} ({100 * k / d:.0f}%)" if d else f"{k}"

    lines = [
        "# transformers coverage of the fusedlayers integration, CPU",
        "",
        f"{header['date']}, {header['device']}, torch {header['torch']}, transformers {header['transformers']}, "
        f"commit {header['commit']}{header.get('dirty', '')}. Command (from the repository root):",
        "",
        f"    {header['command']}",
        "",
        "What was measured: every causal-LM architecture in the installed transformers "
        "(`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`, model_type -> class), built from its config class's defaults shrunk "
        f"to a tiny model (hidden 64, 2 layers, 4 heads / 2 KV heads, head_dim 16, FFN 128, vocab {VOCAB}, experts 4 "
        "/ 2 per token; `tests/transformers_coverage.py`: `SHRINK`, `ARCH_OVERRIDES`), fp32, eval mode, "
        "stock attention `sdpa` (`eager` where the class has none). An applied deep copy (`flt.apply`) and the "
        f"untouched model get the same batches ({B} x {T} tokens; labels -100 at one position, at the padding and at "
        "each left-padded row's first real token, which a padding position predicts): "
        "without an attention mask, and with left padding (0 / 3 / 5 tokens) where the stock model accepts it. "
        "Recorded: which fused ops ran (calls of `fusedlayers.functional`'s `scaled_dot_product_attention` / "
        "`varlen_attention` = attention, `linear_cross_entropy` = loss, `rms_norm` / `layer_norm` = norm, `swiglu` "
        "/ `geglu` = mlp, `rotary_embedding` = rotary; the loss counts as fused where its result was kept, attention "
        "where every attention call ran our op), `flt.fallbacks` (counts over both batches' forwards; `warn:` = a "
        "warning from `apply`), and parity of the loss and every parameter gradient: the fused fp32 "
        "model's error against a float64 copy of the stock model (its Llama/Gemma RMSNorms in float64, "
        "tests/parity.py's `float64_hf_norms`; the loss from its float64 logits where the model's loss is "
        "`ForCausalLMLoss`) at most 2x the stock fp32 model's error plus a floor (fp32: 1e-6; the loss: 1e-6 x its "
        f"magnitude), tests/parity.py's rule; without a float64 copy, fused vs stock within {NO_REFERENCE_RTOL:g} "
        "of the tensor's max. The parity column gives max|fused - stock| / max|stock| over the loss and the "
        f"gradients (leaving out gradients that are zero up to rounding: max|stock| under {REL_DIFF_IGNORE:g} x the "
        "largest gradient's). Where the float64 copy gives NaN (eager attention's float64 mask in an fp32 softmax, "
        "with left padding), that batch compares fused with stock as without a copy. \"does not build\": the "
        "stock model does not build or run from the shrunk default config (per-architecture fixes are in "
        f"`ARCH_OVERRIDES`). Time limit {header['time_limit']} s an architecture; the sweep took "
        f"{header['seconds']:.0f} s (a first run after installing transformers also compiles its modules: minutes).",
        "",
        "## Summary",
        "",
        f"- architectures in transformers {header['transformers']}: **{n}**",
        f"- build from a shrunk default config (stock forward and backward with labels run): **{pct(len(built), n)}**",
        f"- applied model ran (no exception): {pct(len(ran), len(built))} of those built",
        f"- attention fused (every attention call): {pct(len(att), len(built))} of those built (some calls: "
        f"{len(partly)} more); loss fused: {pct(len(loss), len(built))}; parity passing: "
        f"{pct(len(passing), len(built))}",
        f"- **attention AND loss fused, parity passing: {pct(len(both), len(built))} of those built** "
        f"({pct(len(both), n)} of all)",
    ]
    for part in ("norm", "mlp", "rotary"):
        k = sum(r.fused(part) for r in ran)
        lines.append(f"- {part} fused: {pct(k, len(built))} of those built")
    errors = [r for r in built if r.fused_error]
    if errors:
        lines.append(f"- applied model raised where stock ran: {len(errors)} ("
                     + ", ".join(f"{r.model_type}{' [in fusedlayers]' if r.fused_error_in_library else ''}"
                                 for r in errors) + ")")
    fails = [r for r in ran if r.parity_ok is False]
    if fails:
        lines.append("- parity failing: " + ", ".join(r.model_type for r in fails))
    diagnosed = [(r, diagnose(r)) for r in built if r.parity_ok is False or r.fused_error]
    if diagnosed:
        lines += ["", "## Parity failures and exceptions: likely causes", "",
                  "From what the run recorded (`diagnose` in the script); see the per-architecture table for the "
                  "numbers.", ""]
        for r, causes in diagnosed:
            lines.append(f"- **{r.model_type}**: " + ("; ".join(causes) if causes else "not diagnosed"))

    reasons = collections.defaultdict(list)
    for r in built:
        for k in r.fallbacks:
            reasons[k].append(r.model_type)
        for w in r.apply_warnings:
            reasons["warn: " + w].append(r.model_type)
        if r.counted and not r.attention_calls[1] and not any("attention" in w for w in r.apply_warnings):
            reasons["attention never called (no AttentionInterface call, e.g. a recurrent model)"].append(
                r.model_type)
    lines += ["", "## Fallback reasons (architectures affected, most common first)", "",
              "| reason | architectures | which |", "|---|---|---|"]
    for k, archs in sorted(reasons.items(), key=lambda kv: (-len(kv[1]), kv[0])):
        lines.append(f"| {k} | {len(archs)} | {', '.join(archs)} |")

    lines += ["", "## Per architecture", "",
              "| architecture | class | builds | attention fused | loss fused | layers fused | fallbacks | "
              "parity (max rel. diff) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        if not r.builds:
            lines.append(f"| {r.model_type} | {r.class_name} | does not build: {r.build_error} | | | | | |")
            continue
        stock = r.stock_attention + ("" if "left" in r.paddings else "; no left padding")
        builds = f"yes ({stock}, {r.params / 1e6:.2f}M)"
        if r.fused_error:
            where = "in fusedlayers" if r.fused_error_in_library else "in transformers"
            lines.append(f"| {r.model_type} | {r.class_name} | {builds} | | | | applied model raised ({where}): "
                         f"{r.fused_error} | |")
            continue
        loss = _yes(r.loss_fused) + ("" if r.loss_kind == "causal" else f" (stock loss: {r.loss_kind[7:]})")
        fused, total = r.attention_calls
        attention = "yes" if fused and fused == total else f"partly ({fused} of {total} calls)" if fused else "no"
        lines.append(f"| {r.model_type} | {r.class_name} | {builds} | {attention} | "
                     f"{loss} | {parts_text(r)} | {fallback_text(r)} | {parity_text(r)} |")

    cand = collections.defaultdict(list)
    for r in ran:
        for kind, name, what in r.candidates:
            cand[(kind, what)].append(f"{r.model_type}:{name}")
    lines += ["", "## Layers left stock, by what they compute", "",
              "Norm, MLP and expert classes and `apply_rotary_pos_emb` functions the integration did not swap, "
              "classified numerically (float64, random weights): `= Llama RMSNorm` etc. means the module's output "
              "equals that formula, i.e. our op could run it; `other` means it does not (or needs other inputs).",
              "", "| kind | computes | count | architecture:class |", "|---|---|---|---|"]
    for (kind, what), where in sorted(cand.items(), key=lambda kv: (kv[0][0], -len(kv[1]), kv[0][1])):
        lines.append(f"| {kind} | {what} | {len(where)} | {', '.join(where)} |")

    library = [r for r in built if r.fused_error]
    if library:
        lines += ["", "## Exceptions from applied models", ""]
        for r in library:
            where = "innermost frame in fusedlayers" if r.fused_error_in_library else "raised in transformers code"
            lines += [f"- **{r.model_type}** ({where}): `{r.fused_error}`", "", "```", r.fused_error_trace.strip(),
                      "```", ""]
    return "\n".join(lines) + "\n"


def _git(*args) -> str:
    try:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()
    except Exception:
        return "?"


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# --------------------------------------------------------------------------------------------------------------
# cast_once under autocast


def cast_once_check(model_type: str, class_name: str) -> tuple[str, float]:
    """One step of the stock model and of a copy applied with ``cast_once`` alone (every input shared, whatever its
    size), under bf16 autocast on the CPU: ("bitwise" | "differs" | "stock fails" | "does not build" | "error: ...",
    the largest relative difference of a gradient, ||fused - stock|| / ||stock||)."""
    from fusedlayers.integrations import transformers as flt

    try:
        stock, _ = build(model_type, class_name)
    except Exception:
        return "does not build", 0.0
    batch = make_batch(stock, "none")
    fused = flt.apply(copy.deepcopy(stock), **{**dict.fromkeys(flt._PARTS, False), "cast_once": True})
    steps = []
    for model in (stock, fused):
        try:
            with torch.autocast("cpu", torch.bfloat16):
                loss = _call(model, batch).loss
            loss.backward()
        except Exception as e:
            return ("stock fails" if model is stock else f"error: {_short(e)}"), 0.0
        steps.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss, grads), (fused_loss, fused_grads) = steps
    if grads.keys() != fused_grads.keys():
        return "error: other parameters got gradients", 0.0
    worst = max(((fused_grads[n].float() - g.float()).norm() / g.float().norm().clamp_min(1e-30)).item()
                for n, g in grads.items())
    same = torch.equal(loss, fused_loss) and all(torch.equal(fused_grads[n], g) for n, g in grads.items())
    return ("bitwise" if same else "differs"), worst


def cast_once_sweep(only=None, log=print) -> list[tuple[str, str, float]]:
    from fusedlayers.integrations import transformers as flt

    threshold, flt.CAST_ONCE_MIN_ELEMENTS = flt.CAST_ONCE_MIN_ELEMENTS, 0  # tiny models: share every input
    try:
        rows = []
        for model_type, class_name in architectures().items():
            if not only or model_type in only:
                rows.append((model_type, *cast_once_check(model_type, class_name)))
                if log:
                    log(f"{model_type:28s} {rows[-1][1]} {rows[-1][2]:.1e}")
        return rows
    finally:
        flt.CAST_ONCE_MIN_ELEMENTS = threshold


def render_cast_once(rows, header: dict) -> str:
    ran = [r for r in rows if r[1] in ("bitwise", "differs")]
    count = collections.Counter(r[1] for r in rows)
    lines = [
        "# `cast_once` under autocast, every causal-LM architecture, CPU", "",
        f"{header['date']}, {header['device']}, torch {header['torch']}, transformers {header['transformers']}, "
        f"commit {header['commit']}{header['dirty']}. Command (from the repository root):", "",
        f"    {header['command']}", "",
        "Each architecture's tiny model (the coverage sweep's `build`, `make_batch` without padding) and a deep copy "
        "applied with `cast_once` alone (the size threshold off, so every shared input is shared) take one step "
        "(forward with labels, backward) under bf16 autocast on the CPU. bitwise: the loss and every gradient equal "
        "the stock model's bit for bit. differs: the loss or a gradient does not (worst: the largest "
        "||fused - stock|| / ||stock|| of a gradient). Where a shared input also feeds something else than the linear "
        "layers sharing it (a residual, a parallel block), autograd adds that gradient in between the children's, "
        "which the shared cast sums first: the same fp32 terms in another order, an fp32 rounding apart, which a "
        "later 16-bit rounding in the backward can make a 16-bit one. stock fails: the stock model does not run "
        "under CPU autocast.", "",
        f"- architectures: {len(rows)}; ran under autocast: {len(ran)}; bitwise: {count['bitwise']}; differs: "
        f"{count['differs']}; stock fails: {count['stock fails']}; does not build: {count['does not build']}; "
        f"errors of ours: {sum(r[1].startswith('error') for r in rows)}",
        f"- the largest difference where it differs: "
        f"{max((r[2] for r in rows if r[1] == 'differs'), default=0.0):.1e}", "",
        "| architecture | result | worst gradient difference |", "|---|---|---|",
        *(f"| {t} | {result} | {worst:.1e} |" for t, result, worst in rows if result != "bitwise"), "",
        f"Every other architecture: bitwise. The sweep took {header['seconds']:.0f} s.", "",
    ]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="write the Markdown report here")
    parser.add_argument("--only", nargs="*", help="model types to run (default: all)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S, help="seconds an architecture")
    parser.add_argument("--cast-once", action="store_true",
                        help="instead: cast_once under bf16 autocast against stock (bitwise or how far)")
    args = parser.parse_args(argv)

    import transformers

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    import logging

    logging.getLogger("fusedlayers").setLevel(logging.ERROR)
    start = time.perf_counter()
    log = lambda s: print(s, flush=True)  # noqa: E731
    results = cast_once_sweep(args.only, log) if args.cast_once else sweep(args.only, args.time_limit, log=log)
    header = dict(
        date=datetime.date.today().isoformat(),
        device=f"this machine's CPU ({_cpu()}, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads)",
        torch=torch.__version__, transformers=transformers.__version__, commit=_git("rev-parse", "--short", "HEAD"),
        dirty=" (with uncommitted changes in the working tree)" if _git("status", "--porcelain", "--", "fusedlayers")
        else "",
        command="python -m tests.transformers_coverage " + " ".join(sys.argv[1:] if argv is None else argv),
        time_limit=f"{args.time_limit:g}", seconds=time.perf_counter() - start,
    )
    text = render_cast_once(results, header) if args.cast_once else render(results, header)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
        print(f"wrote {args.out}")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
