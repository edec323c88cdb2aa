"""Smoke test of the installed wheel, run by .ci/run in a virtual environment holding only torch and the wheel.

Checks what a project that depends on fusedlayers relies on: the package comes from site-packages, importing it
pulls in no training framework, every public function and module gives its torch twin's values and gradients on
CPU, and an integration whose framework is missing says which extra to install. Run it from outside the
repository (otherwise the source tree, not the wheel, is imported).
"""

import importlib
import sys
import sysconfig
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

import fusedlayers as fl

FRAMEWORKS = ("lightning", "pytorch_lightning", "hydra", "omegaconf", "transformers", "thunder", "models", "optuna",
              "matplotlib", "tensorboard", "torchmetrics", "tokenizers")
checked: set[str] = set()


def check(*names: str):
    """Registers the public names a check covers (every name in fl.__all__ must be covered)."""

    def register(fn):
        fn()
        checked.update(names)
        print(f"ok  {', '.join(names)}")
        return fn

    return register


def grads(fn, *inputs):
    """fn(*inputs) and the gradients of a fixed random projection of its output(s) with respect to the inputs."""
    leaves = [x.detach().clone().requires_grad_(x.is_floating_point()) for x in inputs]
    out = fn(*leaves)
    outs = out if isinstance(out, tuple) else (out,)
    torch.manual_seed(123)
    loss = sum((o * torch.randn_like(o)).sum() for o in outs)
    loss.backward()
    return [o.detach() for o in outs], [x.grad for x in leaves if x.requires_grad]


def same_as(fused, stock, *inputs, **tol):
    out, g = grads(fused, *inputs)
    ref_out, ref_g = grads(stock, *inputs)
    assert_close(out, ref_out, **tol)
    assert_close(g, ref_g, **tol)


def same_module(fused: nn.Module, stock: nn.Module, *inputs, **tol):
    fused.load_state_dict(stock.state_dict())  # the same parameter names and shapes
    for p in (*fused.parameters(), *stock.parameters()):
        p.grad = None
    same_as(fused, stock, *inputs, **tol)
    assert_close([p.grad for p in fused.parameters()], [p.grad for p in stock.parameters()], **tol)


def installed_from_site_packages():
    site = Path(sysconfig.get_paths()["purelib"]).resolve()
    where = Path(fl.__file__).resolve()
    assert site in where.parents, f"fusedlayers imported from {where}, not from {site}"
    assert fl.__version__, "fusedlayers.__version__ is empty"
    loaded = sorted(name for name in FRAMEWORKS if name in sys.modules)
    assert not loaded, f"import fusedlayers imported {loaded}"
    print(f"ok  import fusedlayers {fl.__version__} from {where.parent}, no framework imported")


installed_from_site_packages()
torch.manual_seed(0)
x = torch.randn(4, 6, 33)


@check("softmax", "Softmax")
def _():
    same_as(lambda t: fl.softmax(t, 1), lambda t: torch.softmax(t, 1), x)
    same_module(fl.Softmax(-1), nn.Softmax(-1), x)


@check("scaled_masked_softmax")
def _():
    mask = torch.rand(6, 33) > 0.3
    same_as(lambda t: fl.scaled_masked_softmax(t, 0.5, mask),
            lambda t: torch.softmax((t * 0.5).masked_fill(~mask, float("-inf")), -1), x)


@check("scaled_dot_product_attention")
def _():
    q, k, v = torch.randn(2, 4, 9, 16), torch.randn(2, 2, 11, 16), torch.randn(2, 2, 11, 8)
    same_as(lambda *t: fl.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True),
            lambda *t: F.scaled_dot_product_attention(*t, is_causal=True, enable_gqa=True), q, k, v)


@check("varlen_attention")
def _():
    cu = torch.tensor([0, 3, 10, 16], dtype=torch.int32)
    q, k, v = torch.randn(16, 4, 16), torch.randn(16, 4, 16), torch.randn(16, 4, 16)

    def per_sequence(q, k, v):
        parts = [F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)), is_causal=True)
                 for a, b in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True)]
        return torch.cat([p.transpose(0, 1) for p in parts])

    same_as(lambda *t: fl.varlen_attention(*t, cu, cu, 7, 7, is_causal=True), per_sequence, q, k, v)


