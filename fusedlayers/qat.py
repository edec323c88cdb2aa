"""Quantization-aware training: ``prepare`` swaps ``nn.Linear`` for ``FakeQuantLinear``; ``convert`` swaps each
``FakeQuantLinear`` for a ``QuantizedLinear`` that stores int8 (or, at 4 bits and below, packed two-per-byte
int4) weights and fp32 scales.

Typical use (torchao's 8da4w recipe: int8 per-token activations, int4 per-group weights)::

    model = fl.qat.prepare(model, weight_bits=4, act_bits=8, group_size=32, skip=["lm_head"])  # per group of 32
    ...  # fine-tune as usual (the fake quantization is in the forward)
    model = fl.qat.convert(model)  # int weights; outputs equal the fake-quantized model's

Post-training quantization (PTQ) is ``prepare`` without fine-tuning (the weight scales are max|w|-based).
"""

from __future__ import annotations

import fnmatch
import functools
from collections.abc import Callable, Iterable

import torch
from torch import Tensor, nn

from fusedlayers import functional as F
from fusedlayers.modules import (
    FakeQuantLinear,
    absmax_scale,
    check_quant_config,
    quant_range,
    resolve_granularity,
    scale_shape,
)
from fusedlayers.ops.fake_quantize import ROUND_AFTER, round_reference

__all__ = ["prepare", "convert", "QuantizedLinear", "FakeQuantLinear", "enable_fake_quant", "disable_fake_quant",
           "state_dict_nbytes", "pack_int4", "unpack_int4"]

SkipSpec = Iterable[str] | Callable[[str, nn.Module], bool] | None


def _skipped(name: str, module: nn.Module, skip: SkipSpec) -> bool:
    if skip is None:
        return False
    if callable(skip):
        return bool(skip(name, module))
    for pattern in skip:
        if name == pattern or name.startswith(pattern + ".") or fnmatch.fnmatchcase(name, pattern):
            return True
    return False


def _children(model: nn.Module):
    """(parent, attribute name, qualified name, child) for every submodule, computed before any swap."""
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            yield parent, child_name, f"{parent_name}.{child_name}" if parent_name else child_name, child


