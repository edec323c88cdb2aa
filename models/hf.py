"""Hugging Face transformers causal LMs (Llama, Qwen2/3, Mistral, Gemma, GPT-2) trained by our Lightning module,
with stock or fused attention, loss and layers: ``python train.py model=hf model.arch=llama model.attention=custom``.

:class:`HFCausalLM` wraps a ``*ForCausalLM`` built from a config (random weights, no download) behind the
:class:`models.gpt.GPT` interface (``forward(idx, targets) -> loss``, ``forward(idx) -> logits``, ``generate``,
``flops_per_token``, ``shard``), so ``GPTLitModule``, the callbacks and the sweep comparison treat it as the GPT.
The choices, each a registry entry (unknown names fail with the valid ones):

- ``model.arch``: the architecture (:data:`ARCH`); sizes come from the GPT's keys: ``n_embd`` (hidden size),
  ``n_layer``, ``n_head``, ``n_kv_head`` (grouped-query key/value heads; GPT-2 has none and ignores it),
  ``intermediate_size`` (MLP width; null: 4 ``n_embd``), ``block_size`` (max positions), ``dropout``
  (attention dropout; GPT-2: also embedding and residual dropout), and ``vocab_size`` from the data. The head
  size is ``n_embd / n_head`` for every architecture. ``model.hf_config`` passes any other keyword to the
  transformers config class as is (``rope_parameters``, ``tie_word_embeddings``, ``sliding_window``, ...);
  it wins over ours. Special-token ids are unset (our tokenizers have none: a ``pad_token_id`` would be an
  embedding row that never trains) and the KV cache is off in training.
- ``model.attention`` (:data:`HF_ATTENTION`): ``stock`` transformers' SDPA attention, ``eager`` its explicit
  matmul-softmax attention, ``custom`` ``fl.scaled_dot_product_attention`` through
  ``fusedlayers.integrations.transformers.apply(attention=True)``.
- ``model.loss`` (:data:`HF_LOSS`): ``stock`` the model's own loss (transformers' ``ForCausalLMLoss``: the logits
  cast to fp32, also from fp64), ``custom`` ``fl.cross_entropy`` on the logits (16-bit ones cast to fp32),
  ``fused_linear`` ``fl.linear_cross_entropy`` on the final hidden states through ``apply(loss=True)`` (the logits
  are never materialised; fp32 loss for 16-bit models, fp64 for fp64 ones).
- ``model.layers`` (:data:`HF_LAYERS`): ``stock`` transformers' layers, ``custom`` ``fl.rms_norm`` /
  ``fl.layer_norm``, ``fl.swiglu`` and ``fl.rotary_embedding`` in place of the architecture's RMSNorm / LayerNorm,
  SiLU-gated MLP and rotary embedding, and under autocast one 16-bit copy of an input that several linear layers read,
  through ``apply(norm=True, mlp=True, rotary=True, cast_once=True)``.
- ``model.checkpoint`` (:data:`HF_CHECKPOINT`): ``none``, or ``full`` (transformers' gradient checkpointing of
  every decoder layer, non-reentrant).

Our batches hold targets already shifted (``targets[t]`` is the token after ``idx[t]``): they go to the model as
``shift_labels`` (with ``labels``, which only switches the loss on), so every position is scored, ``-100``
ignored, mean over the rest: the GPT's loss.

Every choice keeps transformers' own parameter names (``state_dict`` keys ``hf.<the model's keys>``), so a
checkpoint trained with one choice loads into any other. transformers is imported when an HF model is built
(``pip install -e ".[transformers]"``), never by the GPT path.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field, fields

import torch
from torch import Tensor, nn

from models.gpt import GPT
from models.registry import Registry

ARCH = Registry("model.arch", "Hugging Face transformers architecture (model_type)")
HF_ATTENTION = Registry("model.attention", "attention implementation of an HF model")
HF_LOSS = Registry("model.loss", "causal-LM loss of an HF model")
HF_CHECKPOINT = Registry("model.checkpoint", "activation checkpointing of an HF model")
HF_LAYERS = Registry("model.layers", "norms, MLP gate and rotary embedding of an HF model")
HF_REGISTRIES = {"arch": ARCH, "attention": HF_ATTENTION, "loss": HF_LOSS, "layers": HF_LAYERS,
                 "checkpoint": HF_CHECKPOINT}


# ------------------------------------------------------------------------------------------- architectures
# ARCH[name](cfg) -> keyword arguments for the transformers config class of model_type ``name`` (our sizes in its
# names); adding an architecture whose config takes Llama's names is one line.
def _llama_like(cfg: HFConfig) -> dict:
    return dict(
        hidden_size=cfg.n_embd,
        num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head,
        num_key_value_heads=cfg.n_kv_head,
        head_dim=cfg.n_embd // cfg.n_head,  # Gemma's default is 256 whatever the width
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.block_size,
        attention_dropout=cfg.dropout,
    )


for _name in ("llama", "qwen2", "qwen3", "mistral", "gemma"):
    ARCH.register(_name)(_llama_like)


@ARCH.register("gpt2")
def _gpt2(cfg: HFConfig) -> dict:
    return dict(
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=cfg.intermediate_size,
        n_positions=cfg.block_size,
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
    )


_NO_GQA = {"gpt2"}  # architectures whose attention has as many key/value heads as query heads


# ------------------------------------------------------------------------------------------------ choices
HF_ATTENTION.register("stock")("sdpa")  # the transformers attn_implementation each choice starts from
HF_ATTENTION.register("eager")("eager")
HF_ATTENTION.register("custom")("sdpa")  # then fusedlayers.integrations.transformers.apply(attention=True)
_FUSED_ATTENTION = {"custom"}


def _hf_loss(model: HFCausalLM, idx: Tensor, targets: Tensor) -> Tensor:
    targets = targets.contiguous()  # (transformers' loss views it; batches are windows of one token array)
    return model.hf(input_ids=idx, labels=targets, shift_labels=targets).loss


def _fl_cross_entropy(model: HFCausalLM, idx: Tensor, targets: Tensor) -> Tensor:
    import fusedlayers as fl

    logits = model.hf(input_ids=idx).logits
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # 16-bit: fp32, as the stock loss
    return fl.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


# HF_LOSS[name](wrapper, idx, targets) -> mean loss; fused_linear is the stock call on a model with the fused loss
HF_LOSS.register("stock")(_hf_loss)
HF_LOSS.register("custom")(_fl_cross_entropy)
HF_LOSS.register("fused_linear")(_hf_loss)
_FUSED_LOSS = {"fused_linear"}

# HF_LAYERS[name]: whether apply(norm=, mlp=, rotary=, cast_once=) swaps in fl.rms_norm / fl.layer_norm, fl.swiglu
# and fl.rotary_embedding where the architecture has those layers (transformers' own code otherwise), and casts a
# shared input once under autocast
HF_LAYERS.register("stock")(False)
HF_LAYERS.register("custom")(True)

HF_CHECKPOINT.register("none")(lambda hf: None)


@HF_CHECKPOINT.register("full")
def _checkpoint_every_layer(hf) -> None:
    kwargs = {"use_reentrant": False}
    if hasattr(hf, "activation_checkpointing_enable"):  # transformers >= 5.2x (the old name warns)
        hf.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# ------------------------------------------------------------------------------------------------- config
def _positive_int(key: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"model.{key} must be a positive int, got {value!r}")


@dataclass
class HFConfig:
    arch: str = "llama"
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    n_kv_head: int | None = None  # None: n_head (no grouping)
    n_embd: int = 128
    intermediate_size: int | None = None  # None: 4 * n_embd
    dropout: float = 0.0
    attention: str = "stock"
    loss: str = "stock"
    layers: str = "stock"
    checkpoint: str = "none"
    hf_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        for key, registry in HF_REGISTRIES.items():
            registry.check(getattr(self, key))
        if self.arch in _NO_GQA:
            self.n_kv_head = None  # documented: ignored (the arch has one key/value head per query head)
        if self.n_kv_head is None:
            self.n_kv_head = self.n_head
        if self.intermediate_size is None:
            self.intermediate_size = 4 * self.n_embd
        for key in ("vocab_size", "block_size", "n_layer", "n_head", "n_kv_head", "n_embd", "intermediate_size"):
            _positive_int(key, getattr(self, key))
        if self.n_embd % self.n_head:
            raise ValueError(f"model.n_embd ({self.n_embd}) must be divisible by model.n_head ({self.n_head})")
        if self.n_head % self.n_kv_head:
            raise ValueError(
                f"model.n_head ({self.n_head}) must be a multiple of model.n_kv_head ({self.n_kv_head}) "
                "(grouped-query attention)"
            )
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if not isinstance(self.hf_config, dict):
            raise ValueError(f"model.hf_config must be a mapping of config keywords, got {self.hf_config!r}")

    @classmethod
    def from_dict(cls, d: dict) -> HFConfig:
        """Build from a (Hydra) mapping; ``name`` is ignored, any other key that is not a field is an error
        (GPT-only keys such as ``softmax`` or ``quant`` have no meaning for an HF model)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known - {"name"})
        if unknown:
            raise ValueError(
                f"unknown key(s) {', '.join('model.' + k for k in unknown)} for an HF model "
                f"(model.arch={d.get('arch')!r}); valid keys: {', '.join(sorted(known))}"
            )
        return cls(**{k: (dict(v) if k == "hf_config" and v is not None else v) for k, v in d.items() if k in known})

    def to_dict(self) -> dict:
        return asdict(self)

    def transformers_config(self):
        """The transformers config (``AutoConfig.for_model(arch, ...)``) of this model."""
        from transformers import AutoConfig

        kwargs = dict(
            ARCH.get(self.arch)(self),
            vocab_size=self.vocab_size,
            use_cache=False,  # training: no KV cache built and returned by every forward
            pad_token_id=None,
            bos_token_id=None,
            eos_token_id=None,
        )
        kwargs.update(self.hf_config)
        return AutoConfig.for_model(self.arch, **kwargs)


