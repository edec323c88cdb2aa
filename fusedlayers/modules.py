"""nn.Module drop-ins for their stock PyTorch twins (same arguments, same parameter names)."""

from __future__ import annotations

import math
import warnings

import torch
from torch import Tensor, nn

from fusedlayers import functional as F
from fusedlayers.ops import fake_quantize as fq_ops
from fusedlayers.ops._eager import call

__all__ = ["Softmax", "CheckpointedBlock", "CrossEntropyLoss", "LinearCrossEntropyLoss", "FakeQuantLinear",
           "RMSNorm", "LayerNorm", "SwiGLUMLP", "GeGLUMLP", "ApplyRotaryEmbedding"]


class Softmax(nn.Module):
    """Drop-in for ``nn.Softmax(dim)``, running ``fl.softmax``."""

    def __init__(self, dim: int | None = None) -> None:
        super().__init__()
        self.dim = dim

    def forward(self, input: Tensor) -> Tensor:
        dim = self.dim
        if dim is None:  # nn.Softmax's legacy implicit dim, with its warning
            warnings.warn("Implicit dimension choice for softmax has been deprecated. "
                          "Change the call to include dim=X as an argument.", stacklevel=2)
            dim = 0 if input.dim() in (0, 1, 3) else 1
        return F.softmax(input, dim)

    def extra_repr(self) -> str:
        return f"dim={self.dim}"


class CheckpointedBlock(nn.Module):
    """Drop-in for ``module`` that runs it under ``fl.checkpoint`` (activations recomputed in backward).

    The wrapper shares the wrapped module's parameters, buffers and submodules (the same dicts), so
    ``state_dict`` keys, ``named_parameters`` and ``named_buffers`` are exactly the unwrapped module's:
    a checkpoint of the unwrapped model loads into the wrapped one and back, and ``.to()``/``.train()``
    reach both. ``_save_to_state_dict``/``_load_from_state_dict`` are the wrapped module's own (extra
    state, version migrations). Attributes the wrapper lacks are read from the wrapped module; the
    wrapped module itself is ``.module``. Forward hooks registered on the wrapped module run in the
    forward and again in the recompute; register them on the wrapper to run them once.
    """

    def __init__(self, module: nn.Module, preserve_rng_state: bool = True, policy="full") -> None:
        if not isinstance(module, nn.Module):
            raise TypeError(f"module must be an nn.Module, got {type(module).__name__}")
        if isinstance(module, CheckpointedBlock):
            raise ValueError("module is already a CheckpointedBlock")
        if not isinstance(preserve_rng_state, bool):
            raise TypeError(f"preserve_rng_state must be a bool, got {type(preserve_rng_state).__name__}")
        if isinstance(policy, str):
            if policy not in ("full", "selective"):
                raise ValueError(f"policy must be one of ('full', 'selective') or a callable, got {policy!r}")
        elif not callable(policy):
            raise TypeError(f"policy must be 'full', 'selective' or a callable, got {type(policy).__name__}")
        super().__init__()
        object.__setattr__(self, "_wrapped", module)
        for name in ("_parameters", "_buffers", "_non_persistent_buffers_set", "_modules"):
            object.__setattr__(self, name, getattr(module, name))
        object.__setattr__(self, "_version", module._version)  # state_dict metadata as the wrapped module's
        self.preserve_rng_state = preserve_rng_state
        self.policy = policy
        self.training = module.training

    @property
    def module(self) -> nn.Module:
        return self._wrapped

    def forward(self, *args, **kwargs):
        return F.checkpoint(self._wrapped, *args, preserve_rng_state=self.preserve_rng_state,
                            policy=self.policy, **kwargs)

    def train(self, mode: bool = True) -> CheckpointedBlock:
        if not isinstance(mode, bool):
            raise ValueError("training mode is expected to be boolean")
        self._wrapped.train(mode)
        self.training = mode
        return self

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            wrapped = self.__dict__.get("_wrapped")
            if wrapped is None:
                raise
            return getattr(wrapped, name)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        self._wrapped._save_to_state_dict(destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        self._wrapped._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                            unexpected_keys, error_msgs)

    def extra_repr(self) -> str:
        policy = self.policy if isinstance(self.policy, str) else getattr(self.policy, "__name__", "callable")
        return f"{type(self._wrapped).__name__}, policy={policy}, preserve_rng_state={self.preserve_rng_state}"


