"""Our attention kernels as a flash-attention implementation of PyTorch's SDPA.

    import fusedlayers.integrations.sdpa as fl_sdpa
    fl_sdpa.enable()        # or: torch.nn.attention.activate_flash_attention_impl("fusedlayers")
    model(x)                # its F.scaled_dot_product_attention calls now run our Triton kernels
    fl_sdpa.disable()       # torch's own flash kernels again

``enable()`` also switches torch's cuDNN SDPA backend off until ``disable()``: torch 2.11 prefers cuDNN over
flash on Hopper, so otherwise the calls flash would take go to cuDNN (``enable(prefer_flash=False)`` keeps it;
then only calls torch routes to flash, e.g. under ``sdpa_kernel(SDPBackend.FLASH_ATTENTION)``, reach us).

Importing this module registers the implementation under the name ``"fusedlayers"`` with
``torch.nn.attention.register_flash_attention_impl`` (torch >= 2.11); activating it overrides, for CUDA
tensors, the two aten ops that torch's flash backend consists of, ``_scaled_dot_product_flash_attention``
and its backward, exactly as torch's own FA3/FA4 registrations do (``torch/nn/attention/_fa4.py``). So
everything torch routes to its flash backend runs our forward and backward kernels, autograd and
``torch.compile`` included (the schemas, hence torch's meta functions, are unchanged); everything torch
routes elsewhere (an ``attn_mask``, fp32, head dims flash refuses, CPU tensors) runs torch's own choice,
untouched. Our kernels cover every call the flash backend accepts: fp16/bf16, head dims up to 256, L != S,
causal (top-left, as torch), grouped-query heads, dropout.

Schema details honoured: the output is allocated like ``query`` (the meta function's ``empty_like``), the
logsumexp is (B, H, L) fp32 in natural log, and the gradients are allocated like their inputs. Dropout: our
keep mask is a Philox hash under a seed drawn from torch's CPU generator (``torch.manual_seed`` reproduces it;
it is not torch's CUDA random stream); the seed travels from forward to backward in the ``rng_state`` output
(the slot torch's kernels use for their Philox seed), so the backward regenerates the same mask.
``return_debug_mask=True`` (used only by torch's own tests) is refused with an error.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fusedlayers.kernels import scaled_dot_product_attention as kernels
from fusedlayers.ops import scaled_dot_product_attention as attention_ops

NAME = "fusedlayers"
calls = {"forward": 0, "backward": 0}  # how many calls our kernels served (tests read it)


def _registry():
    try:
        from torch.nn import attention
        attention.register_flash_attention_impl  # noqa: B018  (torch >= 2.11)
    except (ImportError, AttributeError):
        return None
    return attention


def _dropout(seed: Tensor, dropout_p: float):
    return attention_ops.dropout_params(seed, dropout_p) if dropout_p > 0.0 else None


def _forward(query: Tensor, key: Tensor, value: Tensor, dropout_p: float = 0.0, is_causal: bool = False,
             return_debug_mask: bool = False, *, scale: float | None = None):
    if return_debug_mask:
        raise RuntimeError("fusedlayers flash attention: return_debug_mask=True is not supported "
                           "(torch.nn.attention.restore_flash_attention_impl() brings torch's kernel back)")
    B, H, L, E = query.shape
    S = key.shape[2]
    scale = 1.0 / math.sqrt(E) if scale is None else scale
    seed = attention_ops.draw_dropout_seed() if dropout_p > 0.0 else torch.zeros(2, dtype=torch.int64)
    out = torch.empty_like(query)  # flash takes value's head dim == query's
    lse = query.new_empty((B, H, L), dtype=torch.float32)
    if S == 0:
        out.zero_(), lse.fill_(float("inf"))
    else:
        kernels.attention_forward(query, key, value, None, _dropout(seed, dropout_p), is_causal, scale, out, lse)
    calls["forward"] += 1
    offset = torch.zeros((), dtype=torch.int64)
    debug_mask = query.new_empty((0,))
    return out, lse, None, None, L, S, seed, offset, debug_mask


def _backward(grad_out: Tensor, query: Tensor, key: Tensor, value: Tensor, out: Tensor, logsumexp: Tensor,
              cum_seq_q, cum_seq_k, max_q: int, max_k: int, dropout_p: float, is_causal: bool,
              philox_seed: Tensor, philox_offset: Tensor, *, scale: float | None = None):
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    dq, dk, dv = torch.empty_like(query), torch.empty_like(key), torch.empty_like(value)
    if key.shape[2] == 0:
        dq.zero_(), dk.zero_(), dv.zero_()
    else:
        kernels.attention_backward(grad_out, query, key, value, out, logsumexp, None,
                                   _dropout(philox_seed, dropout_p), is_causal, scale, dq, dk, dv, None)
    calls["backward"] += 1
    return dq, dk, dv


class _Handle:
    """Keeps the aten overrides alive; ``remove()`` drops them (torch's kernels come back)."""

    def __init__(self, library: torch.library.Library):
        self.library = library

    def remove(self) -> None:
        if self.library is not None:
            self.library._destroy()
            self.library = None


def _register_kernels() -> _Handle:
    library = torch.library.Library("aten", "IMPL", "CUDA")
    library.impl("_scaled_dot_product_flash_attention", _forward, "CUDA")
    library.impl("_scaled_dot_product_flash_attention_backward", _backward, "CUDA")
    return _Handle(library)


_cudnn_was_enabled: bool | None = None  # torch's cuDNN SDPA setting before enable(prefer_flash=True)


def enable(prefer_flash: bool = True) -> None:
    """Route torch's flash SDPA backend to our kernels (``activate_flash_attention_impl("fusedlayers")``).

    ``prefer_flash``: also switch off torch's cuDNN SDPA backend until :func:`disable` (torch 2.11 picks cuDNN
    before flash on Hopper for exactly the calls flash takes, so without this an unmodified model would not reach
    us there); calls flash cannot take then run torch's memory-efficient or math backend instead of cuDNN."""
    global _cudnn_was_enabled
    attention = _registry()
    if attention is None:
        raise RuntimeError(f"torch {torch.__version__} has no torch.nn.attention.register_flash_attention_impl "
                           "(needs torch >= 2.11); call fl.scaled_dot_product_attention directly instead")
    attention.activate_flash_attention_impl(NAME)
    if prefer_flash and _cudnn_was_enabled is None:
        _cudnn_was_enabled = torch.backends.cuda.cudnn_sdp_enabled()
        torch.backends.cuda.enable_cudnn_sdp(False)


def disable() -> None:
    """Back to torch's own flash kernels (and its cuDNN backend setting from before :func:`enable`)."""
    global _cudnn_was_enabled
    attention = _registry()
    if attention is not None and attention.current_flash_attention_impl() == NAME:
        attention.restore_flash_attention_impl()
    if _cudnn_was_enabled is not None:
        torch.backends.cuda.enable_cudnn_sdp(_cudnn_was_enabled)
        _cudnn_was_enabled = None


def is_enabled() -> bool:
    attention = _registry()
    return attention is not None and attention.current_flash_attention_impl() == NAME


if _registry() is not None:
    _registry().register_flash_attention_impl(NAME, register_fn=_register_kernels)
