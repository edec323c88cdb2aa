"""Activation checkpointing: free a block's activations after forward, recompute them in backward.

This op has no kernel: it is a mechanism around the autograd graph. ``fusedlayers.functional.checkpoint``
validates its arguments and calls :func:`checkpoint` here; ``fusedlayers.modules.CheckpointedBlock``
wraps a module with it.

Mechanism: saved-tensor hooks, not a reentrant autograd Function
----------------------------------------------------------------
The function runs once, normally, with grad enabled, so autograd records the ordinary graph (parameters
and inputs are in it, as without checkpointing) under ``torch.autograd.graph.saved_tensors_hooks``. The
pack hook replaces every tensor an autograd node saves for backward by a small handle (shape, dtype,
device and a slot number), so the activations are freed as soon as forward lets go of them. The first
time backward unpacks a handle of this call (per backward pass: graph task), the function runs again
with the recorded RNG, autocast and module-buffer state, under a second pack hook that collects what
autograd saves, in order, and checks each shape/dtype/device against the forward's; it stops as soon as
the last tensor still needed has been produced. Each unpack hands its tensor over and drops it.

Why not the reentrant design (a custom ``autograd.Function`` that runs the function under no_grad in
forward and calls ``torch.autograd.backward`` on a recomputed graph inside its backward): the forward
graph then hides the parameters, so ``torch.autograd.grad`` cannot reach them, inputs that do not require
grad leave the parameters without gradients, and the nested backward passes fire DDP's gradient-ready
hooks outside the main pass ("Expected to mark a variable ready only once" with reused parameters or
``find_unused_parameters=True``). With saved-tensor hooks the graph is exactly the unwrapped one; only
where its saved tensors come from changes, so autograd.grad, no-grad inputs, kwargs, nesting and DDP
behave as without checkpointing. (This is the design of ``torch.utils.checkpoint(use_reentrant=False)``;
this is our own implementation of it, plus the selective policy and the module-state guard below.)

Exactness: the recompute restores the CPU RNG state and the CUDA RNG state of the devices involved (the
global streams are left where they were after the recompute, so training draws the same random numbers
as without checkpointing), the autocast state (enabled, dtype, cache) of CPU and CUDA, and the module
buffers' values at the start of the forward.

Module state: buffers of the modules reachable from the function (the function itself if it is a module,
the module of a bound method, modules in ``functools.partial`` objects, closures and arguments) are
copied before the forward; the recompute runs on private copies of those copies and then puts the
originals back, so BatchNorm running stats, ``num_batches_tracked`` and observers are updated exactly
once (by the forward) and the recompute sees the state the forward saw. (BatchNorm updates its running
stats without bumping their version counter, so the copy cannot be skipped by looking at versions; a
block's buffers are usually tiny, but large constant buffers are copied too.) State kept elsewhere
(Python attributes, tensors in globals) is not guarded; such code can ask :func:`is_recomputing`.

Policies
--------
- ``"full"``: keep only the inputs; recompute everything in backward (memory per block: its inputs).
- ``"selective"``: keep the outputs of the expensive ops (matmuls, convolutions, attention and the
  ``torch.ops.fusedlayers`` attention / linear-cross-entropy ops) and recompute the cheap ones (norms,
  activations, dropout, elementwise), as selective activation recomputation in Megatron-LM and torch's SAC
  do, with two differences for attention written out as matmuls (``dropout(softmax(q @ k^T)) @ v``). Its
  probabilities (softmax outputs, also ``fl.softmax``'s) are kept, its scores are not: the recompute then
  reruns the dropout only, not the scores, their scaling and mask and the softmax (at T=1024, d=1024 that
  costs +33% step time, Megatron-LM's choice, against +8%: ``keep_matmuls`` is that choice). And copies
  (``aten.clone``: q, k, v and the attention output made contiguous for the matmuls) are kept: they take the
  memory their sources would, which are then freed, so the recompute needs neither the qkv matmul's output
  nor probs @ v's; a copy whose source the recompute holds anyway is made again instead of held twice.

  The recompute does not call the function again: a ``TorchDispatchMode`` records every aten-level op the
  forward runs (op, arguments, which earlier op made each tensor argument: a tape; the tensors themselves are
  not held) and keeps the chosen ops' outputs. After forward the tape is cut to the ops whose outputs lead to
  a tensor autograd saved, except through kept ops, plus the random and mutating ops (to draw the same
  numbers); kept outputs nothing on it reads are freed. The recompute runs those ops, in order, under
  no_grad: no Python of the function, no autograd recording, no op whose outputs only lead to kept ones. The
  host time this saves matters: a selective step is otherwise bound by the CPU (a dispatch mode costs
  microseconds per op, in forward and, when rerunning the function, in backward). Module buffers the ops read
  are replaced by private copies of their pre-forward values (BatchNorm's stats are updated once). The one
  case a tape cannot cover, computation outside the dispatcher (an autograd.Function launching its own
  kernels, as Liger-Kernel's do), is detected by its aten ops running with grad mode off; the recompute then
  calls the function again as ``full`` does, handing the kept outputs back in order.
- a callable ``policy(op, *args, **kwargs) -> bool``: True to keep that op's output. ``op`` is an
  ``torch._ops.OpOverload`` (e.g. ``torch.ops.aten.mm.default``), args are its (autograd-free) tensors
  and values. It is called in forward (and again in the recompute when the function is called again), and
  must answer the same both times. Views and in-place/mutating ops are never kept (the recompute must create
  them itself); a kept op that consumed random numbers moves the RNG to where the forward left it.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import threading
import types
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

__all__ = ["checkpoint", "CheckpointError", "is_recomputing", "is_expensive_op", "keep_matmuls", "POLICIES"]

POLICIES = ("full", "selective")


class CheckpointError(RuntimeError):
    """The recompute in backward did not reproduce what the forward saved (or cannot run)."""


_local = threading.local()


def is_recomputing() -> bool:
    """True while a checkpointed function is being re-run in backward (on this thread)."""
    return getattr(_local, "depth", 0) > 0


@contextlib.contextmanager
def _recomputing():
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1


@contextlib.contextmanager
def _bookkeeping():
    """The checkpoint's own ops (saving the inputs, copying buffers; some run with grad mode off) are run past an
    enclosing selective checkpoint's mode: they are not the function's, and must not mark its tape unsafe. (Only
    our modes skip them: user modes and tensor subclasses see them as before.)"""
    previous = getattr(_local, "bookkeeping", False)
    _local.bookkeeping = True
    try:
        yield
    finally:
        _local.bookkeeping = previous


class _StopRecompute(Exception):
    """Raised from the recompute's pack hook once the last tensor still needed exists."""


