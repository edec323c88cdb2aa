"""Triton kernels and their launchers, one module per op (no torch.library code here)."""

import triton.language as tl
from torch import Tensor
from triton import knobs
from triton.runtime import driver
from triton.runtime.jit import JITFunction

from fusedlayers.backend import triton_interpreter_on

# whether the kernels run in Triton's interpreter (no libdevice, no inline assembly): a constexpr global the @jit
# functions read
INTERPRETED = tl.constexpr(triton_interpreter_on())


# Launch arithmetic in plain Python: triton.cdiv / triton.next_power_of_2 are constexpr functions in newer Triton,
# a few microseconds per call on the host.
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(n - 1, 0).bit_length()


def launch(kernel, grid: tuple[int, ...], *args, **meta) -> None:
    """``kernel[grid](*args, **meta)`` with less host time: after Triton compiled the kernel for these argument
    properties once, its compiled launcher is called directly.

    Triton's ``kernel[grid](...)`` derives the argument specialization, a cache key and the launch hooks on every
    call: 18.8 us of host time per launch on an H200's host, against 6.3 us for the compiled kernel's own launcher
    (10.3 us with the lookup below). An eager fwd+bwd launches two or three kernels, so this is host time that
    small steps wait for. The lookup key is at least as fine as Triton's specialization (each tensor's dtype and
    16-byte alignment; ints by value, which covers their ==1, %16 and 32/64-bit range; bools apart from ints; the
    type of everything else; the constexprs and options by value), so it can only miss where Triton would hit,
    never hit where Triton would compile anew; a kernel launched with ever-new ints (shapes) starts its table over
    at MAX_KEYS_PER_KERNEL entries.
    Under the interpreter, with launch hooks set (a profiler) or pre-run hooks, the call goes through Triton. Not
    repeated: Triton's check that the globals a kernel read did not change since it was compiled (ours read
    constants only).
    """
    fast = _direct_launchers.get(id(kernel))  # by id: a JITFunction hashes its source's cache key on every call
    if fast is None:
        fast = _direct_launchers[id(kernel)] = _DirectLauncher.for_kernel(kernel)
    if fast is False or kernel.pre_run_hooks or not _no_launch_hooks():
        kernel[grid](*args, **meta)
        return
    fast(grid, args, meta)


MAX_KEYS_PER_KERNEL = 4096
# id(kernel) -> its _DirectLauncher (which keeps the kernel alive, so the id stays its), or False where Triton's own
# path must run
_direct_launchers: dict = {}


def _no_launch_hooks() -> bool:
    return all(not getattr(hook, "calls", hook) for hook in (knobs.runtime.launch_enter_hook,
                                                             knobs.runtime.launch_exit_hook))


def _args_key(args: tuple) -> tuple:
    """A key that changes wherever Triton's specialization of the kernel arguments does: each tensor's dtype and
    16-byte alignment; ints by value (finer than Triton's ==1, %16 and 32/64-bit range, and cheaper to take); bools
    apart from ints; a TMA descriptor's element type, block shape and shared-memory layout (Gluon's; its shape and
    strides are runtime values); the type of everything else. One comprehension, ints tested first (most of a
    launch's arguments are shapes and strides): it runs on every launch."""
    return tuple([a if a.__class__ is int
                  else (a.dtype, not a.data_ptr() & 15) if isinstance(a, Tensor)
                  else (a.__class__, a) if isinstance(a, int)
                  else (a.__class__, a.base.dtype, *a.block_shape, getattr(a, "layout", None))
                  if hasattr(a, "block_shape") else a.__class__ for a in args])


class _DirectLauncher:
    """Compiled kernels of one JITFunction, by argument properties, and their direct launch."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.current_device = driver.active.get_current_device
        self.current_stream = driver.active.get_current_stream
        self.compiled: dict = {}  # (device, argument keys, meta) -> (compiled kernel, constexpr values)

    @classmethod
    def for_kernel(cls, kernel):
        if not isinstance(kernel, JITFunction):  # the interpreter, an autotuner
            return False
        return cls(kernel)

    def __call__(self, grid: tuple[int, ...], args: tuple, meta: dict) -> None:
        device = self.current_device()
        key = (device, _args_key(args), tuple(meta.items()))
        entry = self.compiled.get(key)
        if entry is None:  # Triton compiles (or finds) it and launches it this once
            compiled = self.kernel[grid](*args, **meta)
            if len(self.compiled) >= MAX_KEYS_PER_KERNEL:  # ints are keyed by value: shapes that keep changing
                self.compiled.clear()
            if hasattr(compiled, "packed_metadata"):
                self.compiled[key] = (compiled, self._constexprs(len(args), meta))
            return
        compiled, constexprs = entry
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        compiled.run(grid[0], g1, g2, self.current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *constexprs)

    def _constexprs(self, n_args: int, meta: dict) -> tuple:
        """The values of the parameters after the positional ones (the launcher takes every parameter)."""
        params = self.kernel.params[n_args:]
        return tuple(meta[p.name] if p.name in meta else p.default for p in params)