class CrossEntropyLoss(nn.Module):
    """Drop-in for ``nn.CrossEntropyLoss``, running ``fl.cross_entropy``.

    Same arguments (class ``weight``, the legacy ``size_average``/``reduce`` mapped as torch maps them,
    ``ignore_index``, ``reduction``, ``label_smoothing``) plus keyword-only ``z_loss``; class-index and
    class-probability targets. Like torch, ``weight`` is a buffer (None when not given), so the state dict
    matches ``nn.CrossEntropyLoss``'s.
    """

    def __init__(self, weight: Tensor | None = None, size_average=None, ignore_index: int = -100, reduce=None,
                 reduction: str = "mean", label_smoothing: float = 0.0, *, z_loss: float = 0.0) -> None:
        super().__init__()
        if weight is not None:
            from fusedlayers import _validate as v

            v.check_float_tensor("weight", weight)
            if weight.dim() != 1:
                raise ValueError(f"weight must be 1-D (one weight per class), got shape {tuple(weight.shape)}")
        if size_average is not None or reduce is not None:
            from torch.nn import _reduction

            reduction = _reduction.legacy_get_string(size_average, reduce)
        self.register_buffer("weight", weight)
        self.ignore_index = ignore_index
        self.reduction = reduction
        self.label_smoothing = label_smoothing
        self.z_loss = z_loss

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        return F.cross_entropy(input, target, weight=self.weight, ignore_index=self.ignore_index,
                               reduction=self.reduction, label_smoothing=self.label_smoothing, z_loss=self.z_loss)

    def extra_repr(self) -> str:
        return (f"ignore_index={self.ignore_index}, reduction={self.reduction!r}, "
                f"label_smoothing={self.label_smoothing}, z_loss={self.z_loss}")


class LinearCrossEntropyLoss(nn.Module):
    """Drop-in for torch >= 2.13's ``nn.LinearCrossEntropyLoss`` (available on older torch too), running
    ``fl.linear_cross_entropy``: a linear layer and the cross-entropy of its logits, without the logits.

    Same constructor (``in_features, num_classes, *, out_features=(), bias=False, device=None, dtype=None,
    reduction="mean", weight=None, ignore_index=None, label_smoothing=0.0, options=None``) plus our keyword-only
    ``z_loss``, ``chunk_size``, ``accumulation_dtype``, ``logit_scale`` and ``softcap``; same parameters and buffers
    (``linear.weight`` of shape (num_classes * prod(out_features), in_features), ``linear.bias``, the class
    ``weight`` buffer), so state dicts load both ways; same ``forward(input, target)``. For a weight you hold
    elsewhere (a tied embedding), call ``fl.linear_cross_entropy`` directly.
    """

    def __init__(self, in_features: int, num_classes: int, *, out_features: tuple[int, ...] = (), bias: bool = False,
                 device=None, dtype=None, reduction: str = "mean", weight: Tensor | None = None,
                 ignore_index: int | None = None, label_smoothing: float = 0.0, options=None, z_loss: float = 0.0,
                 chunk_size: int | None = None, accumulation_dtype: torch.dtype | None = None,
                 logit_scale: float = 1.0, softcap: float | None = None) -> None:
        super().__init__()
        from fusedlayers import _validate as v

        out_features = tuple(out_features)
        if weight is not None:
            v.check_float_tensor("weight", weight)
            if tuple(weight.shape) != (num_classes,):
                raise ValueError(f"weight must have shape ({num_classes},) (num_classes), got {tuple(weight.shape)}")
        v.check_fraction("label_smoothing", label_smoothing)
        v.check_reduction(reduction)
        if options is not None and not isinstance(options, getattr(torch.nn, "LinearCrossEntropyOptions", ())):
            raise TypeError("options must be a torch.nn.LinearCrossEntropyOptions (torch >= 2.13) or None, got "
                            f"{type(options).__name__}")
        self.register_buffer("weight", weight)
        self.num_classes = num_classes
        self.out_features = out_features
        self.reduction = reduction
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing
        self.linear = nn.Linear(in_features, math.prod(out_features, start=num_classes), bias=bias, device=device,
                                dtype=dtype)
        self.options = options
        self.z_loss = z_loss
        self.chunk_size = chunk_size
        self.accumulation_dtype = accumulation_dtype
        self.logit_scale, self.softcap = F._check_logit_transform(logit_scale, softcap)

    def forward(self, input: Tensor, target: Tensor) -> Tensor:
        linear_weight = self.linear.weight.reshape(self.num_classes, *self.out_features, self.linear.in_features)
        linear_bias = (self.linear.bias.reshape(self.num_classes, *self.out_features)
                       if self.linear.bias is not None else None)
        return F.linear_cross_entropy(
            input, linear_weight, target, linear_bias=linear_bias, weight=self.weight, reduction=self.reduction,
            ignore_index=self.ignore_index, label_smoothing=self.label_smoothing, options=self.options,
            z_loss=self.z_loss, chunk_size=self.chunk_size, accumulation_dtype=self.accumulation_dtype,
            logit_scale=self.logit_scale, softcap=self.softcap)

    def extra_repr(self) -> str:
        return (f"in_features={self.linear.in_features}, num_classes={self.num_classes}, "
                f"out_features={self.out_features}, bias={self.linear.bias is not None}, "
                f"reduction={self.reduction}, ignore_index={self.ignore_index}, "
                f"label_smoothing={self.label_smoothing}, options={self.options}, z_loss={self.z_loss}, "
                f"chunk_size={self.chunk_size}, accumulation_dtype={self.accumulation_dtype}, "
                f"logit_scale={self.logit_scale}, softcap={self.softcap}")