# ----------------------------------------------------------------------------- the selective policy

# aten ops whose outputs "selective" keeps: matmuls, convolutions, fused attention.
EXPENSIVE_ATEN_OPS = frozenset({
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "_scaled_mm", "_int_mm", "_addmm_activation",
    "convolution", "_convolution", "cudnn_convolution", "mkldnn_convolution",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable", "_flash_attention_forward",
    "_efficient_attention_forward",
})
# torch.ops.fusedlayers ops kept by "selective", matched by name prefix (so ops added later count too).
EXPENSIVE_FUSEDLAYERS_PREFIXES = ("attention", "scaled_dot_product_attention", "flash_attention",
                                  "linear_cross_entropy")
# Also kept by "selective": attention probabilities (softmax outputs), so that the recompute needs neither the
# scores nor their scaling and masking (s*s per head: recomputing them costs a third of a d=1024, T=1024 block's
# GPU time); and copies (``.contiguous()`` before a matmul), which take the memory their sources would (those are
# then freed; a copy whose source the recompute holds anyway is made again instead of held twice).
PROBABILITY_OPS = frozenset({"aten::_softmax", "aten::_safe_softmax", "fusedlayers::softmax",
                             "fusedlayers::scaled_masked_softmax"})
COPY_OPS = frozenset({"aten::clone"})


@functools.cache  # called for every op a selective checkpoint runs; reading op._schema costs microseconds
def is_expensive_op(op) -> bool:
    """The default selective policy: is ``op`` (an OpOverload) a matmul, convolution or attention op of
    aten, or an attention / linear-cross-entropy op of ``torch.ops.fusedlayers``?"""
    namespace, _, name = op._schema.name.partition("::")
    if namespace == "aten":
        return name in EXPENSIVE_ATEN_OPS
    if namespace == "fusedlayers":
        return name.startswith(EXPENSIVE_FUSEDLAYERS_PREFIXES) and "backward" not in name
    return False


def keep_matmuls(op, *args, **kwargs) -> bool:
    """A policy for ``fl.checkpoint``: keep only the outputs of matmuls, convolutions and attention ops (not the
    attention scores), recompute everything else, softmax included: Megatron-LM's selective recomputation. Less
    memory than ``"selective"`` where attention is written out (no s*s probabilities held), more recompute."""
    return _traits(op).keepable and is_expensive_op(op) and not _attention_scores(op, args)


_BMM, _BADDBMM = torch.ops.aten.bmm.default, torch.ops.aten.baddbmm.default


