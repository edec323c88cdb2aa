"""The choices for each pluggable part of the GPT, one registry entry per choice.

Adding a choice is one ``REGISTRY.register(name)(impl)`` line. The ``stock`` choices use PyTorch only;
the fused ones import ``fusedlayers`` lazily (on first call), so the stock paths never depend on it.

Interfaces (all tensors (B, H, T, D) for attention):

- ``SOFTMAX[name](scores, scale) -> probs``: causal (top-left) ``softmax(scores * scale)`` over the last dim.
- ``ATTENTION[name](q, k, v, dropout_p, softmax, window=None) -> y``: causal attention (``window`` w: each query
  sees itself and the w keys before it, ``model.window``); ``softmax`` is the
  ``SOFTMAX`` choice (only the ``stock`` attention, which spells the math out, uses it).
- ``LOSS[name](hidden (N, C), weight (V, C), targets (N,), label_smoothing) -> mean loss``: cross entropy of
  ``hidden @ weight.T`` against ``targets`` (``-100`` = ignore).
- ``QUANT[name](model, act_bits) -> None``: prepares ``model``'s Linear layers in place for
  quantization-aware training (the same parameters; the LM head, tied to the embedding, stays float).
- ``CHECKPOINT[name](block) -> nn.Module``: the transformer block, wrapped for activation checkpointing
  (``fl.CheckpointedBlock`` keeps the block's parameter names); ``selective`` keeps matmul/attention outputs
  and attention probabilities and recomputes the cheap ops.
- ``POSITION[name](config) -> nn.Module`` with ``embed(x, positions=None)`` (add position information to token
  embeddings (B, T, C)) and ``rotate(q, k, positions=None)`` (apply it to queries (B, H, T, D) and keys
  (B, H_kv, T, D)); ``positions`` (T,): each token's position when not 0..T-1 (packed documents).
- ``NORM[name](config) -> nn.Module`` with parameters ``weight`` (and ``bias`` for LayerNorm with
  ``model.bias``) and ``forward(x, residual=None)``; with a residual it returns ``(norm(x + residual),
  x + residual)``: the pre-norm block's residual add, one kernel in the fused choices (which under autocast also
  write the normalized output in the autocast dtype the next matmul reads).
- ``MLP[name](config) -> nn.Module``: the block's feed-forward (B, T, C) -> (B, T, C).

Fused choices are named ``fused_<stock twin>`` where the stock twin is not ``stock`` (norm, mlp, position): the
same parameters and the same math, computed by fusedlayers' kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.registry import Registry

SOFTMAX = Registry("model.softmax", "the softmax inside `stock` attention")
ATTENTION = Registry("model.attention", "causal self-attention core")
LOSS = Registry("model.loss", "language-model head + cross entropy")
QUANT = Registry("model.quant", "quantization-aware training of the Linear layers")
CHECKPOINT = Registry("model.checkpoint", "activation checkpointing")
POSITION = Registry("model.position", "position information")
NORM = Registry("model.norm", "the blocks' and the final normalization")
MLP = Registry("model.mlp", "the blocks' feed-forward")

REGISTRIES = {
    r.key.split(".", 1)[1]: r for r in (ATTENTION, SOFTMAX, LOSS, QUANT, CHECKPOINT, POSITION, NORM, MLP)
}


def _fl():
    import fusedlayers

    return fusedlayers


# --------------------------------------------------------------------------------------------- softmax
_causal_masks: dict[tuple[int, int, torch.device], Tensor] = {}


def causal_mask(L: int, S: int, device: torch.device) -> Tensor:
    """Bool (L, S), True = keep: query i sees keys j <= i (top-left aligned, as SDPA's is_causal)."""
    key = (L, S, device)
    mask = _causal_masks.get(key)
    if mask is None:
        mask = _causal_masks[key] = torch.ones(L, S, dtype=torch.bool, device=device).tril()
    return mask


@SOFTMAX.register("stock")
def stock_softmax(scores: Tensor, scale: float) -> Tensor:
    mask = causal_mask(scores.shape[-2], scores.shape[-1], scores.device)
    return torch.softmax((scores * scale).masked_fill(~mask, float("-inf")), dim=-1)


SOFTMAX.register("custom")(
    lambda scores, scale: _fl().scaled_masked_softmax(scores, scale=scale, is_causal=True)
)


# ------------------------------------------------------------------------------------------- attention
# k and v may have fewer heads than q (grouped-query attention): query head h reads key/value head
# h // (H / H_kv). The stock attention repeats them; SDPA and ours read the shared heads in place.
def outside_window(L: int, S: int, window: int, device: torch.device) -> Tensor:
    """Bool (L, S), True where key j lies more than ``window`` keys before query i (top-left aligned)."""
    i = torch.arange(L, device=device)[:, None]
    return torch.arange(S, device=device)[None, :] < i - window


@ATTENTION.register("stock")
def stock_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax: Callable,
                    window: int | None = None) -> Tensor:
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = q @ k.transpose(-2, -1)
    if window is not None:  # the softmax choice applies the causal mask; the window's left edge here
        scores = scores.masked_fill(outside_window(q.shape[-2], k.shape[-2], window, q.device), float("-inf"))
    probs = softmax(scores, 1.0 / math.sqrt(q.shape[-1]))
    probs = F.dropout(probs, dropout_p) if dropout_p > 0 else probs
    return probs @ v