@check("cross_entropy", "CrossEntropyLoss")
def _():
    logits, target = torch.randn(12, 50), torch.randint(0, 50, (12,))
    target[3] = -100
    same_as(lambda t: fl.cross_entropy(t, target, label_smoothing=0.1),
            lambda t: F.cross_entropy(t, target, label_smoothing=0.1), logits)
    same_module(fl.CrossEntropyLoss(reduction="sum"), nn.CrossEntropyLoss(reduction="sum"), logits, target)


@check("linear_cross_entropy", "LinearCrossEntropyLoss")
def _():
    h, w, target = torch.randn(12, 16), torch.randn(50, 16), torch.randint(0, 50, (12,))
    same_as(lambda a, b: fl.linear_cross_entropy(a, b, target, chunk_size=5),
            lambda a, b: F.cross_entropy(F.linear(a, b), target), h, w)
    module = fl.LinearCrossEntropyLoss(16, 50, bias=True)
    same_as(lambda a: module(a, target), lambda a: F.cross_entropy(module.linear(a), target), h)


@check("linear_log_probs")
def _():
    h, w, target = torch.randn(12, 16), torch.randn(50, 16), torch.randint(0, 50, (12,))
    target[2] = -100

    def stock(a, b):
        log_p = F.linear(a, b).div(0.7).log_softmax(-1)
        keep = target != -100
        lp = log_p.gather(-1, target.clamp(min=0)[:, None]).squeeze(-1).where(keep, 0)
        return lp, (-(log_p.exp() * log_p).sum(-1)).where(keep, 0)

    same_as(lambda a, b: fl.linear_log_probs(a, b, target, temperature=0.7, return_entropy=True, chunk_size=5),
            stock, h, w)
    from fusedlayers import post_training  # the losses on top: torch only as well

    h2 = torch.randn(4, 3, 16)
    t2 = torch.randint(0, 50, (4, 3))
    ref = torch.randn(4)

    def dpo_stock(a, b):
        seq = F.linear(a, b).log_softmax(-1).gather(-1, t2[..., None]).squeeze(-1).sum(-1) - ref
        return -F.logsigmoid(0.1 * (seq[:2] - seq[2:])).mean()

    same_as(lambda a, b: post_training.linear_dpo_loss(a, b, t2, ref_log_probs=ref)[0], dpo_stock, h2, w)


@check("fake_quantize", "fake_quantize_dynamic")
def _():
    scale, zero = torch.rand(6) / 20 + 0.01, torch.randint(-3, 3, (6,), dtype=torch.int32)
    same_as(lambda t: fl.fake_quantize(t, scale, zero, -128, 127, axis=1),
            lambda t: torch.fake_quantize_per_channel_affine(t, scale, zero, 1, -128, 127), x)
    rows = x.reshape(-1, 33)
    row_scale = rows.abs().amax(1) / 127.5  # symmetric int8 per row: max|x| / ((qmax - qmin) / 2)
    row_zero = torch.zeros(len(rows), dtype=torch.int32)
    same_as(lambda t: fl.fake_quantize_dynamic(t, symmetric=True),
            lambda t: torch.fake_quantize_per_channel_affine(t, row_scale, row_zero, 0, -128, 127), rows)


@check("FakeQuantLinear", "qat")
def _():
    layer = fl.FakeQuantLinear(33, 8, weight_bits=8, weight_granularity="per_channel")
    w_scale = layer.weight.detach().abs().amax(1) / 127.5
    zeros = torch.zeros(8, dtype=torch.int32)
    stock = lambda t: F.linear(t, torch.fake_quantize_per_channel_affine(layer.weight, w_scale, zeros, 0, -128, 127),
                               layer.bias)
    assert_close(layer(x), stock(x))
    model = nn.Sequential(nn.Linear(33, 16), nn.ReLU(), nn.Linear(16, 4))
    prepared = fl.qat.prepare(model, weight_bits=8)
    assert isinstance(prepared[0], fl.FakeQuantLinear)
    fake_quantized = prepared(x)
    converted = fl.qat.convert(prepared)
    assert isinstance(converted[0], fl.qat.QuantizedLinear)
    assert_close(converted(x), fake_quantized, atol=1e-4, rtol=1e-4)  # real int8 weights = their fake-quant twins