def _attention_scores(op, args) -> bool:
    """A batched matmul whose output is larger than its two factors: attention scores ``q @ k^T`` (s*s per
    head from two s*d factors). Not kept: with the softmax outputs kept nothing in the recompute reads them,
    and a policy that recomputes the softmax recomputes them too, as Megatron-LM's selective recomputation
    does. Linear layers run ``mm`` / ``addmm`` and are always kept."""
    if op is not _BMM and op is not _BADDBMM:
        return False
    a, b = args[-2], args[-1]  # bmm(a, b); baddbmm(input, a, b)
    return a.shape[1] * b.shape[2] > a.shape[2] * (a.shape[1] + b.shape[2])


class _OpTraits(NamedTuple):
    keepable: bool  # its outputs can be handed back from a cache: it neither returns views nor mutates
    uses_rng: bool
    for_effect: bool  # the replay runs it whatever its outputs feed: it draws random numbers or mutates
    selective: bool  # kept by policy="selective" (attention scores aside): expensive, probabilities, copies
    aten: bool


_traits_by_id: dict[int, tuple] = {}


def _traits(op) -> _OpTraits:
    """What the selective mode needs to know about an op, read from its schema once. Keyed by id: this runs for
    every op a selective checkpoint dispatches, and reading ``op._schema`` or hashing an OpOverload (a Python
    ``__hash__``) costs about a microsecond each."""
    entry = _traits_by_id.get(id(op))
    if entry is None or entry[0] is not op:
        schema = op._schema
        keepable = not schema.is_mutable and all(r.alias_info is None for r in schema.returns)
        uses_rng = op.namespace != "aten" or torch.Tag.nondeterministic_seeded in op.tags
        selective = keepable and (is_expensive_op(op) or schema.name in PROBABILITY_OPS or schema.name in COPY_OPS)
        entry = _traits_by_id[id(op)] = (op, _OpTraits(keepable, uses_rng, uses_rng or schema.is_mutable, selective,
                                                       op.namespace == "aten"))
    return entry[1]


def _keepable(op) -> bool:
    """Outputs of views and of ops that mutate an argument cannot be handed back from a cache."""
    return _traits(op).keepable


def _detach(x):
    return x.detach() if isinstance(x, Tensor) else x


def _flat(out) -> bool:
    """A tuple / list of tensors and values, none nested (most aten ops' outputs): no pytree walk needed."""
    return (type(out) is tuple or type(out) is list) and not any(type(x) is tuple or type(x) is list for x in out)


def _detached(out):
    """An op's outputs detached."""
    if isinstance(out, Tensor):
        return out.detach()
    if _flat(out):
        return type(out)([x.detach() if isinstance(x, Tensor) else x for x in out])
    return tree_map(_detach, out)


# ----------------------------------------------------------------------------- RNG and autocast state


def _cuda_devices(tensors) -> list[int]:
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return []
    devices = {t.device.index for t in tensors if t.is_cuda}
    if not devices:  # the function may move data to the GPU itself
        devices = {torch.cuda.current_device()}
    return sorted(devices)


class _RngState:
    """CPU RNG state and the CUDA RNG states of ``devices``."""

    def __init__(self, devices: list[int], cpu: bool = True) -> None:
        self.cpu = torch.get_rng_state() if cpu else None
        self.devices = devices
        self.cuda = [torch.cuda.get_rng_state(d) for d in devices]

    def set(self) -> None:
        if self.cpu is not None:
            torch.set_rng_state(self.cpu)
        for device, state in zip(self.devices, self.cuda, strict=True):
            torch.cuda.set_rng_state(state, device)


@contextlib.contextmanager
def _rng_restored(state: _RngState | None):
    """Run with ``state`` set, then put the RNG back where it was (no-op for None)."""
    if state is None:
        yield
        return
    current = _RngState(state.devices)
    state.set()
    try:
        yield
    finally:
        current.set()


def _autocast_device_types() -> tuple[str, ...]:
    return ("cpu", "cuda") if torch.cuda.is_available() else ("cpu",)


def _autocast_state():
    return ([(t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t)) for t in _autocast_device_types()],
            torch.is_autocast_cache_enabled())


@contextlib.contextmanager
def _autocast_restored(state):
    per_device, cache = state
    with contextlib.ExitStack() as stack:
        for device_type, enabled, dtype in per_device:
            stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled, cache_enabled=cache))
        yield


# ----------------------------------------------------------------------------- module state


