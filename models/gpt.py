"""A small GPT in the spirit of nanoGPT, whose parts are picked by name from the registries in
:mod:`models.layers`: pre-norm blocks (LayerNorm or RMSNorm), causal self-attention with a fused qkv
projection and optional grouped-query heads, a GELU or SwiGLU MLP, learned or rotary positions, tied
input/output embeddings and GPT-2's scaled init. ``configs/model/gpt-*.yaml`` are GPT-2 shaped,
``configs/model/llama-*.yaml`` Llama shaped (RMSNorm, SwiGLU, rotary, GQA, no biases).

A stock choice and its fused twin (attention, softmax, loss, checkpoint, norm, mlp, position) give the same
parameter names and shapes, so a checkpoint trained with one loads into the other.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.layers import ATTENTION, CHECKPOINT, LOSS, MLP, NORM, POSITION, QUANT, REGISTRIES, SOFTMAX


@dataclass
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # key/value heads (grouped-query attention); None: n_head
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = True
    position: str = "learned"
    norm: str = "layernorm"
    mlp: str = "gelu"
    mlp_hidden: int | None = None  # None: 4 * n_embd (gelu), 8/3 * n_embd rounded up to 64 (swiglu)
    window: int | None = None  # sliding-window attention: each token sees itself and the `window` tokens before it
    attention: str = "stock"
    softmax: str = "stock"
    loss: str = "stock"
    quant: str = "none"
    quant_act_bits: int | None = None
    checkpoint: str = "none"
    label_smoothing: float = 0.0

    def __post_init__(self) -> None:
        for key, registry in REGISTRIES.items():
            registry.check(getattr(self, key))
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"model.{key} must be a positive int, got {value!r}")
        value = self.mlp_hidden
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"model.mlp_hidden must be a positive int or null, got {value!r}")
        value = self.window
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"model.window must be an int >= 0 (keys before each token it sees) or null, got "
                             f"{value!r}")
        if self.n_embd % self.n_head:
            raise ValueError(
                f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})"
            )
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"model.n_head ({self.n_head}) must be a multiple of model.n_kv_head ({self.n_kv_head})"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise ValueError(f"model.label_smoothing must be in [0, 1], got {self.label_smoothing}")

    @classmethod
    def from_dict(cls, d: dict) -> GPTConfig:
        """Build from a (Hydra) mapping, ignoring keys that are not config fields (e.g. ``name``)."""
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in dict(d).items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)


class Documents:
    """Packed documents in one row (``data.pack=true``): their cumulative lengths ``cu_seqlens`` (int32), each token's
    position within its document, and causal attention within documents by ``fl.varlen_attention``."""

    def __init__(self, cu_seqlens: Tensor, n_tokens: int) -> None:
        self.cu_seqlens = cu_seqlens
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        starts = torch.repeat_interleave(cu_seqlens[:-1].long(), lengths, output_size=n_tokens)
        self.positions = torch.arange(n_tokens, device=cu_seqlens.device) - starts
        self.longest = int(lengths.max()) if lengths.numel() and not torch.compiler.is_compiling() else n_tokens

    def attend(self, q: Tensor, k: Tensor, v: Tensor, dropout_p: float, window: int | None = None) -> Tensor:
        """(1, H, N, D) q and (1, H_kv, N, D) k, v -> (1, H, N, D); ``window``: model.window."""
        import fusedlayers as fl

        y = fl.varlen_attention(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), self.cu_seqlens,
                                self.cu_seqlens, self.longest, self.longest, dropout_p=dropout_p, is_causal=True,
                                window_size=(-1, -1) if window is None else (window, 0))
        return y.transpose(0, 1)[None]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head, self.n_kv_head = cfg.n_head, cfg.n_kv_head
        head_dim = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, (cfg.n_head + 2 * cfg.n_kv_head) * head_dim, bias=cfg.bias)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)
        self.resid_drop = nn.Dropout(cfg.dropout)
        self.dropout = cfg.dropout
        self.attend = ATTENTION.get(cfg.attention)
        self.window = cfg.window
        self.softmax = SOFTMAX.get(cfg.softmax)

    def forward(self, x: Tensor, pos: nn.Module, docs: Documents | None = None) -> Tensor:
        B, T, C = x.shape
        D = C // self.n_head
        # split the projection's last dim, then view heads: in backward, the gradients of q, k and v ((B, T, heads,
        # D)-major from the attention and rotary kernels) are concatenated once into the projection's, no copy more
        q, k, v = self.qkv(x).split((self.n_head * D, self.n_kv_head * D, self.n_kv_head * D), dim=-1)
        q, k, v = (t.view(B, T, -1, D).transpose(1, 2) for t in (q, k, v))  # (B, heads, T, D) views
        dropout = self.dropout if self.training else 0.0
        if docs is None:
            q, k = pos.rotate(q, k)
            y = self.attend(q, k, v, dropout, self.softmax, self.window)  # (B, H, T, D)
        else:  # packed documents (B = 1): positions restart in each, attention stays within each
            q, k = pos.rotate(q, k, docs.positions)
            y = docs.attend(q, k, v, dropout, self.window)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(B, T, C)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = NORM.get(cfg.norm)(cfg)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = NORM.get(cfg.norm)(cfg)
        self.mlp = MLP.get(cfg.mlp)(cfg)

    def forward(self, x: Tensor, residual: Tensor | None, pos: nn.Module, docs: Documents | None = None
                ) -> tuple[Tensor, Tensor]:
        """The residual stream arrives in two parts, ``residual + x`` (x: the previous block's MLP output; the first
        block gets the embeddings as x and no residual), so that each add runs inside the norm that follows it
        (one kernel with the fused norms). Returns this block's (MLP output, stream before it)."""
        h, residual = self.ln_1(x, residual) if residual is not None else (self.ln_1(x), x)
        h, residual = self.ln_2(self.attn(h, pos, docs), residual=residual)  # residual += attn(...)
        return self.mlp(h), residual


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.config = cfg
        wrap = CHECKPOINT.get(cfg.checkpoint)
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.pos = POSITION.get(cfg.position)(cfg)
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList(wrap(Block(cfg)) for _ in range(cfg.n_layer))
        self.ln_f = NORM.get(cfg.norm)(cfg)
        self.loss_fn = LOSS.get(cfg.loss)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():  # GPT-2: residual projections scaled by depth
            if name.endswith(("attn.proj.weight", "mlp.proj.weight", "mlp.down_proj.weight")):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * cfg.n_layer))
        QUANT.get(cfg.quant)(self, cfg.quant_act_bits)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @property
    def lm_head_weight(self) -> Tensor:
        return self.wte.weight  # tied embeddings

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= sum(p.numel() for name, p in self.named_parameters() if name.startswith("pos."))
        return n

    def supports_packing(self) -> bool:
        """Packed documents (``forward(..., cu_seqlens=...)``) run through ``fl.varlen_attention``: the custom
        attention choice."""
        return self.config.attention == "custom"

    def hidden(self, idx: Tensor, cu_seqlens: Tensor | None = None) -> Tensor:
        """Final hidden states (B, T, C) after ln_f."""
        T = idx.shape[1]
        docs = None
        if cu_seqlens is not None:
            if idx.shape[0] != 1 or not self.supports_packing():
                raise ValueError("packed documents (cu_seqlens) need idx of shape (1, N) and model.attention=custom")
            docs = Documents(cu_seqlens, T)
        elif T > self.config.block_size:
            raise ValueError(f"sequence length {T} is longer than model.block_size={self.config.block_size}")
        x, residual = self.drop(self.pos.embed(self.wte(idx), None if docs is None else docs.positions)), None
        for block in self.blocks:
            x, residual = block(x, residual, self.pos, docs)
        return self.ln_f(x, residual)[0]

    def forward(self, idx: Tensor, targets: Tensor | None = None, *, last_only: bool = False,
                cu_seqlens: Tensor | None = None) -> Tensor:
        """With ``targets`` (B, T): the mean cross-entropy loss (positions with target -100 ignored; the
        ``fused_linear`` loss never materialises the logits). Without: the logits (B, T, vocab), or with
        ``last_only`` those of the last position (B, 1, vocab). ``cu_seqlens``: idx (1, N) holds documents packed one
        after another ([cu_seqlens[i], cu_seqlens[i + 1]) each, int32, ``data.pack=true``): each attends only within
        itself, positions restarting at 0 (``model.attention=custom``).

        The LM-head weight (the token embedding) is read here, inside ``forward``: under FSDP (``shard``) the
        root unit gathers it for the duration of this call, so the loss gets the full weight."""
        h = self.hidden(idx, cu_seqlens)
        if targets is None:
            return F.linear(h[:, -1:] if last_only else h, self.lm_head_weight)
        C = h.shape[-1]
        return self.loss_fn(
            h.reshape(-1, C), self.lm_head_weight, targets.reshape(-1), self.config.label_smoothing
        )

    def shard(self, mesh=None, **fsdp_kwargs) -> GPT:
        """Shard the model in place with FSDP2 (``torch.distributed.fsdp.fully_shard``) over ``mesh`` (a 1-D
        data-parallel ``DeviceMesh``; None: all processes). Each transformer block is a unit of its own (its
        weights are gathered just for its forward and its backward); the root unit holds the rest: the token
        embedding, which is also the tied LM head, the position embedding and the final LayerNorm. The root
        gathers its weights when ``forward`` starts and keeps them until its backward, so the embedding and
        the loss (``fused_linear`` included) both see the full ``wte.weight``. Parameters keep their names and
        logical shapes (as ``DTensor``), so ``state_dict`` keys do not change. ``fsdp_kwargs`` go to
        ``fully_shard`` (e.g. ``mp_policy``, ``reshard_after_forward``)."""
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard

        for block in self.blocks:
            fully_shard(block, mesh=mesh, **fsdp_kwargs)
        fully_shard(self, mesh=mesh, **fsdp_kwargs)
        return self

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token (forward + backward), PaLM / nanoGPT formula: 6 N + 12 L H Q T
        (N = parameters incl. the tied head, L layers, H heads, Q head size, T sequence length). Counts the
        full (not causal-halved) attention and no recompute (so MFU, not HFU)."""
        cfg = self.config
        T = seq_len or cfg.block_size
        n = sum(p.numel() for p in self.parameters())
        return 6 * n + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * T

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Sample ``max_new_tokens`` tokens after ``idx`` (B, T); with ``generator`` the global RNG is
        left untouched."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.config.block_size :]
            # through forward, so that a sharded (FSDP) model gathers its weights; every rank must call it then
            logits = self(ctx, last_only=True)[:, -1, :].float() / max(temperature, 1e-6)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1, None]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
