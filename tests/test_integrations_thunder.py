"""fusedlayers.integrations.thunder: our ops as a Lightning Thunder executor.

Skipped, with the reason, where Thunder does not import (lightning-thunder 0.2.6 does not with torch 2.13; it does
with torch 2.11). Where it imports, the CPU cases run the ops' PyTorch reference and the
``cuda``-marked ones the Triton kernels. Each jitted function is compared with eager torch and with Thunder's
default executors under tests/parity.py's rule against a float64 eager reference (output and the gradient of every
input or parameter), and its final forward and backward traces must name our symbols -- or, for calls the checkers
refuse, must not, with results still correct.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.parity import FLOOR, assert_parity

try:  # Thunder itself: it may be missing, or fail to import with this torch (0.2.6 with torch 2.13: AttributeError)
    import thunder
except Exception as error:  # noqa: BLE001
    pytest.skip(f"lightning-thunder cannot be imported with torch {torch.__version__} "
                f"({type(error).__name__}: {error}); pip install 'fusedlayers[thunder]' on torch <= 2.11",
                allow_module_level=True)

from fusedlayers.integrations import thunder as flthunder  # noqa: E402
from fusedlayers.integrations.thunder import fl_executor  # noqa: E402

CE, SOFTMAX, SDPA = ("fusedlayers_cross_entropy", "fusedlayers_softmax", "fusedlayers_scaled_dot_product_attention")
LAYER_NORM, RMS_NORM = "fusedlayers_layer_norm", "fusedlayers_rms_norm"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]
DEVICE_DTYPES = [("cpu", torch.float32), pytest.param("cuda", torch.float32, marks=pytest.mark.cuda),
                 pytest.param("cuda", torch.bfloat16, marks=pytest.mark.cuda)]


def jit_fused(fn):
    return thunder.jit(fn, executors=[fl_executor, *thunder.get_default_executors()])


def traces(jfn) -> tuple[str, str | None]:
    """(final forward trace, final backward trace or None) as source text."""
    backward = thunder.last_backward_traces(jfn)
    return str(thunder.last_traces(jfn)[-1]), str(backward[-1]) if backward else None


def assert_claimed(jfn, *names: str, backward: bool = True) -> None:
    fwd, bwd = traces(jfn)
    for name in names:
        assert f"{name}(" in fwd, f"{name} missing from the forward trace:\n{fwd}"
        if backward:
            assert f"{name}_backward(" in bwd, f"{name}_backward missing from the backward trace:\n{bwd}"


def assert_not_claimed(jfn, *names: str) -> None:
    for text in traces(jfn):
        for name in names:
            assert text is None or f"{name}(" not in text, f"{name} claimed a call it should refuse:\n{text}"


def check_parity(fused, stock, reference, what):
    """tests/parity.py's rule, its per-dtype floor scaled to the magnitude of the reference (a loss of ~5 in bf16,
    or a sum of ~50 in fp32, is only known to one rounding to its dtype), as tests/test_cross_entropy.py does."""
    scale = reference.abs().max().item() if reference.numel() else 0.0
    assert_parity(fused, stock, reference, what, floor=FLOOR[fused.dtype] * max(1.0, scale))


def _clone(x, dtype=None):
    if not isinstance(x, torch.Tensor):
        return x
    y = x.detach().to(dtype) if dtype is not None and x.is_floating_point() else x.detach().clone()
    return y.requires_grad_(x.requires_grad)


def _run(fn, args, cotangent, dtype=None):
    """(output, gradients of the args that require grad) of fn on copies of args (floats cast to dtype)."""
    args = [_clone(a, dtype) for a in args]
    out = fn(*args)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
    grads = torch.autograd.grad(out, leaves, cotangent.to(out.dtype)) if leaves else ()
    return out.detach(), [g.detach() for g in grads]


def check_function(fn, args, claimed=(), refused=()):
    """fn jitted with our executor vs eager torch and vs Thunder's defaults, each against a float64 eager reference;
    returns the jitted function."""
    out = fn(*[_clone(a) for a in args])
    cotangent = torch.randn(out.shape, device=out.device)
    ref = _run(fn, args, cotangent, torch.float64)
    eager = _run(fn, args, cotangent)
    jfused = jit_fused(fn)
    fused = _run(jfused, args, cotangent)
    stocks = [("eager", eager)]
    try:
        stocks.append(("thunder", _run(thunder.jit(fn), args, cotangent)))
    except Exception as e:  # noqa: BLE001  Thunder's default executors fail on some calls (0.2.6 on CPU: the
        # backward of cross-entropy with reduction="sum" hands aten.nll_loss_backward a float64 total_weight, which
        # torch 2.13 refuses): then compare with eager torch only
        warnings.warn(f"Thunder's default executors failed, compared with eager torch only: {type(e).__name__}: {e}",
                      stacklevel=2)
    for name, s in stocks:
        check_parity(fused[0], s[0], ref[0], f"output vs {name}")
        for i, (f, st, r) in enumerate(zip(fused[1], s[1], ref[1], strict=True)):
            check_parity(f, st, r, f"gradient {i} vs {name}")
    grad = any(isinstance(a, torch.Tensor) and a.requires_grad for a in args)
    assert_claimed(jfused, *claimed, backward=grad)
    assert_not_claimed(jfused, *refused)
    return jfused


# ----------------------------------------------------------------------------- the executor


def test_registered_by_name_and_not_a_default():
    assert fl_executor.name == "fusedlayers" == flthunder.NAME
    assert thunder.extend.get_executor("fusedlayers") is fl_executor
    assert fl_executor not in thunder.get_default_executors()
    assert flthunder.executors() == [fl_executor, *thunder.get_default_executors()]


def test_import_error_names_thunder_when_it_is_missing():
    code = ("import sys; sys.modules['thunder'] = None\n"
            "try:\n    import fusedlayers.integrations.thunder\n"
            "except ImportError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "lightning-thunder" in out and "fusedlayers[thunder]" in out and "torch" in out


# ----------------------------------------------------------------------------- a small model


class TinyModel(nn.Module):
    """embedding -> causal self-attention (F.scaled_dot_product_attention) -> LayerNorm -> linear ->
    F.cross_entropy, plus a term on torch.softmax of the logits."""

    def __init__(self, vocab: int = 96, dim: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(vocab, dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx, targets):
        B, T = idx.shape
        x = self.embed(idx)
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, T, -1))
        logits = self.head(self.norm(x))
        loss = F.cross_entropy(logits.view(B * T, -1), targets.view(-1), ignore_index=-1, label_smoothing=0.1)
        confidence = torch.softmax(logits, dim=-1).square().sum(-1).mean()
        return loss + 0.5 * confidence


def _loss_and_grads(model, idx, targets):
    model.zero_grad(set_to_none=True)
    loss = model(idx, targets)
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("device,dtype", DEVICE_DTYPES)
def test_model_runs_our_kernels_with_stock_loss_and_gradients(device, dtype):
    base = TinyModel().to(device)
    idx = torch.randint(0, 96, (2, 24), device=device)
    targets = torch.randint(0, 96, (2, 24), device=device)
    targets[:, :3] = -1  # ignored
    ref = _loss_and_grads(copy.deepcopy(base).double(), idx, targets)
    eager = _loss_and_grads(copy.deepcopy(base).to(dtype), idx, targets)
    stock_model = thunder.jit(copy.deepcopy(base).to(dtype))
    stock = _loss_and_grads(stock_model, idx, targets)
    fused_model = jit_fused(copy.deepcopy(base).to(dtype))
    fused = _loss_and_grads(fused_model, idx, targets)

    assert_claimed(fused_model, CE, SOFTMAX, SDPA, LAYER_NORM)
    assert_not_claimed(stock_model, CE, SOFTMAX, SDPA, LAYER_NORM)
    for name, s in (("eager", eager), ("thunder", stock)):
        check_parity(fused[0], s[0], ref[0], f"loss vs {name}")
        for p in ref[1]:
            check_parity(fused[1][p], s[1][p], ref[1][p], f"{p}.grad vs {name}")


# ----------------------------------------------------------------------------- cross-entropy


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("smoothing", [0.0, 0.2])
def test_cross_entropy_class_indices(device, reduction, smoothing):
    x = torch.randn(13, 37, device=device, requires_grad=True)
    t = torch.randint(0, 37, (13,), device=device)
    t[::4] = 5  # ignore_index
    check_function(lambda x, t: F.cross_entropy(x, t, ignore_index=5, reduction=reduction,
                                                label_smoothing=smoothing), [x, t], claimed=[CE])


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_class_weights_and_probability_targets(device):
    x = torch.randn(11, 19, device=device, requires_grad=True)
    t = torch.randint(0, 19, (11,), device=device)
    w = torch.rand(19, device=device) + 0.5
    check_function(lambda x, t, w: F.cross_entropy(x, t, w, label_smoothing=0.1), [x, t, w], claimed=[CE])
    q = torch.randn(11, 19, device=device).softmax(-1).requires_grad_()  # the targets' gradient too
    check_function(lambda x, q, w: F.cross_entropy(x, q, w, reduction="sum"), [x, q, w], claimed=[CE])


@pytest.mark.parametrize("device", DEVICES)
def test_cross_entropy_refused_calls_stay_stock(device):
    x = torch.randn(4, 9, 3, 2, device=device, requires_grad=True)  # (N, C, h, w): the checker takes 2-D logits
    t = torch.randint(0, 9, (4, 3, 2), device=device)  # (not (N, C, d): Thunder 0.2.6's own backward fails there)
    check_function(lambda x, t: F.cross_entropy(x, t), [x, t], refused=[CE])
    x = torch.randn(7, 9, device=device, requires_grad=True)
    q = torch.randn(7, 9, device=device).softmax(-1)
    w = (torch.rand(9, device=device) + 0.5).requires_grad_()  # our op has no gradient for class weights
    check_function(lambda x, q, w: F.cross_entropy(x, q, w), [x, q, w], refused=[CE])


# ----------------------------------------------------------------------------- softmax


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_dims_and_dtypes(device):
    x = torch.randn(3, 17, 5, device=device, requires_grad=True)
    check_function(lambda x: torch.softmax(x, 1), [x], claimed=[SOFTMAX])  # not the last dim
    check_function(lambda x: F.softmax(x, dim=-1, dtype=torch.float64), [x], claimed=[SOFTMAX])  # widening
    check_function(lambda x: x.softmax(0), [x], claimed=[SOFTMAX])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_softmax_half_precision(dtype):
    x = torch.randn(8, 3000, device="cuda", dtype=dtype, requires_grad=True)
    check_function(lambda x: torch.softmax(x, -1), [x], claimed=[SOFTMAX])
    check_function(lambda x: torch.softmax(x, -1, dtype=torch.float32), [x], claimed=[SOFTMAX])  # widening


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_narrowing_dtype_casts_the_input_first(device):
    """As torch (and fl.softmax): the input is rounded to ``dtype`` first. (Not under the float64 parity rule: the
    reference itself would round to bf16.) The gradient comes back in the input's dtype."""
    x = torch.randn(8, 300, device=device, requires_grad=True)
    fn = lambda x: torch.softmax(x, -1, dtype=torch.bfloat16)
    jfn = jit_fused(fn)
    out, stock = jfn(x), fn(x)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, stock, rtol=2**-7, atol=1e-6)  # a bf16 rounding apart at most
    cot = torch.randn(8, 300, device=device, dtype=torch.bfloat16)
    (g,), (g_stock,) = torch.autograd.grad(out, [x], cot), torch.autograd.grad(stock, [x], cot)
    assert g.dtype == torch.float32
    torch.testing.assert_close(g, g_stock, rtol=2e-2, atol=1e-4)
    assert_claimed(jfn, SOFTMAX)