def _find_modules(roots) -> list[nn.Module]:
    """Modules reachable from the function and its arguments (bound methods, partials, closures)."""
    found: list[nn.Module] = []
    seen: set[int] = set()

    def visit(obj, depth: int) -> None:
        if depth > 4 or id(obj) in seen or isinstance(obj, (Tensor, str, bytes, int, float, bool, type(None))):
            return
        seen.add(id(obj))
        if isinstance(obj, nn.Module):
            found.append(obj)
        elif inspect.ismethod(obj):
            visit(obj.__self__, depth + 1)
            visit(obj.__func__, depth + 1)
        elif isinstance(obj, functools.partial):
            for item in (obj.func, *obj.args, *obj.keywords.values()):
                visit(item, depth + 1)
        elif isinstance(obj, types.FunctionType):
            for cell in obj.__closure__ or ():
                try:
                    visit(cell.cell_contents, depth + 1)
                except ValueError:  # empty cell
                    pass
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for item in obj:
                visit(item, depth + 1)
        elif isinstance(obj, dict):
            for item in obj.values():
                visit(item, depth + 1)

    for root in roots:
        visit(root, 0)
    return found


class _BufferGuard:
    """The buffers of some modules as they were before the forward; swaps copies in for the recompute."""

    def __init__(self, modules: list[nn.Module]) -> None:
        self.entries: list[tuple[dict, str, Tensor]] = []
        self.index: dict[int, int] = {}  # id(buffer) -> its entry (the tape refers to buffers by entry)
        seen: set[tuple[int, str]] = set()
        with torch.no_grad():
            for root in modules:
                for module in root.modules():
                    for name, buf in module._buffers.items():
                        if buf is None or (id(module), name) in seen:
                            continue
                        seen.add((id(module), name))
                        self.index.setdefault(id(buf), len(self.entries))
                        self.entries.append((module._buffers, name, buf.clone()))

    @contextlib.contextmanager
    def swapped(self):
        """Give each module a private copy of its pre-forward buffers, then restore the real ones."""
        if not self.entries:
            yield
            return
        current = [buffers[name] for buffers, name, _ in self.entries]
        with torch.no_grad():
            for buffers, name, before in self.entries:
                buffers[name] = before.clone()
        try:
            yield
        finally:
            for (buffers, name, _), buf in zip(self.entries, current, strict=True):
                buffers[name] = buf


# ----------------------------------------------------------------------------- dispatch modes (selective)


class _SelectiveMode(TorchDispatchMode):
    """Forward: run every op, keep the outputs of those the policy keeps, and record every op on the frame's tape.
    ``rerun=True`` (the recompute when the tape cannot stand in for the function): hand the kept outputs back, in
    the forward's order, instead of running their ops."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # Newer torch wraps __torch_dispatch__ in torch._dynamo.disable (tens of microseconds per op). Dynamo
        # never runs here anyway: checkpoint() is compiler-disabled and the recompute runs in backward.
        return False

    def __init__(self, frame: _Frame, rerun: bool = False) -> None:
        super().__init__()
        self.frame = frame
        self.rerun = rerun
        self.kept = 0  # ops kept (forward) or handed back (rerun) so far

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(_local, "bookkeeping", False):  # an inner checkpoint's own ops
            return func(*args, **kwargs)
        frame = self.frame
        traits = _traits(func)
        keep = frame.keeps(func, traits, args, kwargs)
        if self.rerun:
            return self._hand_back(func, args, kwargs) if keep else func(*args, **kwargs)
        out = func(*args, **kwargs)
        kept_index = -1
        if keep:
            rng = None
            if frame.preserve_rng_state and traits.uses_rng:
                rng = _RngState(_cuda_devices(_tensor_leaves((args, kwargs))))
            kept = _detached(out)
            frame.cache.append((func, kept, rng, _versions(kept)))
            kept_index = self.kept
            self.kept += 1
        if frame.tape.unsafe is None:
            frame.tape.record(func, traits, args, kwargs, out, kept_index)
        return out

    def _hand_back(self, func, args, kwargs):
        index = self.kept
        self.kept += 1
        entry = self.frame.cache[index] if index < len(self.frame.cache) else None
        if entry is None:  # dropped after forward: not needed, or changed in place
            return func(*args, **kwargs)
        op, out, rng, versions = entry
        if op is not func:
            raise CheckpointError(
                f"fl.checkpoint(policy=selective): the recompute ran {func} where the forward ran {op} "
                f"(kept op #{index}); the function must run the same ops when it is recomputed")
        if _versions(out) != versions:  # changed in place since (e.g. the caller changed the output)
            return func(*args, **kwargs)
        if rng is not None:
            rng.set()
        return _detached(out)


def _versions(out) -> tuple[int, ...]:
    if isinstance(out, Tensor):
        return (out._version,)
    if _flat(out):
        return tuple(x._version for x in out if isinstance(x, Tensor))
    return tuple(t._version for t in _tensor_leaves(out))


def _tensor_leaves(tree) -> list[Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, Tensor)]


# ----------------------------------------------------------------------------- the tape (selective)

_OP, _INPUT, _BUFFER, _OUTSIDE = range(4)  # where a tensor an op read comes from


class _Ref:
    """A tensor argument of a recorded op: output ``b`` of op ``a`` (_OP), the call's tensor input ``a`` (_INPUT),
    the pre-forward copy of guarded buffer ``a`` (_BUFFER), or a tensor from outside (parameters, constants)."""

    __slots__ = ("kind", "a", "b")

    def __init__(self, kind: int, a, b: int = 0) -> None:
        self.kind, self.a, self.b = kind, a, b


class _TapeOp:
    """One op the forward dispatched: the op, its arguments with tensors replaced by _Refs (no tensor of the forward
    is held), which ops made them, and its place in the frame's cache when kept."""

    __slots__ = ("op", "args", "kwargs", "inputs", "kept", "must_run")

    def __init__(self, op, traits: _OpTraits, args: list, kwargs: dict, inputs: list[int], kept: int) -> None:
        self.op, self.args, self.kwargs, self.inputs, self.kept = op, args, kwargs, inputs, kept
        self.must_run = traits.for_effect  # draws random numbers or mutates: the replay runs it in order