# ----------------------------------------------------------------------------- fake quantization (QAT)

WEIGHT_GRANULARITIES = ("per_tensor", "per_channel", "per_group")
SCALE_INITS = ("absmax", "lsq")


def quant_range(bits: int) -> tuple[int, int]:
    """Signed ``bits``-bit integer range: (-2**(bits-1), 2**(bits-1) - 1)."""
    return -(2 ** (bits - 1)), 2 ** (bits - 1) - 1


def resolve_granularity(granularity: str | None, group_size) -> str | None:
    """The weight granularity meant by ``granularity`` and ``group_size``: as given; when None (the default),
    "per_group" if a ``group_size`` is given, else "per_channel" (as torchao's ``group_size`` / ``groupsize``
    means per-group quantization). An explicit granularity that contradicts the group size stays as given, for
    ``check_quant_config`` to refuse."""
    if granularity is None:
        return "per_channel" if group_size is None else "per_group"
    return granularity


def check_quant_config(in_features: int, weight_bits, weight_granularity, group_size, act_bits,
                       where: str = "", granularity_arg: str = "weight_granularity") -> None:
    """Raise a clear ValueError / TypeError for a bad fake-quantization config (``where`` names the layer,
    ``granularity_arg`` the caller's name for the granularity argument). ``weight_granularity`` None: see
    ``resolve_granularity``."""
    at = f" (layer {where!r})" if where else ""
    from fusedlayers import _validate as v

    v.check_bits("weight_bits", weight_bits)
    v.check_bits("act_bits", act_bits)
    weight_granularity = resolve_granularity(weight_granularity, group_size)
    if weight_granularity not in WEIGHT_GRANULARITIES:
        raise ValueError(f"{granularity_arg} must be one of {WEIGHT_GRANULARITIES} or None, got {weight_granularity!r}")
    if weight_granularity == "per_group":
        if group_size is None:
            raise ValueError(f"{granularity_arg}='per_group' needs a group_size")
        v.check_group_size("group_size", group_size, in_features, what=f"in_features{at}")
    elif group_size is not None:
        raise ValueError(f"group_size={group_size!r} contradicts {granularity_arg}={weight_granularity!r}: a group "
                         f"size means per-group quantization; pass {granularity_arg}='per_group' (or leave it None), "
                         f"or drop group_size")