# ----------------------------------------------------------------------------- attention


def _qkv(device, B=2, H=3, L=10, S=12, E=16, Ev=16, dtype=torch.float32):
    return (torch.randn(B, H, L, E, device=device, dtype=dtype, requires_grad=True),
            torch.randn(B, H, S, E, device=device, dtype=dtype, requires_grad=True),
            torch.randn(B, H, S, Ev, device=device, dtype=dtype, requires_grad=True))


@pytest.mark.parametrize("device", DEVICES)
def test_attention_causal_scale_and_masks(device):
    q, k, v = _qkv(device, L=12, Ev=8)
    check_function(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v],
                   claimed=[SDPA])
    check_function(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, scale=0.3), [q, k, v], claimed=[SDPA])
    keep = torch.rand(2, 1, 12, 12, device=device) > 0.3
    keep[..., 0] = True
    check_function(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m), [q, k, v, keep], claimed=[SDPA])
    bias = torch.randn(12, 12, device=device, requires_grad=True)  # an additive mask, with its gradient
    check_function(lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, m), [q, k, v, bias], claimed=[SDPA])


@pytest.mark.parametrize("device", DEVICES)
def test_attention_dropout_is_ours_and_reproducible(device):
    """Dropout draws its seed from torch's CPU generator as fl.scaled_dot_product_attention does: after the same
    torch.manual_seed both give the same output and gradients."""
    import fusedlayers as fl

    q, k, v = _qkv(device)
    fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    jfn = jit_fused(fn)
    jfn(q, k, v)  # compile first: the comparisons below start from a fresh seed
    cot = torch.randn(2, 3, 10, 16, device=device)
    results = []
    for f in (jfn, lambda q, k, v: fl.scaled_dot_product_attention(q, k, v, dropout_p=0.3)):
        torch.manual_seed(1234)
        results.append(_run(f, [q, k, v], cot))
    (out, grads), (fl_out, fl_grads) = results
    torch.testing.assert_close(out, fl_out, rtol=0, atol=0)
    for g, fg in zip(grads, fl_grads, strict=True):
        torch.testing.assert_close(g, fg)  # the same dropout mask: equal but for the order of accumulation
    assert_claimed(jfn, SDPA)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_half_precision(dtype):
    q, k, v = _qkv("cuda", B=2, H=4, L=200, S=200, E=64, Ev=64, dtype=dtype)
    check_function(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v],
                   claimed=[SDPA])