class _Tape:
    """The aten-level ops a selective forward ran, recorded so that the recompute can run just the ones it needs
    instead of calling the function again: no Python of the function, no autograd recording, and no op whose
    outputs only lead to kept ones. What an op read is known by tensor identity (``made_by``); the forward's
    tensors themselves are not held.

    It cannot stand in for the function when the function computes outside the dispatcher, e.g. a custom
    autograd.Function whose forward launches its own kernels on tensors it allocated (Liger-Kernel's ops): its
    allocations then show up as aten ops run with grad mode off (autograd.Function runs its forward under no_grad).
    Such a forward marks the tape ``unsafe`` and the recompute calls the function again (as ``full`` does, handing
    the kept outputs back). Ops registered with torch.library (ours) are dispatched whole and replay exactly."""

    def __init__(self, inputs: list[Tensor], buffers: _BufferGuard) -> None:
        self.ops: list[_TapeOp | None] = []
        self.made_by: dict[int, tuple[weakref.ref, int, int]] = {}  # id(tensor) -> (tensor, op, output index)
        self.inputs = {id(t): n for n, t in enumerate(inputs)}
        self.buffers = buffers.index
        self.slots: list[_Ref] = []  # per tensor autograd saved: where it comes from
        self.unsafe: str | None = None
        self.order: list[int] = []  # after forward: the ops the replay visits, in order
        self.frees: dict[int, list[int]] = {}  # op -> the ops whose outputs are last read by it
        self.saved_from: dict[int, list[tuple[int, int]]] = {}  # op -> [(slot, output index)]

    # --------------------------------------------------------------- forward

    def ref(self, tensor: Tensor, inputs: list[int] | None = None) -> _Ref:
        """Where ``tensor`` comes from; the index of the op that made it is appended to ``inputs``."""
        entry = self.made_by.get(id(tensor))
        if entry is not None and entry[0]() is tensor:
            if inputs is not None:
                inputs.append(entry[1])
            return _Ref(_OP, entry[1], entry[2])
        n = self.inputs.get(id(tensor))
        if n is not None:
            return _Ref(_INPUT, n)
        n = self.buffers.get(id(tensor))
        return _Ref(_BUFFER, n) if n is not None else _Ref(_OUTSIDE, tensor)

    def _args(self, values, inputs: list[int]) -> list:
        """``values`` with their tensors (also in lists: Tensor[] arguments) replaced by _Refs. (Plain loops: this
        runs for every op of the forward.)"""
        stored = []
        for value in values:
            if isinstance(value, Tensor):
                value = self.ref(value, inputs)
            elif type(value) is list or type(value) is tuple:
                for x in value:
                    if isinstance(x, Tensor):
                        value = type(value)([self.ref(y, inputs) if isinstance(y, Tensor) else y for y in value])
                        break
            stored.append(value)
        return stored

    def record(self, op, traits: _OpTraits, args, kwargs, out, kept: int) -> None:
        if traits.aten and not torch.is_grad_enabled():
            self.unsafe = (f"{op} ran with grad mode off inside the function (an autograd.Function's forward, or "
                           "torch.no_grad): it may compute outside the dispatcher")
            self.ops, self.made_by = [], {}
            return
        inputs: list[int] = []
        stored_args = self._args(args, inputs)
        stored_kwargs = dict(zip(kwargs, self._args(kwargs.values(), inputs), strict=True)) if kwargs else kwargs
        index = len(self.ops)
        self.ops.append(_TapeOp(op, traits, stored_args, stored_kwargs, inputs, kept))
        if isinstance(out, Tensor):
            self.made_by[id(out)] = (weakref.ref(out), index, 0)
        elif type(out) is tuple or type(out) is list:
            for k, t in enumerate(out):
                if isinstance(t, Tensor):
                    self.made_by[id(t)] = (weakref.ref(t), index, k)

    def finish(self, cache: list, ran_at_pack: int) -> None:
        """After forward: choose the ops the replay visits (those whose outputs lead to a saved tensor or to an op
        that must run, except through kept ops, which hand their outputs back without reading their inputs; and
        kept random ops, to move the RNG), free the kept outputs it does not read, and plan when it frees each op's
        outputs. E.g. with softmax outputs kept, q @ k^T, its scaling and its mask are never replayed; with the
        copies of q, k and v kept, neither is the qkv matmul (its kept output is freed now)."""
        self.made_by = {}
        ops = self.ops

        usable = [r.kept >= 0 and cache[r.kept] is not None for r in ops]  # kept: hands its outputs back
        needed: set[int] = set()
        stack = [ref.a for ref in self.slots if ref.kind == _OP]
        stack += [i for i in range(min(ran_at_pack, len(ops)))
                  if ops[i].must_run or (usable[i] and cache[ops[i].kept][2] is not None)]
        while stack:
            i = stack.pop()
            if i in needed:
                continue
            needed.add(i)
            if not usable[i]:
                stack.extend(ops[i].inputs)
        self.order = sorted(needed)
        for i in self.order:  # a kept copy of what the replay holds anyway: copied again rather than held twice
            if usable[i] and ops[i].op._schema.name in COPY_OPS and all(j in needed for j in ops[i].inputs):
                cache[ops[i].kept] = None
                usable[i] = False
        last_read: dict[int, int] = {}
        for i in self.order:
            if not usable[i]:
                for j in ops[i].inputs:
                    last_read[j] = i
        self.frees = {}
        for j in self.order:
            self.frees.setdefault(last_read.get(j, j), []).append(j)
        self.saved_from = {}
        for slot, ref in enumerate(self.slots):
            if ref.kind == _OP:
                self.saved_from.setdefault(ref.a, []).append((slot, ref.b))
        for i, record in enumerate(ops):
            if i not in needed:
                if record.kept >= 0:
                    cache[record.kept] = None  # kept, but nothing the replay runs reads it
                ops[i] = None  # (its arguments may hold tensors from outside)

    # --------------------------------------------------------------- backward

    def replay(self, frame: _Frame, inputs: list[Tensor], wanted: set[int]) -> dict[int, Tensor]:
        """The tensors of the ``wanted`` slots, by running the planned ops again on the call's inputs."""
        values: dict[int, list] = {}
        buffers: dict[int, Tensor] = {}

        def value(ref: _Ref):
            if ref.kind == _OP:
                return values[ref.a][ref.b]
            if ref.kind == _INPUT:
                return inputs[ref.a]
            if ref.kind == _BUFFER:  # a private copy of its pre-forward value: module state is updated once
                if ref.a not in buffers:
                    buffers[ref.a] = frame.buffers.entries[ref.a][2].clone()
                return buffers[ref.a]
            return ref.a

        def resolve(arg):
            if type(arg) is _Ref:
                return value(arg)
            if type(arg) is list or type(arg) is tuple:
                return type(arg)([value(x) if type(x) is _Ref else x for x in arg])
            return arg

        store = {slot: value(ref).detach() for slot, ref in enumerate(self.slots)
                 if slot in wanted and ref.kind != _OP}
        with contextlib.ExitStack() as stack:
            stack.enter_context(_rng_restored(frame.rng))
            stack.enter_context(torch.no_grad())
            stack.enter_context(torch._C._DisableAutocast())  # the recorded ops are autocast's casts already
            for i in self.order:
                record = self.ops[i]
                if record.kept >= 0 and frame.cache[record.kept] is not None:
                    _, out, rng, _ = frame.cache[record.kept]
                    if rng is not None:
                        rng.set()
                else:
                    out = record.op(*[resolve(a) for a in record.args],
                                    **{k: resolve(v) for k, v in record.kwargs.items()})
                values[i] = [out] if isinstance(out, Tensor) else out
                for slot, k in self.saved_from.get(i, ()):
                    if slot in wanted:
                        store[slot] = values[i][k]
                for j in self.frees.get(i, ()):
                    del values[j]
        return store


