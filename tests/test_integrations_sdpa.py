"""fusedlayers.integrations.sdpa: our kernels as torch's flash-attention implementation.

CPU (CI): the registration, activation and restore, and the aten-schema glue itself (the two functions that
replace torch's flash forward/backward) run on the Triton interpreter against float64 attention. CUDA (the `cuda`
tests): an unmodified module's F.scaled_dot_product_attention runs our kernels, seen in the profiler and the
call counter, with outputs and gradients as close to float64 as torch's own flash backend's.
"""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.conftest import HAS_CUDA, INTERPRETER
from tests.parity import assert_parity

attention_registry = pytest.importorskip("torch.nn.attention")
if not hasattr(attention_registry, "register_flash_attention_impl"):
    pytest.skip(f"torch {torch.__version__} has no flash-attention registry (needs >= 2.11)", allow_module_level=True)

from fusedlayers.integrations import sdpa as fl_sdpa  # noqa: E402


def test_import_fusedlayers_imports_no_integration():
    code = "import sys, fusedlayers; print(any(m.startswith('fusedlayers.integrations') for m in sys.modules))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip() == "False"


def test_registered_activated_and_restored():
    assert "fusedlayers" in attention_registry.list_flash_attention_impls()
    q = torch.randn(1, 2, 5, 16)
    before = F.scaled_dot_product_attention(q, q, q)
    fl_sdpa.enable()
    try:
        assert fl_sdpa.is_enabled() and attention_registry.current_flash_attention_impl() == "fusedlayers"
        assert torch.equal(F.scaled_dot_product_attention(q, q, q), before)  # CPU calls are not ours
    finally:
        fl_sdpa.disable()
    assert not fl_sdpa.is_enabled() and attention_registry.current_flash_attention_impl() is None


def reference(q, k, v, is_causal, scale):
    """Float64 attention with its logsumexp, GQA by repeating key/value heads."""
    q, k, v = (t.double() for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-2, -1) * scale
    if is_causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    return s.softmax(-1) @ v, s.logsumexp(-1)


@pytest.mark.skipif(not INTERPRETER, reason="needs TRITON_INTERPRET=1 (CPU runs)")
@pytest.mark.parametrize("H, H_kv, L, S, D, causal", [(2, 2, 37, 53, 64, False), (4, 2, 40, 33, 32, True)])
def test_schema_glue_on_interpreter(H, H_kv, L, S, D, causal):
    """The replacement forward returns torch's flash outputs (output like query, natural-log logsumexp
    (B, H, L) fp32, max lengths) and the replacement backward the gradients of that output."""
    q = torch.randn(2, L, H, D, dtype=torch.float16).transpose(1, 2)  # (B, H, L, D) views of (B, L, H, D)
    k = torch.randn(2, S, H_kv, D, dtype=torch.float16).transpose(1, 2)
    v = torch.randn(2, S, H_kv, D, dtype=torch.float16).transpose(1, 2)
    scale = 1 / math.sqrt(D)
    out, lse, _, _, max_q, max_k, seed, _, debug = fl_sdpa._forward(q, k, v, 0.0, causal, False, scale=None)
    assert out.stride() == torch.empty_like(q).stride() and (max_q, max_k) == (L, S) and debug.numel() == 0
    assert lse.shape == (2, H, L) and lse.dtype == torch.float32
    ref_out, ref_lse = reference(q, k, v, causal, scale)
    torch.testing.assert_close(out.double(), ref_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)

    grad = torch.randn_like(out)
    dq, dk, dv = fl_sdpa._backward(grad, q, k, v, out, lse, None, None, L, S, 0.0, causal, seed,
                                   torch.zeros(()), scale=None)
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref_grads = torch.autograd.grad(reference(*leaves, causal, scale)[0], leaves, grad.double())
    for got, want, t in zip((dq, dk, dv), ref_grads, (q, k, v), strict=True):
        assert got.shape == t.shape and got.stride() == torch.empty_like(t).stride()
        torch.testing.assert_close(got.double(), want, atol=1e-2, rtol=1e-2)