def _gqa(q: Tensor, k: Tensor) -> dict:
    # only passed when the heads are grouped: tracers with an older SDPA signature (Thunder 0.2.6) lack the keyword
    return {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}


@ATTENTION.register("sdpa")
def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, dropout_p: float, softmax: Callable,
                   window: int | None = None) -> Tensor:
    if window is None:
        return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, **_gqa(q, k))
    L, S = q.shape[-2], k.shape[-2]  # SDPA takes no window: causal and window as one boolean mask
    keep = causal_mask(L, S, q.device) & ~outside_window(L, S, window, q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep, dropout_p=dropout_p, **_gqa(q, k))


ATTENTION.register("custom")(  # the window's blocks of keys are skipped, not masked
    lambda q, k, v, dropout_p, softmax, window=None: _fl().scaled_dot_product_attention(
        q, k, v, dropout_p=dropout_p, is_causal=True, **_gqa(q, k),
        **({} if window is None else {"window_size": (window, 0)})
    )
)


# ------------------------------------------------------------------------------------------------ loss
LOSS.register("stock")(
    lambda h, w, t, label_smoothing: F.cross_entropy(F.linear(h, w), t, label_smoothing=label_smoothing)
)
LOSS.register("custom")(
    lambda h, w, t, label_smoothing: _fl().cross_entropy(F.linear(h, w), t, label_smoothing=label_smoothing)
)
LOSS.register("fused_linear")(
    lambda h, w, t, label_smoothing: _fl().linear_cross_entropy(h, w, t, label_smoothing=label_smoothing)
)


# ---------------------------------------------------------------------------------------- quantization
QUANT.register("none")(lambda model, act_bits: None)
QUANT.register("int8")(lambda model, act_bits: _fl().qat.prepare(model, weight_bits=8, act_bits=act_bits))
QUANT.register("int4")(  # torchao's 8da4w-style weights: int4, one scale per 32 input features
    lambda model, act_bits: _fl().qat.prepare(
        model, weight_bits=4, act_bits=act_bits, granularity="per_group", group_size=32
    )
)


# ----------------------------------------------------------------------------------------- checkpoint
CHECKPOINT.register("none")(lambda block: block)
CHECKPOINT.register("full")(lambda block: _fl().CheckpointedBlock(block, policy="full"))
CHECKPOINT.register("selective")(lambda block: _fl().CheckpointedBlock(block, policy="selective"))