# ----------------------------------------------------------------------------- the frame of one call


class _SaveInputs(torch.autograd.Function):
    """Saves the call's tensor inputs as an autograd node's saved tensors, so that any saved-tensor hooks
    active around the call (an outer checkpoint: nesting) manage them like other activations."""

    @staticmethod
    def forward(ctx, dummy, *tensors):
        ctx.save_for_backward(*tensors)
        return torch.empty((0,))

    @staticmethod
    def backward(ctx, *grads):  # never reached: the output is not used
        return (None,) * (1 + len(ctx.saved_tensors))


class _Handle:
    """What autograd keeps instead of a saved tensor."""

    __slots__ = ("frame", "index", "__weakref__")

    def __init__(self, frame: _Frame, index: int) -> None:
        self.frame = frame
        self.index = index


_TENSOR = object()  # marks where a tensor argument goes when the arguments are rebuilt
_capture: list | None = None  # set by _capture_frames (tests and benchmarks inspect frames)


@contextlib.contextmanager
def _capture_frames():
    """Collect the frames of the checkpoint calls made inside (for tests: what a call keeps)."""
    global _capture
    previous, _capture = _capture, []
    try:
        yield _capture
    finally:
        _capture = previous


class _Frame:
    def __init__(self, function, policy, preserve_rng_state: bool) -> None:
        self.function = function
        self.policy = policy
        self.preserve_rng_state = preserve_rng_state
        self.metas: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.handles: list[weakref.ref] = []
        self.cache: list = []  # selective, per kept op: (op, outputs, RNG state after it, versions) or None
        self.kept_at_pack = 0  # selective: ops kept when the last tensor was saved
        self.ran_at_pack = 0  # selective: ops recorded when the last tensor was saved
        self.mode: _SelectiveMode | None = None
        self.tape: _Tape | None = None  # selective: the forward's ops (None when it cannot stand in for the function)
        self.recomputed: dict[int, dict[int, Tensor]] = {}

    # --------------------------------------------------------------- policy

    def keeps(self, op, traits: _OpTraits, args, kwargs) -> bool:
        if self.policy == "selective":
            return traits.selective and not _attention_scores(op, args)
        return traits.keepable and bool(self.policy(op, *args, **kwargs))

    # --------------------------------------------------------------- forward

    def run_forward(self, args, kwargs):
        leaves, self.spec = tree_flatten((args, kwargs))
        tensors = [x for x in leaves if isinstance(x, Tensor)]
        self.leaves = [_TENSOR if isinstance(x, Tensor) else x for x in leaves]
        self.requires_grad = [t.requires_grad for t in tensors]
        with _bookkeeping():  # not part of an enclosing selective checkpoint's tape
            dummy = torch.empty((0,), requires_grad=True)
            # Keep the node's output alive: the node (and with it its saved tensors) lives as long as it does.
            self.input_saver = _SaveInputs.apply(dummy, *tensors)
            self.buffers = _BufferGuard(_find_modules([self.function, *leaves]))
        self.rng = _RngState(_cuda_devices(tensors)) if self.preserve_rng_state else None
        self.autocast = _autocast_state()
        mode = None
        if self.policy != "full":
            mode = self.mode = _SelectiveMode(self)
            self.tape = _Tape(tensors, self.buffers)
        with torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack):
            with mode if mode is not None else contextlib.nullcontext():
                out = self.function(*args, **kwargs)
        self.mode = None
        # Outputs changed in place after their op ran cannot stand in for it (the recompute runs those ops again).
        self.cache = [None if _versions(e[1]) != e[3] else e for e in self.cache]
        if self.tape is not None and self.tape.unsafe is None:
            self.tape.finish(self.cache, self.ran_at_pack)
        elif self.tape is not None:
            self.tape = None
            del self.cache[self.kept_at_pack:]  # ops kept after the last saved tensor: the rerun stops before them
        return out

    def pack(self, tensor: Tensor) -> _Handle:
        handle = _Handle(self, len(self.metas))
        self.metas.append((tensor.shape, tensor.dtype, tensor.device))
        self.handles.append(weakref.ref(handle))
        if self.mode is not None:
            self.kept_at_pack = self.mode.kept
            if self.tape.unsafe is None:
                self.ran_at_pack = len(self.tape.ops)
                self.tape.slots.append(self.tape.ref(tensor))
        return handle

    # --------------------------------------------------------------- backward

    def recompute(self) -> dict[int, Tensor]:
        """Run the function again (or replay its tape); return {slot: tensor} for the handles still alive."""
        wanted = {i for i, ref in enumerate(self.handles) if ref() is not None}
        if not wanted:
            return {}
        saved = self.input_saver.grad_fn.saved_tensors  # unpacks through an outer checkpoint when nested
        if self.tape is not None:
            with _recomputing():
                return self.tape.replay(self, [t.detach() for t in saved], wanted)
        tensors = iter(t.detach().requires_grad_(rg) if rg else t.detach()
                       for t, rg in zip(saved, self.requires_grad, strict=True))
        leaves = [next(tensors) if x is _TENSOR else x for x in self.leaves]
        args, kwargs = tree_unflatten(leaves, self.spec)
        return self._rerun(args, kwargs, wanted)

    def _rerun(self, args, kwargs, wanted: set[int]) -> dict[int, Tensor]:
        store: dict[int, Tensor] = {}
        last = max(wanted)
        mode = None if self.policy == "full" else _SelectiveMode(self, rerun=True)
        count = 0

        def pack(tensor: Tensor) -> int:
            nonlocal count
            index = count
            count += 1
            if index >= len(self.metas):
                raise CheckpointError(
                    f"fl.checkpoint: the recompute saved more tensors for backward than the forward did "
                    f"({len(self.metas)}); the function must run the same ops when it is recomputed")
            shape, dtype, device = self.metas[index]
            if tensor.shape != shape or tensor.dtype != dtype or tensor.device != device:
                raise CheckpointError(
                    f"fl.checkpoint: the recompute produced saved tensor #{index} with shape "
                    f"{tuple(tensor.shape)}, dtype {tensor.dtype} on {tensor.device}, but the forward saved "
                    f"shape {tuple(shape)}, dtype {dtype} on {device}. The checkpointed function must compute "
                    f"tensors of the same shapes and dtypes when it is recomputed in backward (no branching on "
                    f"global state, counters or randomness that is not torch's RNG)")
            if index in wanted:
                with torch._C._DisableTorchDispatch():  # not through the rerun mode
                    store[index] = tensor.detach()
            if index == last:
                raise _StopRecompute
            return index

        def unpack(_):
            raise CheckpointError("fl.checkpoint: backward through a recompute graph is not supported")

        with contextlib.ExitStack() as stack:
            stack.enter_context(_rng_restored(self.rng))
            stack.enter_context(_autocast_restored(self.autocast))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(self.buffers.swapped())
            stack.enter_context(_recomputing())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(pack, unpack))
            if mode is not None:
                stack.enter_context(mode)
            try:
                self.function(*args, **kwargs)
            except _StopRecompute:
                pass
            else:
                raise CheckpointError(
                    f"fl.checkpoint: the recompute saved {count} tensors for backward but the forward saved "
                    f"{len(self.metas)}; the function must run the same ops when it is recomputed")
        return store