def prepare(model: nn.Module, weight_bits: int | None = 8, act_bits: int | None = None,
            granularity: str | None = None, group_size: int | None = None, skip: SkipSpec = (),
            learnable_scale: bool = False, scale_init: str = "absmax") -> nn.Module:
    """Swap every ``nn.Linear`` of ``model`` (exactly that type; subclasses such as attention's
    NonDynamicallyQuantizableLinear are left alone) for a ``FakeQuantLinear`` holding the same weight and
    bias parameters, in place. Returns ``model`` (or the new module when ``model`` itself is an nn.Linear).

    ``weight_bits`` (2..8 or None), ``act_bits`` (2..8 or None: activations not quantized), ``granularity``
    ("per_tensor" | "per_channel" | "per_group" | None) and ``group_size`` (must divide each swapped layer's
    in_features), ``learnable_scale`` / ``scale_init``: see ``FakeQuantLinear``. A ``group_size`` means
    per-group quantization: ``granularity`` None (the default) is "per_group" with a group_size and
    "per_channel" without one (torchao's ``group_size`` works so), e.g. ``prepare(model, weight_bits=4,
    group_size=32)``; an explicit "per_channel" / "per_tensor" with a group_size is a ValueError.
    ``skip``: qualified module names to leave alone (a name also covers its submodules; shell-style
    patterns such as ``"*.lm_head"`` allowed), or a callable ``skip(name, module) -> bool``.
    Every layer's config is checked before any is swapped: a bad config raises a ValueError / TypeError
    naming the layer and leaves the model unchanged.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module, got {type(model).__name__}")
    if skip is not None and not callable(skip) and (isinstance(skip, str) or not isinstance(skip, Iterable)):
        raise TypeError("skip must be an iterable of module names / patterns or a callable(name, module)")
    check = functools.partial(check_quant_config, weight_bits=weight_bits, weight_granularity=granularity,
                              group_size=group_size, act_bits=act_bits, granularity_arg="granularity")
    config = dict(weight_bits=weight_bits, weight_granularity=resolve_granularity(granularity, group_size),
                  group_size=group_size, act_bits=act_bits, learnable_scale=learnable_scale, scale_init=scale_init)
    if type(model) is nn.Linear:
        check(model.in_features)
        return FakeQuantLinear.from_linear(model, **config)
    targets = [(parent, attr, name, child) for parent, attr, name, child in _children(model)
               if type(child) is nn.Linear and not _skipped(name, child, skip)]
    check(group_size or 0)  # the config itself, even if no layer is swapped (a group divides itself)
    for _, _, name, child in targets:
        check(child.in_features, where=name)
    for parent, attr, _, child in targets:
        setattr(parent, attr, FakeQuantLinear.from_linear(child, **config))
    return model


def _set_fake_quant(model: nn.Module, enabled: bool) -> nn.Module:
    for module in model.modules():
        if isinstance(module, FakeQuantLinear):
            module.fake_quant_enabled = enabled
    return model


def enable_fake_quant(model: nn.Module) -> nn.Module:
    """Turn fake quantization on in every FakeQuantLinear of ``model``."""
    return _set_fake_quant(model, True)


def disable_fake_quant(model: nn.Module) -> nn.Module:
    """Turn it off: each FakeQuantLinear then computes exactly nn.Linear."""
    return _set_fake_quant(model, False)


def state_dict_nbytes(model: nn.Module) -> int:
    """Bytes of all tensors in ``model.state_dict()`` (shared tensors counted once)."""
    seen, total = set(), 0
    for tensor in model.state_dict().values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tensor.dtype, tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            total += tensor.numel() * tensor.element_size()
    return total


# ----------------------------------------------------------------------------- int4 packing


def pack_int4(q: Tensor) -> Tensor:
    """Pack int8 values in [-8, 7] two per byte along the last dim (low nibble first) as uint8; an odd
    last dim is padded with a zero."""
    if q.shape[-1] % 2:
        q = torch.nn.functional.pad(q, (0, 1))
    nibbles = (q.to(torch.int16) & 0xF).to(torch.uint8)
    return nibbles[..., 0::2] | (nibbles[..., 1::2] << 4)


def unpack_int4(packed: Tensor, size: int) -> Tensor:
    """Inverse of ``pack_int4``: int8 values, last dim ``size``."""
    nibbles = torch.stack((packed & 0xF, packed >> 4), dim=-1).reshape(*packed.shape[:-1], -1)[..., :size]
    values = nibbles.to(torch.int8)
    return torch.where(values >= 8, values - 16, values)


# ----------------------------------------------------------------------------- QuantizedLinear


class QuantizedLinear(nn.Module):
    """A linear layer with integer weights: ``qweight`` (int8 for 5..8 bits; uint8 holding two int4 values
    per byte for 2..4 bits), fp32 ``weight_scale`` (per tensor (1,), per output channel (out,) or per group
    (out, in // group_size)), and ``bias`` in the float dtype. The forward dequantizes the weight
    (``q * scale`` in fp32, then the float dtype: exactly the fake-quantized weight of the
    FakeQuantLinear it came from), fake-quantizes activations per token when ``act_bits`` is set (as the
    FakeQuantLinear did), and runs ``F.linear``: its outputs equal the fake-quantized model's. It is a
    storage format with a reference compute path (no int GEMM kernel). Inference only: no gradients.
    Do not cast it with ``.half()`` / ``.to(dtype)`` (that would round the scales); the float dtype is fixed
    at construction.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, weight_bits: int = 8,
                 weight_granularity: str | None = None, group_size: int | None = None,
                 act_bits: int | None = None, dtype: torch.dtype = torch.float32, device=None) -> None:
        super().__init__()
        if weight_bits is None:
            raise ValueError("QuantizedLinear needs weight_bits (2..8)")
        check_quant_config(in_features, weight_bits, weight_granularity, group_size, act_bits)
        weight_granularity = resolve_granularity(weight_granularity, group_size)  # as FakeQuantLinear's
        self.in_features, self.out_features = in_features, out_features
        self.weight_bits, self.weight_granularity, self.group_size = weight_bits, weight_granularity, group_size
        self.act_bits = act_bits
        self.dtype = dtype
        packed = weight_bits <= 4
        cols = (in_features + 1) // 2 if packed else in_features
        self.register_buffer("qweight", torch.zeros((out_features, cols), dtype=torch.uint8 if packed else torch.int8,
                                                    device=device))
        shape = scale_shape((out_features, in_features), weight_granularity, group_size)
        self.register_buffer("weight_scale", torch.ones(shape, dtype=torch.float32, device=device))
        if bias:
            self.register_buffer("bias", torch.zeros(out_features, dtype=dtype, device=device))
        else:
            self.bias = None

    @property
    def packed(self) -> bool:
        return self.weight_bits <= 4

    @classmethod
    @torch.no_grad()
    def from_fake_quant(cls, module: FakeQuantLinear) -> QuantizedLinear:
        """Quantize ``module``'s weight with the scales its forward uses."""
        if module.weight_bits is None:
            raise ValueError("from_fake_quant needs a FakeQuantLinear with weight_bits set")
        weight = module.weight.detach()
        out = cls(module.in_features, module.out_features, bias=module.bias is not None,
                  weight_bits=module.weight_bits, weight_granularity=module.weight_granularity,
                  group_size=module.group_size, act_bits=module.act_bits, dtype=weight.dtype, device=weight.device)
        if module.weight_scale is not None:
            scale = module.weight_scale.detach().float()
        else:
            scale = absmax_scale(weight, module.weight_bits, module.weight_granularity, module.group_size)
        qmin, qmax = quant_range(module.weight_bits)
        s = out._broadcast_scale(scale)
        w = weight.float()
        if module.weight_granularity == "per_group":
            w = w.reshape(w.shape[0], -1, module.group_size)
        zero = torch.zeros((), dtype=torch.float32, device=w.device)
        q = round_reference(w, 1.0 / s, zero, ROUND_AFTER).clamp(qmin, qmax).reshape(weight.shape).to(torch.int8)
        out.qweight.copy_(pack_int4(q) if out.packed else q)
        out.weight_scale.copy_(scale)
        if module.bias is not None:
            out.bias.copy_(module.bias.detach())
        return out

    def _broadcast_scale(self, scale: Tensor) -> Tensor:
        if self.weight_granularity == "per_tensor":
            return scale.reshape(())
        if self.weight_granularity == "per_channel":
            return scale.reshape(-1, 1)
        return scale.reshape(self.out_features, -1, 1)

    def int_weight(self) -> Tensor:
        """The integer weight values as int8, shape (out_features, in_features)."""
        return unpack_int4(self.qweight, self.in_features) if self.packed else self.qweight

    def dequantize_weight(self) -> Tensor:
        q = self.int_weight().float()
        if self.weight_granularity == "per_group":
            q = q.reshape(self.out_features, -1, self.group_size)
        w = q * self._broadcast_scale(self.weight_scale.float())
        return w.reshape(self.out_features, self.in_features).to(self.dtype)

    def forward(self, input: Tensor) -> Tensor:
        if self.act_bits is not None:
            input = F.fake_quantize_dynamic(input, *quant_range(self.act_bits))
        return nn.functional.linear(input, self.dequantize_weight(), self.bias)

    def extra_repr(self) -> str:
        group = f", group_size={self.group_size}" if self.group_size else ""
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"weight_bits={self.weight_bits}{' (packed 2 per byte)' if self.packed else ''}, "
                f"weight_granularity={self.weight_granularity!r}{group}, act_bits={self.act_bits}")


@torch.no_grad()
def convert(model: nn.Module) -> nn.Module:
    """Replace every ``FakeQuantLinear`` of ``model`` in place by a ``QuantizedLinear`` with its weight
    quantized by the scales its forward uses (also when its fake quantization is currently disabled). A
    FakeQuantLinear without weight quantization becomes an ``nn.Linear`` (same parameters) if it has no
    activation quantization either, else stays as is. Returns ``model`` (or the new module when ``model``
    itself is a FakeQuantLinear)."""

    def converted(module: FakeQuantLinear) -> nn.Module:
        if module.weight_bits is not None:
            return QuantizedLinear.from_fake_quant(module)
        if module.act_bits is not None:
            return module
        linear = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None, device="meta")
        linear.weight, linear.bias = module.weight, module.bias
        return linear.train(module.training)

    if isinstance(model, FakeQuantLinear):
        return converted(model)
    for parent, attr, _, child in list(_children(model)):
        if isinstance(child, FakeQuantLinear):
            setattr(parent, attr, converted(child))
    return model