def absmax_scale(weight: Tensor, bits: int, granularity: str, group_size: int | None) -> Tensor:
    """Symmetric scale per tensor (1,) / output channel (out,) / group (out, in // group_size), torchao's:
    ``max|w| / ((qmax - qmin) / 2)``, at least fp32 eps; computed in fp32 from ``weight``."""
    qmin, qmax = quant_range(bits)
    w = weight.detach().float()
    if granularity == "per_group":
        w = w.reshape(w.shape[0], -1, group_size)
    amax = w.abs().amax() if granularity == "per_tensor" else w.abs().amax(-1)
    # IEEE division by a tensor, as the fake-quant kernel (torch on CUDA divides by a number via its reciprocal)
    scale = amax / torch.full_like(amax, float(qmax - qmin) / 2)
    return torch.clamp(scale, min=torch.finfo(torch.float32).eps).reshape(
        scale_shape(weight.shape, granularity, group_size))


def scale_shape(weight_shape, granularity: str, group_size: int | None) -> tuple[int, ...]:
    out_features, in_features = weight_shape
    if granularity == "per_tensor":
        return (1,)
    if granularity == "per_channel":
        return (out_features,)
    return (out_features, in_features // group_size)


class FakeQuantLinear(nn.Linear):
    """Drop-in for ``nn.Linear`` (a subclass, same ``weight`` / ``bias`` parameters and initialisation) that
    fake-quantizes its weight and, optionally, its input activations, for quantization-aware training.

    - Weights: symmetric signed ``weight_bits``-bit (zero point 0), ``weight_granularity`` "per_tensor",
      "per_channel" (one scale per output feature) or "per_group" (one scale per ``group_size`` consecutive
      input features of each output feature, e.g. int4 with group_size 32 as torchao's 8da4w recipe). Left
      None (the default) it is "per_group" when a ``group_size`` is given, else "per_channel" (torchao's
      rule: a group size means per-group); an explicit granularity other than "per_group" with a group_size
      is refused (ValueError). The attribute ``weight_granularity`` holds the resolved name.
      With ``learnable_scale=False`` the scales are recomputed from the current weight at every forward
      (``max|w| / ((qmax - qmin) / 2)``, torchao's choice), in the fake-quant kernel itself for per channel
      and per group; gradients reach the weight through the straight-through estimator with the clipping
      mask. With ``learnable_scale=True`` the scales are a parameter ``weight_scale`` trained with LSQ
      (gradient scaled by ``1 / sqrt(n * qmax)``, n = weights per scale), initialised by ``scale_init``:
      "absmax" (the same max|w| rule, so training starts from the post-training-quantized model) or "lsq"
      (LSQ's ``2 * mean|w| / sqrt(qmax)``); ``init_weight_scale()`` re-initialises them from the weight.
    - Activations: ``act_bits`` (None: not quantized) signed per-token asymmetric fake quantization with
      qparams from each row's min/max (torchao's int8 dynamic activations), computed in the kernel.
    - ``disable_fake_quant()`` (or weight_bits=None and act_bits=None) makes forward, gradients and hence
      optimizer steps exactly those of ``nn.Linear``; ``enable_fake_quant()`` turns it back on.

    ``fl.qat.prepare`` swaps nn.Linear layers for this; ``fl.qat.convert`` turns it into an int8 / packed-int4
    ``fl.qat.QuantizedLinear`` whose outputs equal this layer's.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, weight_bits: int | None = 8,
                 weight_granularity: str | None = None, group_size: int | None = None, act_bits: int | None = None,
                 learnable_scale: bool = False, scale_init: str = "absmax", device=None, dtype=None) -> None:
        check_quant_config(in_features, weight_bits, weight_granularity, group_size, act_bits)
        weight_granularity = resolve_granularity(weight_granularity, group_size)
        if not isinstance(learnable_scale, bool):
            raise TypeError(f"learnable_scale must be a bool, got {type(learnable_scale).__name__}")
        if scale_init not in SCALE_INITS:
            raise ValueError(f"scale_init must be one of {SCALE_INITS}, got {scale_init!r}")
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.weight_bits = weight_bits
        self.weight_granularity = weight_granularity
        self.group_size = group_size
        self.act_bits = act_bits
        self.learnable_scale = learnable_scale
        self.scale_init = scale_init
        self.fake_quant_enabled = True
        if learnable_scale and weight_bits is not None:
            self._make_weight_scale(self.weight.device)
        else:
            self.register_parameter("weight_scale", None)
            self.weight_zero_point = None

    def _make_weight_scale(self, device) -> None:
        shape = scale_shape(self.weight.shape, self.weight_granularity, self.group_size)
        self.weight_scale = nn.Parameter(torch.empty(shape, dtype=torch.float32, device=device))
        self.register_buffer("weight_zero_point", torch.zeros(shape, dtype=torch.int32, device=device),
                             persistent=False)
        self.init_weight_scale()

    @classmethod
    def from_linear(cls, linear: nn.Linear, **config) -> FakeQuantLinear:
        """A FakeQuantLinear holding ``linear``'s own weight and bias parameters (not copies)."""
        module = cls(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta",
                     dtype=linear.weight.dtype, **config)
        module.weight = linear.weight
        module.bias = linear.bias
        if module.weight_scale is not None:
            module._make_weight_scale(linear.weight.device)
        module.train(linear.training)
        return module

    @torch.no_grad()
    def init_weight_scale(self, scale_init: str | None = None) -> None:
        """(Re)initialise the learnable ``weight_scale`` from the current weight ("absmax" or "lsq")."""
        if self.weight_scale is None:
            return
        scale_init = scale_init or self.scale_init
        if scale_init not in SCALE_INITS:
            raise ValueError(f"scale_init must be one of {SCALE_INITS}, got {scale_init!r}")
        if scale_init == "absmax":
            scale = absmax_scale(self.weight, self.weight_bits, self.weight_granularity, self.group_size)
        else:
            _, qmax = quant_range(self.weight_bits)
            w = self.weight.detach().float()
            if self.weight_granularity == "per_group":
                w = w.reshape(w.shape[0], -1, self.group_size)
            mean_abs = w.abs().mean() if self.weight_granularity == "per_tensor" else w.abs().mean(-1)
            scale = torch.clamp(2 * mean_abs / math.sqrt(qmax), min=torch.finfo(torch.float32).eps)
        self.weight_scale.copy_(scale.reshape(self.weight_scale.shape))

    @property
    def grad_factor(self) -> float:
        """LSQ's gradient scale for weight_scale: 1 / sqrt(weights per scale * qmax)."""
        per_scale = self.weight.numel() // math.prod(scale_shape(self.weight.shape, self.weight_granularity,
                                                                 self.group_size))
        return 1.0 / math.sqrt(per_scale * quant_range(self.weight_bits)[1])

    def disable_fake_quant(self) -> FakeQuantLinear:
        self.fake_quant_enabled = False
        return self

    def enable_fake_quant(self) -> FakeQuantLinear:
        self.fake_quant_enabled = True
        return self

    def fake_quantized_weight(self) -> Tensor:
        """The weight as the forward uses it (fake-quantized when weight_bits is set)."""
        if self.weight_bits is None:
            return self.weight
        qmin, qmax = quant_range(self.weight_bits)
        granularity = self.weight_granularity
        if self.weight_scale is not None:
            axis = 0 if granularity == "per_channel" else None
            group = self.group_size if granularity == "per_group" else 0
            return call(fq_ops.fake_quantize, self.weight, self.weight_scale, self.weight_zero_point, qmin, qmax,
                        axis, group, self.grad_factor)[0]
        if granularity == "per_tensor":
            scale = absmax_scale(self.weight, self.weight_bits, granularity, None)
            zero = torch.zeros(1, dtype=torch.int32, device=self.weight.device)
            return call(fq_ops.fake_quantize, self.weight, scale, zero, qmin, qmax, None, 0, 1.0)[0]
        group = self.in_features if granularity == "per_channel" else self.group_size
        return call(fq_ops.fake_quantize_dynamic, self.weight, qmin, qmax, group, True)[0]

    def forward(self, input: Tensor) -> Tensor:
        if not self.fake_quant_enabled:
            return nn.functional.linear(input, self.weight, self.bias)
        weight = self.fake_quantized_weight()
        if self.act_bits is not None:
            input = F.fake_quantize_dynamic(input, *quant_range(self.act_bits))
        return nn.functional.linear(input, weight, self.bias)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (f"{super().extra_repr()}, weight_bits={self.weight_bits}, "
                f"weight_granularity={self.weight_granularity!r}{group}, act_bits={self.act_bits}, "
                f"learnable_scale={self.learnable_scale}, fake_quant_enabled={self.fake_quant_enabled}")


