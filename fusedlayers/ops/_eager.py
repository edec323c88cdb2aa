"""Registering the ops, and calling them without the dispatcher's host cost in plain eager code.

A ``torch.library.custom_op`` call costs host time beyond its Python body: the dispatcher, and with
autograd custom_op's generic wrapper (argument normalisation, alias checks, a dynamo-disable wrapper).
Measured on a laptop CPU with the kernel launches stubbed out: fl.softmax forward+backward 157 us through
the registered ops, 59 us for the same bodies under one autograd.Function; torch.softmax takes 25 us. On
a GPU that difference is the time of a kernel over a 256 MiB tensor, so eager calls were bound by the CPU.

In plain eager code the dispatcher only routes the call to the op's body, so :func:`call` runs the body
itself, under :class:`_EagerOp`, an autograd.Function that uses the op's registered setup_context and
backward (the same code the registered autograd runs). Wherever something could tell the difference it
calls the registered op instead: torch.compile tracing, a dispatch mode (FakeTensorMode, the selective
checkpoint policy, FlopCounterMode, opcheck), a function mode (``torch.device``), autocast where the op
registered an autocast rule for an autocast-enabled device (unless that rule is only a cast of the inputs, recorded
with :func:`register_autocast_cast`: then the fast path casts as the rule does and runs the body with that
device's autocast off, as the rule runs the op), functorch transforms, tensor subclasses.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

_BODIES: dict = {}  # op -> its Python body
_AUTOGRAD: dict = {}  # op -> (backward, setup_context)
_PLAIN_TYPES = (Tensor, nn.Parameter)
enabled = True  # tests switch the fast path off to compare it with the dispatcher's path


def custom_op(name: str) -> Callable:
    """``torch.library.custom_op(name, mutates_args=())`` that also records the body for :func:`call`."""

    def register(body: Callable):
        op = torch.library.custom_op(name, mutates_args=())(body)
        _BODIES[op] = body
        return op

    return register


def register_autograd(op, backward: Callable, setup_context: Callable) -> None:
    """``op.register_autograd(backward, setup_context=...)``, recorded for :func:`call` too."""
    op.register_autograd(backward, setup_context=setup_context)
    _AUTOGRAD[op] = (backward, setup_context)


_AUTOCAST_KEYS = {"cpu": "AutocastCPU", "cuda": "AutocastCUDA"}
_autocast_rules: dict = {}  # op -> the devices (of _AUTOCAST_KEYS) for which it registered an autocast rule
_AUTOCAST_CASTS: dict = {}  # op -> cast(device_type, dtype, args) -> args: its autocast rule, when only a cast


def register_autocast_cast(op, cast: Callable) -> None:
    """Record that ``op``'s autocast rule (registered for each of _AUTOCAST_KEYS' devices) is ``cast(device_type,
    dtype, args)`` followed by the op itself with that device's autocast key excluded: :func:`call` then does the
    same without the dispatcher (on a GPU host, the registered rule's path costs about as much as the body)."""
    _AUTOCAST_CASTS[op] = cast


def _autocast_devices(op) -> list[str]:
    """The autocast-enabled devices whose rule of ``op`` applies (after _autocast_rule_applies has read the rules)."""
    return [device for device in _AUTOCAST_KEYS if torch.is_autocast_enabled(device) and device in _autocast_rules[op]]


def _autocast_rule_applies(op) -> bool:
    """Whether autocast, which is on, has a rule of the op's own to apply (ops/<op>.py registers it). Without one,
    autocast falls through to the op, whose body then runs as the fast path runs it (autocast still on for the
    aten ops inside it): the training step under autocast keeps the fast path for most of its ops."""
    on = [device for device in _AUTOCAST_KEYS if torch.is_autocast_enabled(device)]
    if not on:  # another device's autocast: no shortcut
        return True
    rules = _autocast_rules.get(op)
    if rules is None:
        name = op._opoverload._schema.name
        rules = _autocast_rules[op] = {device for device, key in _AUTOCAST_KEYS.items()
                                       if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)}
    return any(device in rules for device in on)


def _modes_active() -> bool:
    return bool(torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled()
                or torch._C._are_functorch_transforms_active())


def call(op, *args):
    """``op(*args)`` (all arguments positional), skipping the dispatcher where nothing can tell."""
    if not enabled or torch.compiler.is_compiling() or _modes_active():
        return op(*args)
    if torch._C._is_any_autocast_enabled() and _autocast_rule_applies(op):
        cast = _AUTOCAST_CASTS.get(op)
        devices = _autocast_devices(op) if cast is not None and op in _autocast_rules else []
        if not devices:  # a rule that is more than a cast, or autocast on another device
            return op(*args)
        keys = torch._C.DispatchKeySet(torch._C.DispatchKey.Undefined)
        for device in devices:
            args = cast(device, torch.get_autocast_dtype(device), args)
            keys = keys | torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, _AUTOCAST_KEYS[device]))
        with torch._C._ExcludeDispatchKeyGuard(keys):
            return _call_body(op, args)
    return _call_body(op, args)


def _call_body(op, args):
    needs_grad = False
    for a in args:  # one pass: every call of every op runs this
        if isinstance(a, Tensor):
            if type(a) not in _PLAIN_TYPES:  # a tensor subclass dispatches on its own
                return op(*args)
            needs_grad = needs_grad or a.requires_grad
    if needs_grad and torch.is_grad_enabled():
        if op not in _AUTOGRAD:  # e.g. a backward op under double backward: the dispatcher's error, not no grad
            return op(*args)
        return _EagerOp.apply(*args, op)
    return _BODIES[op](*args)


class _EagerOp(torch.autograd.Function):
    """An op's body with its registered autograd; the op itself is the last argument (so that
    ``ctx.needs_input_grad[i]`` is the op's input i, as in the registered autograd)."""

    @staticmethod
    def forward(ctx, *args):
        *inputs, op = args
        inputs = tuple(inputs)
        output = _BODIES[op](*inputs)
        backward, setup_context = _AUTOGRAD[op]
        ctx.op_backward = backward
        # outputs marked non-differentiable (a logsumexp, a norm's statistics) get None for a gradient rather than a
        # zero-filled tensor: no op's backward reads them, and each fill is an allocation and a kernel launch on the
        # backward's path
        ctx._materialize_non_diff_grads = False
        setup_context(ctx, inputs, output)
        return output

    @staticmethod
    def backward(ctx, *grads):
        grads_in = ctx.op_backward(ctx, *grads)
        return (*(grads_in if isinstance(grads_in, tuple) else (grads_in,)), None)


# ----------------------------------------------------------------------------- torch.compile


def register_inductor_fallbacks() -> None:
    """Registers each op with inductor as the fallback (a call to the op) that inductor makes of it when it first meets
    it in a graph. On that first meeting torch < 2.13 formats an info-level log line eagerly, printing each argument's
    IR with its whole history; behind a deep model's last op (the LM-head loss after 12 blocks whose norms and residual
    stream are all our ops) that string grows exponentially with depth: compiling llama-small on torch 2.11 did not
    finish in 7 minutes (torch 2.13 formats it lazily). Registered beforehand, the same fallbacks skip that path."""
    from torch._inductor.lowering import lowerings, make_fallback, tag_to_layout_constraint
    from torch._library.utils import get_layout_constraint_tag

    for op in _BODIES:
        overload = op._opoverload
        if overload not in lowerings:
            tag = get_layout_constraint_tag(overload, with_default=True)
            make_fallback(overload, layout_constraint=tag_to_layout_constraint(tag))