# ------------------------------------------------------------------------------------------- position
@POSITION.register("learned")
class LearnedPositions(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)

    def embed(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        return x + self.wpe(torch.arange(x.shape[1], device=x.device) if positions is None else positions)

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return q, k


@POSITION.register("rotary")
class RotaryPositions(nn.Module):
    """Rotary position embedding (RoPE) on queries and keys, the rotate-half layout of Llama / transformers'
    ``apply_rotary_pos_emb``; no parameters."""

    def __init__(self, cfg, base: float = 10000.0) -> None:
        super().__init__()
        head_dim = cfg.n_embd // cfg.n_head
        if head_dim % 2:
            raise ValueError(f"model.position=rotary needs an even head size, got n_embd/n_head = {head_dim}")
        inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
        angles = torch.outer(torch.arange(cfg.block_size, dtype=torch.float64), inv_freq)
        self.register_buffer("cos", angles.cos().float(), persistent=False)
        self.register_buffer("sin", angles.sin().float(), persistent=False)

    def embed(self, x: Tensor, positions: Tensor | None = None) -> Tensor:
        return x

    def cos_sin(self, T: int, positions: Tensor | None, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """cos and sin (T, D/2) of each position: 0..T-1, or ``positions`` (packed documents restart at 0)."""
        if positions is None:
            return self.cos[:T].to(dtype), self.sin[:T].to(dtype)
        return self.cos[positions].to(dtype), self.sin[positions].to(dtype)

    def _rot(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        cos, sin = self.cos_sin(q.shape[-2], positions, q.dtype)
        return self._rot(q, cos, sin), self._rot(k, cos, sin)


@POSITION.register("fused_rotary")
class FusedRotaryPositions(RotaryPositions):
    """The same rotation by ``fl.rotary_embedding``: q and k in one kernel, forward and backward. Its cos/sin tables
    are full width (T, D), as transformers' (each pair's angle twice), built once rather than per layer."""

    def __init__(self, cfg, base: float = 10000.0) -> None:
        super().__init__(cfg, base)
        self.cos, self.sin = torch.cat((self.cos, self.cos), -1), torch.cat((self.sin, self.sin), -1)

    def rotate(self, q: Tensor, k: Tensor, positions: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return _fl().rotary_embedding(q, k, *self.cos_sin(q.shape[-2], positions, q.dtype))


# ------------------------------------------------------------------------------------------ norm
NORM_EPS = 1e-5  # nn.LayerNorm's default; Llama's RMSNorm uses 1e-5 (Llama 2/3) or 1e-6 (Llama 1)


class _ResidualNorm:
    """``forward(x, residual=None)`` for torch's norms: the residual add as its own op, then the norm."""

    def forward(self, x: Tensor, residual: Tensor | None = None):
        if residual is None:
            return super().forward(x)
        h = x + residual
        return super().forward(h), h


@NORM.register("layernorm")
class LayerNorm(_ResidualNorm, nn.LayerNorm):
    def __init__(self, cfg) -> None:
        super().__init__(cfg.n_embd, eps=NORM_EPS, bias=cfg.bias)


@NORM.register("rmsnorm")
class RMSNorm(_ResidualNorm, nn.RMSNorm):
    def __init__(self, cfg) -> None:
        super().__init__(cfg.n_embd, eps=NORM_EPS)


def matmul_dtype(x: Tensor) -> torch.dtype | None:
    """The dtype a matmul (F.linear) reads ``x`` in: the autocast dtype where autocast casts x, else None (x's own)."""
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) and x.dtype != torch.float64 else None


class _FusedNorm:
    """The model's norms feed only matmuls (attention's qkv, the MLP's projections, the LM head), which under autocast
    cast their input to the autocast dtype: the fused norms write their output in that dtype directly (the same
    rounding), so no cast kernel runs, forward or backward, and the output takes half the memory."""

    def forward(self, x: Tensor, residual: Tensor | None = None):
        return self.norm(x, residual=residual, out_dtype=matmul_dtype(x))


@NORM.register("fused_layernorm")
class FusedLayerNorm(_FusedNorm, nn.LayerNorm):
    def __init__(self, cfg) -> None:
        super().__init__(cfg.n_embd, eps=NORM_EPS, bias=cfg.bias)

    def norm(self, x: Tensor, **kwargs):
        return _fl().layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps, **kwargs)


@NORM.register("fused_rmsnorm")
class FusedRMSNorm(_FusedNorm, nn.RMSNorm):
    def __init__(self, cfg) -> None:
        super().__init__(cfg.n_embd, eps=NORM_EPS)

    def norm(self, x: Tensor, **kwargs):
        return _fl().rms_norm(x, self.normalized_shape, self.weight, self.eps, **kwargs)


# ------------------------------------------------------------------------------------------- mlp
def mlp_hidden_size(cfg) -> int:
    """``model.mlp_hidden``, or by default 4 * n_embd for GELU and Llama's 8/3 * n_embd rounded up to a multiple
    of 64 for SwiGLU (its three matrices then hold about the parameters of GELU's two)."""
    if cfg.mlp_hidden is not None:
        return cfg.mlp_hidden
    if cfg.mlp == "gelu":
        return 4 * cfg.n_embd
    return -(-8 * cfg.n_embd // (3 * 64)) * 64


@MLP.register("gelu")
class GeluMLP(nn.Module):
    def __init__(self, cfg) -> None:
        super().__init__()
        self.fc = nn.Linear(cfg.n_embd, mlp_hidden_size(cfg), bias=cfg.bias)
        self.proj = nn.Linear(mlp_hidden_size(cfg), cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.proj(F.gelu(self.fc(x))))


@MLP.register("swiglu")
class SwiGLUMLP(nn.Module):
    """Llama's MLP, ``down_proj(silu(gate_proj(x)) * up_proj(x))``, with Llama's parameter names."""

    def __init__(self, cfg) -> None:
        super().__init__()
        hidden = mlp_hidden_size(cfg)
        self.gate_proj = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.up_proj = nn.Linear(cfg.n_embd, hidden, bias=cfg.bias)
        self.down_proj = nn.Linear(hidden, cfg.n_embd, bias=cfg.bias)
        self.drop = nn.Dropout(cfg.dropout)

    def gate(self, gate: Tensor, up: Tensor) -> Tensor:
        return F.silu(gate) * up

    def forward(self, x: Tensor) -> Tensor:
        return self.drop(self.down_proj(self.gate(self.gate_proj(x), self.up_proj(x))))


@MLP.register("fused_swiglu")
class FusedSwiGLUMLP(SwiGLUMLP):
    """The same MLP with the gating by ``fl.swiglu`` (one kernel forward and backward, nothing saved but the
    two projections)."""

    def gate(self, gate: Tensor, up: Tensor) -> Tensor:
        return _fl().swiglu(gate, up)