@pytest.mark.cuda
def test_attention_refused_head_dim_stays_stock():
    q, k, v = _qkv("cuda", E=320, Ev=320)  # more than our kernels take: Thunder's own SDPA runs it
    check_function(lambda q, k, v: F.scaled_dot_product_attention(q, k, v), [q, k, v], refused=[SDPA])


# ----------------------------------------------------------------------------- LayerNorm and RMSNorm


def _norm_inputs(device, dtype=torch.float32, param_dtype=None, shape=(3, 7, 40)):
    x = torch.randn(shape, device=device, dtype=dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(shape[-1], device=device, dtype=param_dtype or dtype)).requires_grad_()
    b = (0.5 * torch.randn(shape[-1], device=device, dtype=param_dtype or dtype)).requires_grad_()
    return x, w, b


@pytest.mark.parametrize("device", DEVICES)
def test_layer_norm_with_and_without_parameters(device):
    x, w, b = _norm_inputs(device)
    check_function(lambda x, w, b: F.layer_norm(x, (40,), w, b), [x, w, b], claimed=[LAYER_NORM])
    check_function(lambda x, w: F.layer_norm(x, (40,), w, eps=1e-3), [x, w], claimed=[LAYER_NORM])
    check_function(lambda x: F.layer_norm(x, (40,)), [x], claimed=[LAYER_NORM])
    check_function(lambda x: F.layer_norm(x, (7, 40)), [x], claimed=[LAYER_NORM])  # two normalized dims
    check_function(lambda x, w, b: F.layer_norm(x.transpose(0, 1), (40,), w, b), [x, w, b],  # strided input
                   claimed=[LAYER_NORM])


