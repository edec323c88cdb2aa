"""Backend selection: use_backend, FUSEDLAYERS_BACKEND, and the interpreter requirement on CPU."""

import pytest
import torch

import fusedlayers as fl
from fusedlayers import backend
from fusedlayers.ops import softmax as softmax_ops


def test_default_is_auto_and_context_nests(monkeypatch):
    monkeypatch.delenv("FUSEDLAYERS_BACKEND", raising=False)
    assert fl.current_backend() == "auto"
    with fl.use_backend("reference"):
        assert fl.current_backend() == "reference"
        with fl.use_backend("triton"):
            assert fl.current_backend() == "triton"
        assert fl.current_backend() == "reference"
    assert fl.current_backend() == "auto"


def test_environment_variable(monkeypatch):
    monkeypatch.setenv("FUSEDLAYERS_BACKEND", "reference")
    assert fl.current_backend() == "reference"
    with fl.use_backend("auto"):  # the context manager wins
        assert fl.current_backend() == "auto"
    monkeypatch.setenv("FUSEDLAYERS_BACKEND", "cuda")
    with pytest.raises(ValueError, match="FUSEDLAYERS_BACKEND"):
        fl.current_backend()


def test_unknown_backend_name():
    with pytest.raises(ValueError, match="backend must be one of"):
        with fl.use_backend("fast"):
            pass


def test_auto_picks_reference_on_cpu():
    x = torch.randn(3)
    with fl.use_backend("auto"):
        assert backend.use_triton(x) is False
    with fl.use_backend("reference"):
        assert backend.use_triton(x) is False


def test_triton_on_cpu_needs_the_interpreter(monkeypatch):
    x = torch.randn(2, 3)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with fl.use_backend("triton"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        fl.softmax(x)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with fl.use_backend("triton"):
        assert backend.use_triton(x) is True


def test_backend_decides_which_implementation_runs(monkeypatch):
    """The op body calls the kernel launcher exactly when the backend says triton."""
    calls = []
    real = softmax_ops.kernels.softmax_forward
    monkeypatch.setattr(softmax_ops.kernels, "softmax_forward", lambda *a, **k: calls.append(1) or real(*a, **k))
    x = torch.randn(4, 8)
    with fl.use_backend("reference"):
        fl.softmax(x)
    assert calls == []
    with fl.use_backend("triton"):
        fl.softmax(x)
    assert calls == [1]
