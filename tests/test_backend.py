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


def test_settings_reach_other_threads():
    """Process-wide, not per thread: the backward of CUDA tensors runs on autograd's device threads, which must see
    the backend (and attention's determinism) chosen where .backward() was called."""
    import threading

    seen = []

    def look():
        seen.append((fl.current_backend(), backend.deterministic_attention()))

    with fl.use_backend("reference"), fl.use_deterministic_attention(False):
        worker = threading.Thread(target=look)
        worker.start()
        worker.join()
    assert seen == [("reference", False)]


@pytest.mark.cuda
def test_cuda_backward_runs_on_the_chosen_backend(monkeypatch):
    """A hook on the output's gradient runs where autograd runs the CUDA backward (its device thread)."""
    seen, calls = [], []
    x = torch.randn(4, 8, device="cuda", requires_grad=True)
    with fl.use_backend("reference"):
        y = fl.softmax(x, -1)
        y.register_hook(lambda g: seen.append(fl.current_backend()))
        y.sum().backward()
    assert seen == ["reference"]
    real = softmax_ops.kernels.softmax_backward
    monkeypatch.setattr(softmax_ops.kernels, "softmax_backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    with fl.use_backend("reference"):
        fl.softmax(x, -1).sum().backward()
    assert calls == []  # the reference's backward, not the kernel's
    fl.softmax(x, -1).sum().backward()
    assert calls == [1]  # auto: the kernel's