@pytest.mark.parametrize("device", DEVICES)
def test_rms_norm_default_eps_and_weight(device):
    x, w, _ = _norm_inputs(device, shape=(5, 3, 130))
    check_function(lambda x, w: F.rms_norm(x, (130,), w), [x, w], claimed=[RMS_NORM])  # eps=None: finfo(fp32).eps
    check_function(lambda x, w: F.rms_norm(x, [130], w, eps=1e-5), [x, w], claimed=[RMS_NORM])
    check_function(lambda x: F.rms_norm(x, (3, 130)), [x], claimed=[RMS_NORM])


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norms_half_precision_with_fp32_parameters(dtype):
    """16-bit activations with the parameters in their own dtype, and (rms_norm) with fp32 master parameters:
    output and input gradient in the activations' dtype, parameter gradients in the parameters'. (torch's CUDA
    layer_norm refuses fp32 parameters with 16-bit input.)"""
    for param_dtype in (dtype, torch.float32):
        x, w, b = _norm_inputs("cuda", dtype, param_dtype, shape=(64, 4544))
        if param_dtype == dtype:
            check_function(lambda x, w, b: F.layer_norm(x, (4544,), w, b), [x, w, b], claimed=[LAYER_NORM])
        check_function(lambda x, w: F.rms_norm(x, (4544,), w, 1e-6), [x, w], claimed=[RMS_NORM])


@pytest.mark.parametrize("device", DEVICES)
def test_norm_parameters_of_another_dtype_stay_stock(device):
    """torch's rms_norm computes a float32 input with a float64 weight (a composite): our op takes the input's dtype
    (or fp32 ones for 16-bit input), so the checker refuses it and Thunder's decomposition gives torch's result."""
    x, w, _ = _norm_inputs(device, torch.float32, torch.float64)
    check_function(lambda x, w: F.rms_norm(x, (40,), w), [x, w], refused=[RMS_NORM])


# ----------------------------------------------------------------------------- inference


@pytest.mark.parametrize("device", DEVICES)
def test_inference_without_grad_runs_the_forward_symbols(device):
    x = torch.randn(6, 20, device=device)
    t = torch.randint(0, 20, (6,), device=device)
    q, k, v = (a.detach() for a in _qkv(device))
    check_function(lambda x, t: F.cross_entropy(x, t, reduction="none") + x.softmax(-1)[:, 0], [x, t],
                   claimed=[CE, SOFTMAX])
    check_function(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v],
                   claimed=[SDPA])