def test_debug_mask_refused():
    q = torch.randn(1, 1, 4, 16, dtype=torch.float16)
    with pytest.raises(RuntimeError, match="return_debug_mask"):
        fl_sdpa._forward(q, q, q, 0.0, False, True)


# ----------------------------------------------------------------------------- CUDA (the `cuda` tests)


class Unmodified(nn.Module):
    """Someone else's attention block: plain F.scaled_dot_product_attention, nothing of ours."""

    def __init__(self, dim, heads, kv_heads, dropout=0.0):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.dropout = heads, kv_heads, dim // heads, dropout
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.head_dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.kv_heads, self.head_dim).unbind(2)
        y = F.scaled_dot_product_attention(q, k.transpose(1, 2), v.transpose(1, 2), is_causal=True,
                                           dropout_p=self.dropout, enable_gqa=self.heads != self.kv_heads)
        return y.transpose(1, 2).reshape(B, T, -1)


def run_model(model, x, grad):
    model.zero_grad()
    x = x.detach().requires_grad_()
    y = model(x)
    y.backward(grad)
    return y.detach(), [x.grad, *(p.grad for p in model.parameters())]


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("heads, kv_heads, T, dim", [(8, 8, 300, 512), (8, 2, 1024, 1024), (4, 4, 77, 256)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_unmodified_model_runs_our_kernels(heads, kv_heads, T, dim, dtype):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    model = Unmodified(dim, heads, kv_heads).cuda().to(dtype)
    x = torch.randn(2, T, dim, device="cuda", dtype=dtype)
    grad = torch.randn(2, T, dim, device="cuda", dtype=dtype)
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        out_s, grads_s = run_model(model, x, grad)  # torch's own flash backend
    cudnn_before = torch.backends.cuda.cudnn_sdp_enabled()
    fl_sdpa.enable()  # no sdpa_kernel context: torch's default backend choice, with ours as its flash
    try:
        before = dict(fl_sdpa.calls)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out_f, grads_f = run_model(model, x, grad)
            torch.cuda.synchronize()
    finally:
        fl_sdpa.disable()
    assert torch.backends.cuda.cudnn_sdp_enabled() == cudnn_before
    assert fl_sdpa.calls["forward"] == before["forward"] + 1 and fl_sdpa.calls["backward"] == before["backward"] + 1
    names = {e.name for e in prof.events()}
    # the forward: the Gluon kernel on Hopper (16-bit, head dim 64/128), the Triton one elsewhere
    assert names & {"_attn_fwd_kernel", "_attn_fwd_hopper"}, sorted(names)
    assert {"_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"} <= names, sorted(names)
    assert not any("flash_fwd" in n or "flash_bwd" in n for n in names), "torch's flash kernels ran"
    model64 = Unmodified(dim, heads, kv_heads).cuda().double()
    model64.load_state_dict(model.state_dict())
    with sdpa_kernel(SDPBackend.MATH):
        out_r, grads_r = run_model(model64, x.double(), grad.double())
    assert_parity(out_f, out_s, out_r, "output")
    for i, (gf, gs, gr) in enumerate(zip(grads_f, grads_s, grads_r, strict=True)):
        assert_parity(gf, gs, gr, f"grad {i}")


@pytest.mark.cuda
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_dropout_through_torch_equals_fl_with_the_same_seed():
    import fusedlayers as fl

    q, k, v = (torch.randn(2, 4, 200, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    fl_sdpa.enable()
    try:
        torch.manual_seed(7)
        out_t = F.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
        grads_t = torch.autograd.grad(out_t, (q, k, v), torch.ones_like(out_t))
    finally:
        fl_sdpa.disable()
    torch.manual_seed(7)
    out_f = fl.scaled_dot_product_attention(q, k, v, dropout_p=0.3, is_causal=True)
    grads_f = torch.autograd.grad(out_f, (q, k, v), torch.ones_like(out_f))
    assert torch.equal(out_t, out_f)
    for a, b in zip(grads_t, grads_f, strict=True):
        assert torch.equal(a, b)
