"""Backend selection: which implementation an op runs.

- ``auto`` (default): the Triton kernels for CUDA tensors, the PyTorch reference for CPU tensors.
- ``triton``: the Triton kernels everywhere. CPU tensors need ``TRITON_INTERPRET=1`` set before
  ``fusedlayers`` is imported (Triton's interpreter; that is how CI tests the kernels).
- ``reference``: the PyTorch reference everywhere (slow on GPU, but the ground truth).

Choose with ``fl.use_backend(name)`` (a context manager, process-wide as torch's ``sdpa_kernel``) or the environment
variable ``FUSEDLAYERS_BACKEND``.

Attention's backward follows PyTorch's convention (as its flash and cuDNN backwards and FlashAttention do): by
default it may add dQ with atomics where that is faster, so that dQ's last bits can vary from run to run;
``torch.use_deterministic_algorithms(True)``, ``fl.use_deterministic_attention(True)`` or
``FUSEDLAYERS_DETERMINISTIC_ATTENTION=1`` make it bitwise reproducible. (The Hopper backward is deterministic in
both modes: there it is also the faster one.)
"""

from __future__ import annotations

import contextlib
import os

import torch

BACKENDS = ("auto", "triton", "reference")


# Both settings are process-wide, not per thread (as torch's sdpa_kernel and use_deterministic_algorithms): the
# backward of CUDA tensors runs on autograd's own device threads, which would not see a thread-local setting made
# where the forward and the .backward() call ran.
_backend_name: str | None = None  # the innermost use_backend's
_deterministic_attention: bool | None = None  # the innermost use_deterministic_attention's


def _check_name(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


def current_backend() -> str:
    """The backend in force: the innermost ``use_backend``, else ``$FUSEDLAYERS_BACKEND``, else auto."""
    name = _backend_name
    if name is None:
        name = os.environ.get("FUSEDLAYERS_BACKEND", "auto")
        try:
            _check_name(name)
        except ValueError as e:
            raise ValueError(f"FUSEDLAYERS_BACKEND: {e}") from None
    return name


@contextlib.contextmanager
def use_backend(name: str):
    """Run the ops inside the ``with`` block on backend ``name`` ("auto" | "triton" | "reference"), their backward
    too when ``.backward()`` is called inside it (process-wide: CUDA backwards run on autograd's threads)."""
    global _backend_name
    _check_name(name)
    previous = _backend_name
    _backend_name = name
    try:
        yield
    finally:
        _backend_name = previous


@contextlib.contextmanager
def use_deterministic_attention(enabled: bool):
    """Inside the ``with`` block (process-wide, as ``torch.use_deterministic_algorithms``), attention's backward is
    bitwise reproducible (``True``) or may add dQ with atomics where that is faster (``False``, the default outside
    any block unless torch's switch or ``$FUSEDLAYERS_DETERMINISTIC_ATTENTION=1`` says otherwise: dQ's last bits then
    vary from run to run). ``torch.use_deterministic_algorithms(True)`` wins over ``False``."""
    if not isinstance(enabled, bool):
        raise TypeError(f"use_deterministic_attention: enabled must be a bool, got {type(enabled).__name__}")
    global _deterministic_attention
    previous = _deterministic_attention
    _deterministic_attention = enabled
    try:
        yield
    finally:
        _deterministic_attention = previous


def deterministic_attention() -> bool:
    """Whether attention's backward must be deterministic: ``torch.use_deterministic_algorithms(True)``, else the
    innermost ``use_deterministic_attention``, else ``$FUSEDLAYERS_DETERMINISTIC_ATTENTION`` (default 0, torch's
    convention: its flash and cuDNN backwards are not deterministic unless asked)."""
    if torch.are_deterministic_algorithms_enabled():
        return True
    if _deterministic_attention is not None:
        return _deterministic_attention
    value = os.environ.get("FUSEDLAYERS_DETERMINISTIC_ATTENTION", "0")
    if value not in ("0", "1"):
        raise ValueError(f"FUSEDLAYERS_DETERMINISTIC_ATTENTION must be 0 or 1, got {value!r}")
    return value == "1"


def keys_per_row(max_keys: int, is_causal: bool, window: tuple[int, int] = (-1, -1)) -> float:
    """About how many keys a query row attends (at most): all ``max_keys`` (half when causal), or a window's width
    (-1: that side unbounded). Sizes an attention call for the choice of kernels (the Hopper kernels' MIN_FLOPS and
    which forward takes key intervals)."""
    if tuple(window) == (-1, -1):
        return max_keys / (2 if is_causal else 1)
    left, right = (max_keys if w < 0 else w for w in window)
    return float(min(max_keys, left + 1 + (0 if is_causal else right)))


def triton_interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def use_triton(tensor: torch.Tensor) -> bool:
    """True if an op on ``tensor`` should run its Triton kernel, False for the PyTorch reference.

    Raises RuntimeError when the backend asks for Triton where Triton cannot run.
    """
    name = _backend_name or os.environ.get("FUSEDLAYERS_BACKEND", "auto")  # every op call runs this: no calls
    if name == "auto":
        return tensor.is_cuda
    if name == "reference":
        return False
    if name != "triton":
        current_backend()  # raises, naming the environment variable
    # name == "triton"
    if tensor.device.type == "cpu" and not triton_interpreter_on():
        raise RuntimeError(
            "backend 'triton' on CPU tensors needs Triton's interpreter: set TRITON_INTERPRET=1 in the "
            "environment before importing fusedlayers, or use backend 'auto'/'reference' on CPU"
        )
    if tensor.device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"backend 'triton' supports CUDA (and CPU under TRITON_INTERPRET=1), not {tensor.device}")
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise RuntimeError("backend 'triton' needs the triton package (pip install triton)") from e
    return True