class RMSNorm(nn.RMSNorm):
    """Drop-in for ``nn.RMSNorm(normalized_shape, eps=None, elementwise_affine=True, device=None, dtype=None)`` (a
    subclass: same arguments, parameter ``weight``, init and state_dict), running ``fl.rms_norm``.
    ``forward(input, residual=None, *, out_dtype=None)``: with a residual, returns ``(norm(input + residual), input +
    residual)`` from one kernel (the pre-norm block's residual stream); ``out_dtype`` as ``fl.rms_norm``'s."""

    def forward(self, input: Tensor, residual: Tensor | None = None, *, out_dtype: torch.dtype | None = None):
        return F.rms_norm(input, self.normalized_shape, self.weight, self.eps, residual=residual, out_dtype=out_dtype)


class LayerNorm(nn.LayerNorm):
    """Drop-in for ``nn.LayerNorm(normalized_shape, eps=1e-5, elementwise_affine=True, bias=True, device=None,
    dtype=None)`` (a subclass: same arguments, parameters ``weight`` and ``bias``, init and state_dict), running
    ``fl.layer_norm``. ``forward(input, residual=None, *, out_dtype=None)``: with a residual, returns ``(norm(input +
    residual), input + residual)`` from one kernel (the pre-norm block's residual stream); ``out_dtype`` as
    ``fl.layer_norm``'s."""

    def forward(self, input: Tensor, residual: Tensor | None = None, *, out_dtype: torch.dtype | None = None):
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps, residual=residual,
                            out_dtype=out_dtype)