def _unpack(handle: _Handle) -> Tensor:
    frame = handle.frame
    gid = torch._C._current_graph_task_id()
    if gid == -1:  # unpacked outside a backward pass (e.g. grad_fn._saved_self): recompute for it alone
        return frame.recompute()[handle.index]
    store = frame.recomputed.get(gid)
    if store is None or handle.index not in store:
        # First unpack of this call in this backward pass (or a second unpack of the same tensor).
        first = store is None
        store = frame.recomputed[gid] = frame.recompute()
        if first:  # drop what this pass did not ask for when it ends
            torch.autograd.Variable._execution_engine.queue_callback(lambda: frame.recomputed.pop(gid, None))
    return store.pop(handle.index)


# ----------------------------------------------------------------------------- entry point


@torch.compiler.disable
def checkpoint(function: Callable[..., Any], *args, preserve_rng_state: bool = True, policy="full", **kwargs):
    """``function(*args, **kwargs)`` with its activations freed after forward and recomputed in backward.

    Arguments are validated by ``fusedlayers.functional.checkpoint``; see this module's docstring for the
    mechanism and the policies. Without grad mode (``torch.no_grad``, inference) it just calls function.

    ``torch.compile`` does not trace into it (a graph break: the checkpointed function runs eagerly),
    because compiled code saves other tensors for backward than the eager recompute would produce.
    """
    if not torch.is_grad_enabled() or torch.is_inference_mode_enabled():
        return function(*args, **kwargs)
    frame = _Frame(function, policy, preserve_rng_state)
    if _capture is not None:
        _capture.append(frame)
    return frame.run_forward(args, kwargs)