# ------------------------------------------------------------------------------------------------ model
class HFCausalLM(nn.Module):
    """A transformers ``*ForCausalLM`` (``self.hf``) with the GPT's interface; see the module docstring."""

    def __init__(self, cfg: HFConfig) -> None:
        super().__init__()
        from transformers import AutoModelForCausalLM

        self.config = cfg
        hf_cfg = cfg.transformers_config()
        self.hf = AutoModelForCausalLM.from_config(hf_cfg, attn_implementation=HF_ATTENTION.get(cfg.attention))
        if getattr(self.hf, "loss_type", None) is None:  # GPT-2's class name does not say it; transformers warns
            self.hf.loss_type = "ForCausalLM"
        attention, loss = cfg.attention in _FUSED_ATTENTION, cfg.loss in _FUSED_LOSS
        layers = HF_LAYERS.get(cfg.layers)
        if attention or loss or layers:
            from fusedlayers.integrations import transformers as flt

            flt.apply(self.hf, attention=attention, loss=loss, norm=layers, mlp=layers, rotary=layers,
                      cast_once=layers)
            applied = flt.is_applied(self.hf)
            if applied["attention"] != attention or applied["loss"] != loss:
                raise ValueError(
                    f"model.arch={cfg.arch}: fusedlayers could not apply model.attention={cfg.attention} / "
                    f"model.loss={cfg.loss} ({applied})"
                )
        HF_CHECKPOINT.get(cfg.checkpoint)(self.hf)
        self._loss: Callable = HF_LOSS.get(cfg.loss)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters; ``non_embedding``: without the input embeddings (the LM head stays, tied or not)."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self._input_embedding_params()
        return n

    def _input_embedding_params(self) -> int:
        """Parameters of the input (token and, for GPT-2, position) embeddings that are not also the LM head:
        lookups, no FLOPs."""
        head = self.hf.get_output_embeddings().weight
        n = 0
        for m in self.hf.modules():
            if isinstance(m, nn.Embedding) and m.weight is not head:
                n += m.weight.numel()
        return n

    def forward(self, idx: Tensor, targets: Tensor | None = None, *, last_only: bool = False) -> Tensor:
        """With ``targets`` (B, T): the mean cross-entropy loss (targets -100 ignored; ``fused_linear`` never
        materialises the logits). Without: the logits (B, T, vocab), or with ``last_only`` those of the last
        position (B, 1, vocab)."""
        T = idx.shape[1]
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} is longer than model.block_size={self.config.block_size}")
        if targets is None:
            return self.hf(input_ids=idx, logits_to_keep=1 if last_only else 0).logits
        return self._loss(self, idx, targets)

    def compile(self, *args, **kwargs) -> None:
        """``torch.compile`` in place (``compile=true``; parameter names unchanged), as ``nn.Module.compile``; with
        ``fused_linear`` only the base model (embeddings, decoder layers, final norm): the fused loss swaps the LM
        head's forward during the call, which dynamo does not trace (the head and the loss op run eagerly)."""
        if self.config.loss in _FUSED_LOSS:
            self.hf.base_model.compile(*args, **kwargs)
        else:
            super().compile(*args, **kwargs)

    def decoder_layers(self) -> nn.ModuleList:
        """The model's list of transformer blocks (``model.layers``, GPT-2's ``transformer.h``)."""
        base = self.hf.base_model
        for name in ("layers", "h"):
            layers = getattr(base, name, None)
            if isinstance(layers, nn.ModuleList):
                return layers
        raise AttributeError(f"{type(base).__name__} has no `layers` or `h` module list")

    def shard(self, mesh=None, **fsdp_kwargs) -> HFCausalLM:
        """Shard in place with FSDP2 over ``mesh``, as ``GPT.shard``: each decoder layer a unit, the root (this
        wrapper) the embeddings, final norm and LM head, gathered for the whole ``forward`` (where the loss reads
        the LM-head weight). Parameter names do not change."""
        try:
            from torch.distributed.fsdp import fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import fully_shard

        for layer in self.decoder_layers():
            fully_shard(layer, mesh=mesh, **fsdp_kwargs)
        fully_shard(self, mesh=mesh, **fsdp_kwargs)
        return self

    def flops_per_token(self, seq_len: int | None = None) -> float:
        """Training FLOPs per token, the GPT's formula: 6 N + 12 L H Q T, with N the parameters that multiply
        (all but the input embeddings; the LM head counted, tied or not), L layers, H query heads, Q head size,
        T sequence length. Full (not causal-halved) attention, no recompute (MFU, not HFU)."""
        cfg = self.config
        T = seq_len or cfg.block_size
        n = self.num_params(non_embedding=True)
        return 6 * n + 12 * cfg.n_layer * cfg.n_head * (cfg.n_embd // cfg.n_head) * T

    # the GPT's sampling loop (the last block_size tokens as context, no KV cache, through forward so that a
    # sharded model gathers its weights): it needs only forward(idx, last_only=True) and config.block_size
    generate = GPT.generate


def build(model_cfg: dict, vocab_size: int) -> HFCausalLM:
    """The model of a ``model`` config (a mapping with ``arch``) for a vocabulary of ``vocab_size``."""
    return HFCausalLM(HFConfig.from_dict({**dict(model_cfg), "vocab_size": vocab_size}))
