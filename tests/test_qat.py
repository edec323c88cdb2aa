"""fl.FakeQuantLinear, fl.qat.prepare / convert and QuantizedLinear.

FakeQuantLinear disabled is nn.Linear exactly; enabled it is torch's fake quant of the weight (and torchao's
per-token activations) followed by F.linear; prepare swaps layers in place keeping the parameters; convert
gives int8 / packed-int4 layers whose outputs equal the fake-quantized model's exactly (CPU fp32) with a
state_dict 4x / ~8x smaller.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch
from torch import nn

import fusedlayers as fl
from fusedlayers.modules import absmax_scale, quant_range
from fusedlayers.qat import QuantizedLinear, pack_int4, unpack_int4

CONFIGS = [
    dict(weight_bits=8, granularity="per_channel"),
    dict(weight_bits=4, granularity="per_group", group_size=16, act_bits=8),
    dict(weight_bits=4, granularity="per_tensor"),
    dict(weight_bits=3, granularity="per_channel", act_bits=6),
    dict(weight_bits=4, granularity="per_channel", learnable_scale=True),
    dict(weight_bits=8, granularity="per_group", group_size=32, learnable_scale=True, scale_init="lsq"),
]


class Net(nn.Module):
    def __init__(self, d_in=64, d_hidden=96, d_out=48, bias_last=False):
        super().__init__()
        self.up = nn.Linear(d_in, d_hidden)
        self.block = nn.Sequential(nn.GELU(), nn.Linear(d_hidden, d_hidden), nn.GELU())
        self.head = nn.Linear(d_hidden, d_out, bias=bias_last)

    def forward(self, x):
        return self.head(self.block(self.up(x)))


def _fq_kwargs(config):
    config = dict(config)
    config["weight_granularity"] = config.pop("granularity")
    return config


# ----------------------------------------------------------------------------- FakeQuantLinear


def _linear_pair(**config):
    torch.manual_seed(0)
    stock = nn.Linear(24, 10)
    torch.manual_seed(0)
    fused = fl.FakeQuantLinear(24, 10, **config)
    return stock, fused


@pytest.mark.parametrize("config", [dict(weight_bits=None), dict(disable=True), dict(disable=True, act_bits=8),
                                    dict(disable=True, weight_bits=4, weight_granularity="per_group", group_size=8,
                                         learnable_scale=True)])
@pytest.mark.parametrize("optimizer", [torch.optim.SGD, torch.optim.AdamW])
def test_disabled_equals_nn_linear_exactly(config, optimizer):
    config = dict(config)
    disable = config.pop("disable", False)
    stock, fused = _linear_pair(**config)
    if disable:
        fused.disable_fake_quant()
    assert torch.equal(stock.weight, fused.weight) and torch.equal(stock.bias, fused.bias)  # same initialisation
    x = torch.randn(7, 24)
    opts = [optimizer(m.parameters(), lr=0.1) for m in (stock, fused)]
    outs = []
    for m, opt in zip((stock, fused), opts, strict=True):
        y = m(x)
        (y.square().mean()).backward()
        grads = (m.weight.grad.clone(), m.bias.grad.clone())
        opt.step()
        outs.append((y, *grads, m.weight.detach().clone(), m.bias.detach().clone()))
    for a, b, what in zip(outs[0], outs[1], ["output", "grad weight", "grad bias", "weight after step",
                                             "bias after step"], strict=True):
        assert torch.equal(a, b), what
    if fused.weight_scale is not None:
        assert fused.weight_scale.grad is None


def test_same_parameter_names_and_checkpoints_load_both_ways():
    stock, fused = _linear_pair(weight_bits=4, weight_granularity="per_group", group_size=8, act_bits=8)
    assert [n for n, _ in stock.named_parameters()] == [n for n, _ in fused.named_parameters()]
    assert stock.state_dict().keys() == fused.state_dict().keys()
    fused.load_state_dict(nn.Linear(24, 10).state_dict())
    stock.load_state_dict(fused.state_dict())
    assert isinstance(fused, nn.Linear)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("granularity", ["per_tensor", "per_channel", "per_group"])
def test_enabled_forward_is_torch_fake_quant_then_linear(backend, granularity):
    """The weight is torch's fake quant with max|w|-based symmetric scales; activations torchao per-token int8;
    the weight gradient is the straight-through one with the clipping mask."""
    group = 8 if granularity == "per_group" else None
    torch.manual_seed(1)
    fused = fl.FakeQuantLinear(24, 10, weight_bits=4, weight_granularity=granularity, group_size=group, act_bits=8)
    x = torch.randn(5, 24) * 2
    qmin, qmax = quant_range(4)
    w = fused.weight.detach().clone().requires_grad_()
    scale = absmax_scale(w, 4, granularity, group)
    if granularity == "per_tensor":
        w_fq = torch.fake_quantize_per_tensor_affine(w, scale, torch.zeros(1, dtype=torch.int32), qmin, qmax)
    else:
        g = 24 if granularity == "per_channel" else group
        w_fq = torch.fake_quantize_per_channel_affine(w.reshape(-1, g), scale.reshape(-1),
                                                      torch.zeros(scale.numel(), dtype=torch.int32), 0, qmin,
                                                      qmax).reshape(w.shape)
    # torchao's per-token asymmetric int8 qparams, then torch's per-channel fake quant over rows
    mn = torch.clamp(x.amin(-1), max=0.0)
    mx = torch.clamp(x.amax(-1), min=0.0)
    s = torch.clamp((mx - mn) / 255.0, min=torch.finfo(torch.float32).eps)
    zf = torch.where((-128 + mn / s) + (127 + mx / s) > 0, -128 - mn / s, 127 - mx / s)
    z = torch.clamp(zf, -128, 127).round().int()
    x_fq = torch.fake_quantize_per_channel_affine(x, s, z, 0, -128, 127)
    expected = nn.functional.linear(x_fq, w_fq, fused.bias)
    with fl.use_backend(backend):
        y = fused(x)
    assert torch.equal(y, expected)
    grad = torch.randn_like(y)
    y.backward(grad)
    expected.backward(grad)
    assert torch.equal(fused.weight.grad, w.grad)


def test_learnable_scale_init_and_lsq_gradient():
    torch.manual_seed(2)
    m = fl.FakeQuantLinear(32, 6, weight_bits=4, weight_granularity="per_channel", learnable_scale=True,
                           scale_init="lsq")
    qmax = 7
    torch.testing.assert_close(m.weight_scale.detach(), 2 * m.weight.detach().abs().mean(1) / qmax ** 0.5)
    m.init_weight_scale("absmax")
    assert torch.equal(m.weight_scale.detach(), m.weight.detach().abs().amax(1) / 7.5)
    assert m.grad_factor == pytest.approx(1 / (32 * qmax) ** 0.5)
    x = torch.randn(9, 32)
    m(x).square().sum().backward()
    # the same through torch's learnable op with the same grad_factor
    w = m.weight.detach().clone().requires_grad_()
    s = m.weight_scale.detach().clone().requires_grad_()
    w_fq = torch._fake_quantize_learnable_per_channel_affine(w, s, torch.zeros(6), 0, -8, 7, m.grad_factor)
    nn.functional.linear(x, w_fq, m.bias.detach()).square().sum().backward()
    assert torch.equal(m.weight.grad, w.grad)
    torch.testing.assert_close(m.weight_scale.grad, s.grad, rtol=1e-5, atol=1e-6)
    assert m.weight_scale.grad.abs().sum() > 0


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(weight_bits=1), ValueError, "weight_bits"),
    (dict(weight_bits=9), ValueError, "weight_bits"),
    (dict(weight_bits="8"), TypeError, "weight_bits"),
    (dict(act_bits=16), ValueError, "act_bits"),
    (dict(weight_granularity="per_row"), ValueError, "weight_granularity"),
    (dict(weight_granularity="per_group"), ValueError, "group_size"),
    (dict(weight_granularity="per_group", group_size=5), ValueError, "group_size=5 does not divide"),
    (dict(weight_granularity="per_channel", group_size=8), ValueError, "group_size=8 contradicts weight_granularity"),
    (dict(weight_granularity="per_tensor", group_size=8), ValueError, "group_size=8 contradicts weight_granularity"),
    (dict(group_size=5), ValueError, "group_size=5 does not divide"),
    (dict(learnable_scale=1), TypeError, "learnable_scale"),
    (dict(learnable_scale=True, scale_init="mse"), ValueError, "scale_init"),
])
def test_fake_quant_linear_config_errors(kwargs, error, words):
    with pytest.raises(error, match=words):
        fl.FakeQuantLinear(24, 10, **kwargs)


def test_group_size_alone_means_per_group():
    """A group_size without a granularity means per-group (torchao's rule), in FakeQuantLinear and QuantizedLinear:
    the same layer as an explicit weight_granularity="per_group"; without either, per channel."""
    explicit = _linear_pair(weight_bits=4, weight_granularity="per_group", group_size=8)[1]
    implied = _linear_pair(weight_bits=4, group_size=8)[1]
    assert implied.weight_granularity == "per_group" and implied.group_size == 8
    x = torch.randn(5, 24)
    assert torch.equal(implied(x), explicit(x))
    assert fl.FakeQuantLinear(24, 10).weight_granularity == "per_channel"
    learnable = fl.FakeQuantLinear(24, 10, weight_bits=4, group_size=8, learnable_scale=True)
    assert learnable.weight_scale.shape == (10, 3)
    assert QuantizedLinear(24, 10, weight_bits=4, group_size=8).weight_scale.shape == (10, 3)
    assert QuantizedLinear(24, 10, weight_bits=4).weight_granularity == "per_channel"
    with pytest.raises(ValueError, match="contradicts weight_granularity='per_channel'"):
        QuantizedLinear(24, 10, weight_bits=4, weight_granularity="per_channel", group_size=8)


# ----------------------------------------------------------------------------- prepare


def test_prepare_swaps_in_place_and_keeps_parameters():
    torch.manual_seed(3)
    model = Net()
    params = {name: p for name, p in model.named_parameters()}
    out = fl.qat.prepare(model, weight_bits=4, act_bits=8, granularity="per_group", group_size=16)
    assert out is model
    for name in ("up", "block.1", "head"):
        assert type(model.get_submodule(name)) is fl.FakeQuantLinear
    for name, p in model.named_parameters():
        assert p is params[name], name  # the very same Parameter objects (ties, optimizer state survive)
    fl.qat.disable_fake_quant(model)
    fresh = Net()
    fresh.load_state_dict(model.state_dict())
    x = torch.randn(3, 64)
    assert torch.equal(model(x), fresh(x))
    fl.qat.enable_fake_quant(model)
    assert not torch.equal(model(x), fresh(x))


def test_prepare_group_size_means_per_group():
    """prepare(model, weight_bits=4, group_size=32) is per-group quantization of every swapped layer, the same model as
    with granularity="per_group" spelled out (and it converts to the same int4 weights); without a group size the
    default stays per channel."""
    torch.manual_seed(0)
    implied, explicit = Net(), Net()
    explicit.load_state_dict(implied.state_dict())
    fl.qat.prepare(implied, weight_bits=4, group_size=32)
    fl.qat.prepare(explicit, weight_bits=4, granularity="per_group", group_size=32)
    for name in ("up", "block.1", "head"):
        layer = implied.get_submodule(name)
        assert (layer.weight_granularity, layer.group_size) == ("per_group", 32), name
    x = torch.randn(3, 64)
    assert torch.equal(implied(x), explicit(x))
    fl.qat.convert(implied)
    fl.qat.convert(explicit)
    pairs = zip(implied.state_dict().values(), explicit.state_dict().values(), strict=True)
    assert all(torch.equal(a, b) for a, b in pairs)
    assert fl.qat.prepare(Net(), weight_bits=4).up.weight_granularity == "per_channel"
    assert fl.qat.prepare(nn.Linear(64, 8), weight_bits=4, group_size=16).weight_granularity == "per_group"


@pytest.mark.parametrize("skip, kept", [
    (["head"], {"head"}),
    (["block"], {"block.1"}),
    (["*.1"], {"block.1"}),
    (lambda name, module: module.out_features == 48, {"head"}),
    (None, set()),
])
def test_prepare_skip(skip, kept):
    model = fl.qat.prepare(Net(), weight_bits=8, skip=skip)
    for name in ("up", "block.1", "head"):
        expected = nn.Linear if name in kept else fl.FakeQuantLinear
        assert type(model.get_submodule(name)) is expected, name


def test_prepare_leaves_linear_subclasses_and_handles_a_bare_linear():
    mha = nn.MultiheadAttention(16, 2)
    fl.qat.prepare(mha, weight_bits=8)
    assert type(mha.out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    linear = nn.Linear(8, 4)
    swapped = fl.qat.prepare(linear, weight_bits=8)
    assert isinstance(swapped, fl.FakeQuantLinear) and swapped.weight is linear.weight


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(weight_bits=1), ValueError, "weight_bits"),
    (dict(weight_bits=12), ValueError, "weight_bits"),
    (dict(act_bits=0), ValueError, "act_bits"),
    (dict(granularity="per_group", group_size=48), ValueError, "layer 'up'"),
    (dict(granularity="per_group", group_size=0), ValueError, "group_size"),
    (dict(granularity="channel"), ValueError, "granularity"),
    (dict(granularity="per_channel", group_size=16), ValueError, "group_size=16 contradicts granularity='per_channel'"),
    (dict(granularity="per_tensor", group_size=16), ValueError, "contradicts granularity='per_tensor'"),
    (dict(weight_bits=4, group_size=48), ValueError, "layer 'up'"),
    (dict(skip="head"), TypeError, "skip"),
])
def test_prepare_config_errors_leave_model_unchanged(kwargs, error, words):
    model = Net()
    before = copy.deepcopy(model)
    with pytest.raises(error, match=words):
        fl.qat.prepare(model, **kwargs)
    assert [type(m) for m in model.modules()] == [type(m) for m in before.modules()]


# ----------------------------------------------------------------------------- convert


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_convert_outputs_equal_fake_quantized_model_exactly(config):
    torch.manual_seed(4)
    model = fl.qat.prepare(Net(bias_last=True), **config)
    if config.get("learnable_scale"):  # move the scales off their initial values
        with torch.no_grad():
            for m in model.modules():
                if isinstance(m, fl.FakeQuantLinear):
                    m.weight_scale.mul_(torch.rand_like(m.weight_scale) * 0.5 + 0.75)
    x = torch.randn(11, 64) * 3
    with torch.no_grad():
        expected = model(x)
    fp32_bytes = fl.qat.state_dict_nbytes(model)
    fl.qat.convert(model)
    assert not any(isinstance(m, fl.FakeQuantLinear) for m in model.modules())
    with torch.no_grad():
        assert torch.equal(model(x), expected)
    bits = config["weight_bits"]
    expected_bytes = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            assert m.qweight.dtype == (torch.uint8 if bits <= 4 else torch.int8)
            assert m.qweight.numel() == m.out_features * ((m.in_features + 1) // 2 if bits <= 4 else m.in_features)
            expected_bytes += m.qweight.numel() + 4 * m.weight_scale.numel() + 4 * m.out_features  # + bias
    # one byte (or half) per weight, fp32 scales and biases: nothing else is stored
    assert fl.qat.state_dict_nbytes(model) == expected_bytes
    assert fp32_bytes / expected_bytes > 3
    # the state_dict round-trips into a fresh converted model
    clone = fl.qat.convert(fl.qat.prepare(Net(bias_last=True), **config))
    clone.load_state_dict(model.state_dict())
    with torch.no_grad():
        assert torch.equal(clone(x), expected)


def test_state_dict_is_that_many_times_smaller():
    """int8 weights 4x, int4 8x smaller; with per-channel scales and biases the whole state_dict of a
    1024 x 1024 layer is within 2% of that; per-group scales (fp32, one per group) cost 32 / group_size bits
    per weight more."""
    for bits, granularity, group, ideal in [(8, "per_channel", None, 4), (4, "per_channel", None, 8),
                                            (4, "per_group", 128, 8 * 4 / (4 + 32 / 128))]:
        model = nn.Sequential(nn.Linear(1024, 1024))
        fp32 = fl.qat.state_dict_nbytes(model)
        fl.qat.convert(fl.qat.prepare(model, weight_bits=bits, granularity=granularity, group_size=group))
        q = model[0]
        assert q.qweight.numel() * q.qweight.element_size() * (32 // bits) == 1024 * 1024 * 4
        assert fp32 / fl.qat.state_dict_nbytes(model) > 0.98 * ideal


def test_convert_bf16_model_and_odd_in_features():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(33, 20), nn.ReLU(), nn.Linear(20, 7)).to(torch.bfloat16)
    fl.qat.prepare(model, weight_bits=4, act_bits=8)
    x = torch.randn(6, 33, dtype=torch.bfloat16)
    with torch.no_grad():
        expected = model(x)
    fl.qat.convert(model)
    assert model[0].qweight.shape == (20, 17)
    with torch.no_grad():
        out = model(x)
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected)


def test_int4_pack_roundtrip():
    q = torch.randint(-8, 8, (5, 9), dtype=torch.int8)
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8 and packed.shape == (5, 5)
    assert torch.equal(unpack_int4(packed, 9), q)
    assert pack_int4(torch.tensor([[-1, 2]], dtype=torch.int8)).item() == 0x2F


def test_convert_without_weight_bits():
    model = fl.qat.prepare(Net(), weight_bits=None, act_bits=8, skip=["head"])
    fl.qat.convert(model)
    assert type(model.up) is fl.FakeQuantLinear  # activation-only: nothing to store as integers
    model = fl.qat.prepare(Net(), weight_bits=None)
    weight = model.up.weight
    fl.qat.convert(model)
    assert type(model.up) is nn.Linear and model.up.weight is weight


# ----------------------------------------------------------------------------- QAT end to end (tiny)


def test_qat_recovers_accuracy_on_a_toy_regression():
    """A teacher-student toy: fake-quantized int3 weights start worse than fp; a few hundred QAT steps with
    learnable scales bring the loss down, and the converted model computes the same."""
    torch.manual_seed(6)
    teacher = Net(32, 64, 8)
    x = torch.randn(512, 32)
    with torch.no_grad():
        target = teacher(x)
    student = copy.deepcopy(teacher)
    fl.qat.prepare(student, weight_bits=3, granularity="per_channel", learnable_scale=True)
    loss_fn = functools.partial(nn.functional.mse_loss, target=target)
    with torch.no_grad():
        ptq_loss = loss_fn(student(x)).item()
    opt = torch.optim.Adam(student.parameters(), lr=1e-3)
    for _ in range(150):
        opt.zero_grad()
        loss_fn(student(x)).backward()
        opt.step()
    with torch.no_grad():
        qat_loss = loss_fn(student(x)).item()
        expected = student(x)
        fl.qat.convert(student)
        assert torch.equal(student(x), expected)
    assert qat_loss < 0.5 * ptq_loss, (ptq_loss, qat_loss)


@pytest.mark.cuda
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_cuda_fake_quant_linear_kernels_and_convert(config):
    """On the GPU: the Triton path equals the reference path, gradients flow, and the converted model
    computes exactly what the fake-quantized one did."""
    torch.manual_seed(7)
    model = fl.qat.prepare(Net(bias_last=True).cuda(), **config)
    x = torch.randn(64, 64, device="cuda") * 3
    y = model(x)
    y.square().mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    with fl.use_backend("reference"):
        assert torch.equal(model(x), y)
    with torch.no_grad():
        expected = model(x)
        fl.qat.convert(model)
        assert torch.equal(model(x), expected)