# ----------------------------------------------------------------------------- SwiGLU MLP



class SwiGLUMLP(nn.Module):
    """Llama's MLP: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` with the gating from ``fl.swiglu`` (one kernel
    forward and backward). ``SwiGLUMLP(dim, hidden_dim, bias=False, device=None, dtype=None)``; parameters named as
    Llama's (``gate_proj``, ``up_proj``: dim -> hidden_dim; ``down_proj``: hidden_dim -> dim; each an nn.Linear), so
    a Llama MLP's state_dict loads as it is."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False, device=None, dtype=None) -> None:
        super().__init__()
        factory = dict(bias=bias, device=device, dtype=dtype)
        self.gate_proj = nn.Linear(dim, hidden_dim, **factory)
        self.up_proj = nn.Linear(dim, hidden_dim, **factory)
        self.down_proj = nn.Linear(hidden_dim, dim, **factory)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.swiglu(self.gate_proj(x), self.up_proj(x)))


class GeGLUMLP(SwiGLUMLP):
    """Gemma's MLP: ``down_proj(gelu(gate_proj(x), approximate) * up_proj(x))`` with the gating from ``fl.geglu``.
    ``GeGLUMLP(dim, hidden_dim, bias=False, device=None, dtype=None, approximate="tanh")`` (Gemma's
    ``gelu_pytorch_tanh``; "none": exact GELU); parameters named as Gemma's, so its MLP's state_dict loads as it is."""

    def __init__(self, dim: int, hidden_dim: int, bias: bool = False, device=None, dtype=None,
                 approximate: str = "tanh") -> None:
        super().__init__(dim, hidden_dim, bias, device, dtype)
        if approximate not in ("none", "tanh"):
            raise ValueError(f"approximate must be 'none' or 'tanh' (as F.gelu), got {approximate!r}")
        self.approximate = approximate

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.geglu(self.gate_proj(x), self.up_proj(x), self.approximate))

    def extra_repr(self) -> str:
        return f"approximate={self.approximate!r}"


# ----------------------------------------------------------------------------- rotary position embedding



class ApplyRotaryEmbedding(nn.Module):
    """``fl.rotary_embedding`` as a module (no parameters): ``forward(q, k, cos, sin) -> (q', k')``, equal to
    transformers' ``apply_rotary_pos_emb(q, k, cos, sin)``; cos/sin come from the model's rotary embedding."""

    def forward(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
        return F.rotary_embedding(q, k, cos, sin)