@check("checkpoint", "CheckpointedBlock")
def _():
    block = nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 33))
    same_as(lambda t: fl.checkpoint(block, t), block, x)
    same_module(fl.CheckpointedBlock(nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 33))), block, x)


@check("rms_norm", "RMSNorm", "layer_norm", "LayerNorm")
def _():
    weight, bias = torch.randn(33), torch.randn(33)
    same_as(lambda t, w: fl.rms_norm(t, (33,), w), lambda t, w: F.rms_norm(t, (33,), w), x, weight)
    same_as(lambda t, w, b: fl.layer_norm(t, (33,), w, b), lambda t, w, b: F.layer_norm(t, (33,), w, b),
            x, weight, bias)
    same_module(fl.RMSNorm(33), nn.RMSNorm(33), x)
    same_module(fl.LayerNorm(33), nn.LayerNorm(33), x)


@check("rotary_embedding", "ApplyRotaryEmbedding")
def _():
    q, k = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 7, 16)
    angle = torch.arange(7)[:, None] * 0.1 ** torch.arange(8)[None]
    cos, sin = torch.cat([angle.cos()] * 2, -1)[None], torch.cat([angle.sin()] * 2, -1)[None]

    def rotate(t):  # transformers' apply_rotary_pos_emb, rotate-half convention
        t1, t2 = t.chunk(2, -1)
        return t * cos[:, None] + torch.cat([-t2, t1], -1) * sin[:, None]

    same_as(lambda a, b: fl.rotary_embedding(a, b, cos, sin), lambda a, b: (rotate(a), rotate(b)), q, k)
    same_as(lambda a, b: fl.ApplyRotaryEmbedding()(a, b, cos, sin), lambda a, b: (rotate(a), rotate(b)), q, k)


@check("swiglu", "SwiGLUMLP")
def _():
    same_as(fl.swiglu, lambda g, u: F.silu(g) * u, x, torch.randn_like(x))
    mlp = fl.SwiGLUMLP(33, 40)
    same_as(mlp, lambda t: mlp.down_proj(F.silu(mlp.gate_proj(t)) * mlp.up_proj(t)), x)


@check("geglu", "GeGLUMLP")
def _():
    same_as(lambda g, u: fl.geglu(g, u, "tanh"), lambda g, u: F.gelu(g, approximate="tanh") * u, x, torch.randn_like(x))
    mlp = fl.GeGLUMLP(33, 40)
    same_as(mlp, lambda t: mlp.down_proj(F.gelu(mlp.gate_proj(t), approximate="tanh") * mlp.up_proj(t)), x)


@check("use_backend", "current_backend", "use_deterministic_attention")
def _():
    with fl.use_backend("reference"):
        assert fl.current_backend() == "reference"
        same_as(lambda t: fl.softmax(t, -1), lambda t: torch.softmax(t, -1), x)
    with fl.use_deterministic_attention(True):
        pass


missing = sorted(set(fl.__all__) - checked)
assert not missing, f"public names without a check against their torch twin: {missing}"


def extras_named():
    importlib.import_module("fusedlayers.integrations.sdpa")  # torch only
    for name, extra in (("transformers", "fusedlayers[transformers]"), ("thunder", "fusedlayers[thunder]")):
        try:
            importlib.import_module(f"fusedlayers.integrations.{name}")
        except ImportError as error:
            assert extra in str(error), f"the ImportError does not name the extra {extra!r}: {error}"
        else:
            raise AssertionError(f"fusedlayers.integrations.{name} imported without {name} installed")
    trl_integration = importlib.import_module("fusedlayers.integrations.trl")  # imports TRL only when applied
    try:
        trl_integration.apply()
    except ImportError as error:
        assert "fusedlayers[trl]" in str(error), f"the ImportError does not name the extra: {error}"
    else:
        raise AssertionError("fusedlayers.integrations.trl applied without trl installed")
    print("ok  integrations: sdpa imports; transformers, thunder and trl name their extras")


extras_named()
print(f"wheel smoke test passed: {len(checked)} public names against their torch twins")
