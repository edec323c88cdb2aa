"""fl.fake_quantize / fl.fake_quantize_dynamic: bit-exact parity with torch's fake-quant ops (forward and
STE gradient), LSQ gradients vs torch._fake_quantize_learnable_*, per-group and dynamic per-token
quantization, gradcheck, opcheck, torch.compile, errors.

Every parity test runs on the reference backend and on the Triton kernels (under TRITON_INTERPRET=1 on
CPU); `cuda`-marked tests compare the compiled kernels with torch's CUDA ops.
"""

from __future__ import annotations

import functools

import pytest
import torch
from torch.library import opcheck

import fusedlayers as fl
from fusedlayers.kernels import fake_quantize as kernels
from fusedlayers.ops import fake_quantize as ops
from tests.conftest import INTERPRETER
from tests.parity import assert_parity

BACKENDS = ["reference", "triton"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
RANGES = [(-128, 127), (0, 255), (-8, 7), (0, 15), (-3, 40)]
fq = torch.ops.fusedlayers


def _values(shape, scale, zero_point, qmin, qmax, dtype, generator=None):
    """Values of the quantization grid's scale: a third in range, a third far outside it (up to 50x the
    range), a third next to .5 rounding ties (where the rounding mode and the zero point's place show)."""
    scale = torch.as_tensor(scale, dtype=torch.float32)
    zero_point = torch.as_tensor(zero_point, dtype=torch.float32)
    n = int(torch.tensor(shape).prod())
    kind = torch.randint(0, 3, (n,), generator=generator).reshape(shape)
    width = qmax - qmin + 1
    inside = (torch.rand(shape, generator=generator) * width + qmin - zero_point)
    outside = torch.randn(shape, generator=generator) * 50 * width
    k = torch.randint(qmin - 3, qmax + 3, shape, generator=generator).float() - zero_point
    ties = k + 0.5 + (torch.rand(shape, generator=generator) - 0.5) * 2e-6
    q = torch.where(kind == 0, inside, torch.where(kind == 1, outside, ties))
    return (q.double() * scale.double()).to(dtype)


def _random_qparams(shape, qmin, qmax, integer_zp=True):
    scale = torch.rand(shape) * 0.2 + 0.01
    if integer_zp:
        return scale, torch.randint(qmin, qmax + 1, shape, dtype=torch.int32)
    return scale, torch.rand(shape) * (qmax - qmin) + qmin


def _skip_interpreter_bf16(backend, dtype):
    if backend == "triton" and dtype == torch.bfloat16 and INTERPRETER:
        pytest.skip("Triton's interpreter truncates fp32 -> bf16 stores instead of rounding (run on the GPU)")


def _same(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype, f"{what}: dtype {a.dtype} != {b.dtype}"
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    bad = ~((a == b) | (a.isnan() & b.isnan()))
    assert not bad.any(), (f"{what}: {int(bad.sum())} of {a.numel()} elements differ, e.g. "
                           f"{a[bad][:4].tolist()} vs {b[bad][:4].tolist()}")


def _ste_pair(fused_fn, stock_fn, x, what):
    """Forward and input gradient of fused and stock, bit for bit."""
    xf = x.detach().clone().requires_grad_()
    xs = x.detach().clone().requires_grad_()
    yf, ys = fused_fn(xf), stock_fn(xs)
    _same(yf, ys, f"{what} forward")
    grad = torch.randn_like(ys)
    yf.backward(grad)
    ys.backward(grad)
    _same(xf.grad, xs.grad, f"{what} grad input")
    return yf


def _learnable_per_tensor(t, s, z, qmin, qmax, grad_factor):
    return torch._fake_quantize_learnable_per_tensor_affine(t, s, z, qmin, qmax, grad_factor)


def _learnable_per_channel(t, s, z, axis, qmin, qmax, grad_factor):
    return torch._fake_quantize_learnable_per_channel_affine(t, s, z, axis, qmin, qmax, grad_factor)


def _torch_per_group(t, scale, zp, qmin, qmax):
    """torch's per-channel op on the (groups, group_size) view."""
    group = t.shape[-1] // scale.shape[-1]
    return torch.fake_quantize_per_channel_affine(t.reshape(-1, group), scale.reshape(-1), zp.reshape(-1), 0, qmin,
                                                  qmax).reshape(t.shape)


# ----------------------------------------------------------------------------- per tensor / per channel


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_tensor_bit_exact_with_torch(backend, dtype):
    _skip_interpreter_bf16(backend, dtype)
    gen = torch.Generator().manual_seed(1)
    for shape, (qmin, qmax) in zip([(257,), (3, 50), (2, 3, 41), (1030,), (4, 1, 9)], RANGES, strict=True):
        scale = float(torch.rand(1, generator=gen) * 0.2 + 0.01)
        zp = int(torch.randint(qmin, qmax + 1, (1,), generator=gen))
        x = _values(shape, scale, zp, qmin, qmax, dtype, gen)
        with fl.use_backend(backend):
            args = (scale, zp, qmin, qmax)
            _ste_pair(lambda t, a=args: fl.fake_quantize(t, *a),
                      lambda t, a=args: torch.fake_quantize_per_tensor_affine(t, *a), x, f"{shape} {qmin}..{qmax}")
            # tensor qparams take torch's other overload
            args = (torch.tensor([scale]), torch.tensor([zp], dtype=torch.int32), qmin, qmax)
            _ste_pair(lambda t, a=args: fl.fake_quantize(t, *a),
                      lambda t, a=args: torch.fake_quantize_per_tensor_affine(t, *a), x, "tensor qparams")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_channel_bit_exact_with_torch(backend, dtype):
    _skip_interpreter_bf16(backend, dtype)
    gen = torch.Generator().manual_seed(2)
    for shape in [(5, 7), (3, 4, 37), (2, 3, 2, 5)]:
        for axis in range(len(shape)):
            qmin, qmax = RANGES[axis % len(RANGES)]
            scale, zp = _random_qparams((shape[axis],), qmin, qmax)
            x = _values(shape, scale.reshape([-1 if d == axis else 1 for d in range(len(shape))]),
                        zp.reshape([-1 if d == axis else 1 for d in range(len(shape))]), qmin, qmax, dtype, gen)
            with fl.use_backend(backend):
                _ste_pair(lambda t, a=(scale, zp, qmin, qmax, axis): fl.fake_quantize(t, *a),
                          lambda t, a=(scale, zp, axis, qmin, qmax): torch.fake_quantize_per_channel_affine(t, *a),
                          x, f"{shape} axis {axis}")
    # a negative axis is the same channel dim
    x = torch.randn(4, 6) * 3
    scale, zp = _random_qparams((6,), -128, 127)
    _same(fl.fake_quantize(x, scale, zp, -128, 127, -1),
          torch.fake_quantize_per_channel_affine(x, scale, zp, 1, -128, 127), "axis -1")


def test_rounding_is_half_to_even_after_adding_nothing():
    """Exact ties (power-of-two scale): 0.5 -> 0, 1.5 -> 2, 2.5 -> 2, -0.5 -> -0, then + zero point."""
    x = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5]) * 0.25
    for backend in BACKENDS:
        with fl.use_backend(backend):
            y = fl.fake_quantize(x, 0.25, 3, -128, 127)
        assert y.tolist() == [v * 0.25 for v in [0.0, 2.0, 2.0, 4.0, 0.0, -2.0, -2.0]]


@pytest.mark.parametrize("backend", BACKENDS)
def test_nonfinite_inputs_as_torch_per_tensor(backend):
    x = torch.tensor([float("nan"), float("inf"), float("-inf"), 1e30, -1e30, 0.3, 3e38])
    with fl.use_backend(backend):
        _ste_pair(lambda t: fl.fake_quantize(t, 0.1, 4, -8, 7),
                  lambda t: torch.fake_quantize_per_tensor_affine(t, 0.1, 4, -8, 7), x, "non-finite")


# ----------------------------------------------------------------------------- LSQ (learnable qparams)


def _lsq_f64(grad, x, scale, zp_b, qmin, qmax, axis, group_size, grad_factor, mode):
    """dscale / dzero_point of LSQ in float64 from the same rounding decisions (made in fp32, as torch)."""
    _, s, _, z, q, qc, keep = ops._reference_terms(x.float(), scale.float(), zp_b, qmin, qmax, axis, group_size, mode)
    s, z, q, qc = s.double(), z.double(), q.double(), qc.double()
    xv = ops._grouped(x.double(), group_size)
    g = ops._grouped(grad.double(), group_size)
    d_in = g * ((qc - z) * s - xv) / s
    d_out = torch.where(q < qmin, g * (qmin - z), g * (qmax - z))
    ds = torch.where(keep, d_in, d_out) * grad_factor
    dz = torch.where(keep, torch.zeros_like(g), -g * s) * grad_factor
    red = lambda t: ops._reduce_to(t, x.shape, axis, group_size)  # noqa: E731
    # floor: fp32 summation error bound scale (eps * sum of |terms|) per qparam
    return red(ds), red(dz), red(ds.abs()).max().item(), red(dz.abs()).max().item()


def _check_lsq(x, scale, zp, qmin, qmax, axis, grad_factor, stock_fn, group_size=None, need_zp=True):
    xf, xs = x.clone().requires_grad_(), x.clone().requires_grad_()
    sf, ss = scale.clone().requires_grad_(), scale.clone().requires_grad_()
    zf, zs = zp.clone().requires_grad_(need_zp), zp.clone().requires_grad_(need_zp)
    yf = fl.fake_quantize(xf, sf, zf, qmin, qmax, axis, group_size=group_size, grad_factor=grad_factor)
    ys = stock_fn(xs, ss, zs)
    _same(yf, ys, "LSQ forward")
    grad = torch.randn_like(ys)
    yf.backward(grad)
    ys.backward(grad)
    _same(xf.grad, xs.grad, "LSQ grad input")
    per_tensor = axis is None and group_size is None
    zp_b = ops.lsq_zero_point(zp, qmin, qmax, per_tensor)
    ds64, dz64, ds_mag, dz_mag = _lsq_f64(grad, x, scale, zp_b, qmin, qmax, axis, group_size or 0, grad_factor,
                                          ops.lsq_round_mode(x))
    assert_parity(sf.grad, ss.grad, ds64.reshape(scale.shape), "grad scale", floor=1e-6 * ds_mag + 1e-7)
    if need_zp:
        assert_parity(zf.grad, zs.grad, dz64.reshape(zp.shape), "grad zero_point", floor=1e-6 * dz_mag + 1e-7)
    else:
        assert zf.grad is None


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad_factor", [1.0, 0.37])
def test_learnable_per_tensor_matches_torch(backend, grad_factor):
    gen = torch.Generator().manual_seed(3)
    for shape, (qmin, qmax), zp in [((301,), (-128, 127), 2.5), ((7, 33), (-8, 7), -1.7), ((2, 3, 40), (-20, 60), 0.4),
                                    ((5, 8), (-4, 3), 3.5)]:
        scale = torch.rand(1, generator=gen) * 0.2 + 0.01
        zp = torch.tensor([zp])
        x = _values(shape, scale, torch.round(zp), qmin, qmax, torch.float32, gen)
        stock = functools.partial(_learnable_per_tensor, qmin=qmin, qmax=qmax, grad_factor=grad_factor)
        with fl.use_backend(backend):
            _check_lsq(x, scale, zp, qmin, qmax, None, grad_factor, stock)
            _check_lsq(x, scale, zp, qmin, qmax, None, grad_factor, stock, need_zp=False)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("grad_factor", [1.0, 0.37])
def test_learnable_per_channel_matches_torch(backend, grad_factor):
    gen = torch.Generator().manual_seed(4)
    # (2, 9000): rows longer than one program's block (partial sums summed) along axis 0, one partial along axis 1
    for shape in [(6, 35), (3, 5, 17), (4, 2, 3, 9), (2, 9000)]:
        for axis in range(len(shape)):
            qmin, qmax = [(-128, 127), (-8, 7), (-20, 60)][axis % 3]
            scale, zp = _random_qparams((shape[axis],), qmin, qmax, integer_zp=False)
            bshape = [-1 if d == axis else 1 for d in range(len(shape))]
            x = _values(shape, scale.reshape(bshape), torch.round(zp).clamp(qmin, qmax).reshape(bshape), qmin, qmax,
                        torch.float32, gen)
            stock = functools.partial(_learnable_per_channel, axis=axis, qmin=qmin, qmax=qmax, grad_factor=grad_factor)
            with fl.use_backend(backend):
                _check_lsq(x, scale, zp, qmin, qmax, axis, grad_factor, stock)


@pytest.mark.parametrize("backend", BACKENDS)
def test_learnable_rounding_decisions_match_torch_per_element(backend):
    """One element per channel, so torch's dscale / dzero_point are per-element values: near .5 ties (where
    rounding before or after adding the zero point, fused or not, decides q) every element's q must be
    torch's, or its gradient would be off by about |grad| (a float-rounding difference is ~1e-7)."""
    _check_lsq_decisions(backend, "cpu")


def _check_lsq_decisions(backend, device):
    gen = torch.Generator().manual_seed(8)
    n, qmin, qmax = 4000, -20, 19
    scale = torch.rand(n, generator=gen) * 0.5 + 0.05
    zp = torch.randint(-5, 6, (n,), generator=gen).float()
    k = torch.randint(qmin - 3, qmax + 3, (n,), generator=gen).float() - zp
    x = ((k + 0.5 + (torch.rand(n, generator=gen) - 0.5) * 1e-5).double() * scale.double()).float().reshape(n, 1)
    x, scale, zp = x.to(device), scale.to(device), zp.to(device)
    stock = functools.partial(_learnable_per_channel, axis=0, qmin=qmin, qmax=qmax, grad_factor=1.0)
    grads = []
    for fn in (functools.partial(fl.fake_quantize, quant_min=qmin, quant_max=qmax, axis=0), stock):
        xr, sr, zr = x.clone().requires_grad_(), scale.clone().requires_grad_(), zp.clone().requires_grad_()
        with fl.use_backend(backend):
            fn(xr, sr, zr).backward(torch.ones(n, 1, device=device))
        grads.append((xr.grad, sr.grad, zr.grad))
    _same(grads[0][0], grads[1][0], "dx")
    torch.testing.assert_close(grads[0][1], grads[1][1], rtol=0, atol=1e-4, msg="dscale")
    torch.testing.assert_close(grads[0][2], grads[1][2], rtol=0, atol=1e-6, msg="dzero_point")


def test_lsq_gradients_are_the_lsq_formulas():
    """Spot values: inside the range d/dscale = (x_fq - x) / scale; below it quant_min - z, above quant_max - z;
    d/dzero_point = -scale outside the range, 0 inside; all times grad_factor."""
    x = torch.tensor([0.26, -10.0, 10.0])
    for backend in BACKENDS:
        scale = torch.tensor([0.1], requires_grad=True)
        zp = torch.tensor([1.0], requires_grad=True)
        with fl.use_backend(backend):
            y = fl.fake_quantize(x, scale, zp, -8, 7, grad_factor=0.5)
            y.backward(torch.tensor([1.0, 2.0, 3.0]))
        inside = (0.3 - 0.26) / 0.1
        expected = 0.5 * (inside + 2.0 * (-8 - 1) + 3.0 * (7 - 1))
        torch.testing.assert_close(scale.grad, torch.tensor([expected]), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(zp.grad, torch.tensor([0.5 * (-0.1 * 2.0 - 0.1 * 3.0)]), rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------- per group


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_per_group_equals_torch_per_channel_on_groups(backend, dtype):
    _skip_interpreter_bf16(backend, dtype)
    gen = torch.Generator().manual_seed(5)
    for shape, group, (qmin, qmax) in [((6, 64), 16, (-8, 7)), ((2, 3, 40), 8, (-128, 127)), ((5, 96), 32, (0, 15))]:
        qshape = (*shape[:-1], shape[-1] // group)
        scale, zp = _random_qparams(qshape, qmin, qmax)
        x = _values(shape, scale.repeat_interleave(group, -1), zp.repeat_interleave(group, -1), qmin, qmax, dtype, gen)
        stock = functools.partial(_torch_per_group, scale=scale, zp=zp, qmin=qmin, qmax=qmax)
        fused = functools.partial(fl.fake_quantize, scale=scale, zero_point=zp, quant_min=qmin, quant_max=qmax,
                                  group_size=group)
        with fl.use_backend(backend):
            _ste_pair(fused, stock, x, f"{shape} group {group}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_learnable_per_group_matches_torch_per_channel_on_groups(backend):
    gen = torch.Generator().manual_seed(6)
    shape, group, qmin, qmax = (4, 48), 16, -8, 7
    scale, zp = _random_qparams((4, 3), qmin, qmax, integer_zp=False)
    x = _values(shape, scale.repeat_interleave(group, -1), torch.round(zp).repeat_interleave(group, -1), qmin, qmax,
                torch.float32, gen)

    def stock(t, s, z):
        y = torch._fake_quantize_learnable_per_channel_affine(t.reshape(-1, group), s.reshape(-1), z.reshape(-1), 0,
                                                              qmin, qmax, 0.25)
        return y.reshape(t.shape)

    with fl.use_backend(backend):
        _check_lsq(x, scale, zp, qmin, qmax, None, 0.25, stock, group_size=group)


# ----------------------------------------------------------------------------- dynamic (per token / group)


def _torchao_qparams(x, qmin, qmax, group, symmetric):
    """torchao's choose_qparams_per_token_asymmetric / get_group_qparams_symmetric, written out."""
    xg = x.float().reshape(*x.shape[:-1], -1, group)
    min_neg = torch.min(xg.amin(-1), torch.zeros(()))
    max_pos = torch.max(xg.amax(-1), torch.zeros(()))
    eps = torch.finfo(torch.float32).eps
    if symmetric:
        scale = torch.max(-min_neg, max_pos) / (float(qmax - qmin) / 2)
        return torch.clamp(scale, min=eps), torch.zeros_like(scale)
    scale = torch.clamp((max_pos - min_neg) / float(qmax - qmin), min=eps)
    descaled_min, descaled_max = min_neg / scale, max_pos / scale
    zero_point = torch.where((qmin + descaled_min) + (qmax + descaled_max) > 0, qmin - descaled_min,
                             qmax - descaled_max)
    return scale, torch.clamp(zero_point, qmin, qmax).round()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("symmetric", [False, True])
def test_dynamic_matches_torchao_qparams_and_torch_fake_quant(backend, dtype, symmetric):
    _skip_interpreter_bf16(backend, dtype)
    gen = torch.Generator().manual_seed(7)
    cases = [((5, 33), None, -128, 127), ((2, 3, 64), 16, -8, 7), ((4, 40), 8, -4, 3), ((3, 20), None, -8, 7)]
    for shape, group, qmin, qmax in cases:
        x = (torch.randn(shape, generator=gen) * 3 + torch.randn(shape[:-1] + (1,), generator=gen)).to(dtype)
        x[0] = x[0].abs()  # an all-positive row: its range is widened to include 0
        if len(shape) == 2:
            x[-1] = 0  # an all-zero row: scale eps
        g = shape[-1] if group is None else group
        scale, zp = _torchao_qparams(x, qmin, qmax, g, symmetric)

        stock = functools.partial(_torch_per_group, scale=scale, zp=zp.int(), qmin=qmin, qmax=qmax)
        fused = functools.partial(fl.fake_quantize_dynamic, quant_min=qmin, quant_max=qmax, group_size=group,
                                  symmetric=symmetric)
        with fl.use_backend(backend):
            _ste_pair(fused, stock, x, f"{shape} group {group}")
            _, s, z = fl.fake_quantize_dynamic(x, qmin, qmax, group, symmetric, return_qparams=True)
        _same(s, scale, "scale")
        _same(z, zp, "zero point")


@pytest.mark.parametrize("symmetric", [False, True])
def test_dynamic_looped_kernel(symmetric):
    """Rows past MAX_ONE_PASS_COLS run the two-sweep kernel; forced here at a small size."""
    x = torch.randn(3, 1000) * 2
    x[1] = x[1].abs()
    with fl.use_backend("reference"):
        y_ref, s_ref, z_ref, mask_ref = ops.fake_quantize_dynamic(x, -128, 127, 1000, symmetric)
    old = kernels.LOOP_BLOCK_N
    kernels.LOOP_BLOCK_N = 256
    try:
        y, s, z, mask = kernels.fake_quantize_dynamic_forward(x, -128, 127, 1000, symmetric, ops.EPS, looped=True)
    finally:
        kernels.LOOP_BLOCK_N = old
    _same(y, y_ref, "y")
    _same(mask, mask_ref, "packed mask")
    _same(s, s_ref.reshape(-1), "scale")
    _same(z, z_ref.reshape(-1), "zero point")


# ----------------------------------------------------------------------------- the packed mask


MASK_CASES = [  # (shape, axis, group_size): per tensor, per channel (rows / columns), per group, ragged bytes
    ((5, 13), None, 0), ((3,), None, 0), ((6, 37), 0, 0), ((7, 21), 1, 0), ((2, 3, 11), 1, 0), ((4, 48), None, 16),
]


@pytest.mark.parametrize(("shape", "axis", "group_size"), MASK_CASES)
def test_packed_mask_kernel_equals_reference_and_unpacks(shape, axis, group_size):
    """The kernel's bit-packed STE mask is the reference's byte for byte, and unpacks to the clipping mask."""
    torch.manual_seed(3)
    qshape = ops._qparam_shape(shape, axis, group_size)
    n_q = max(1, int(torch.tensor(qshape[:-1] if group_size else qshape).prod()))
    scale, zp = _random_qparams((n_q,), -8, 7)
    if group_size:
        scale, zp = scale.reshape(qshape[:-1]), zp.reshape(qshape[:-1])
    x = torch.randn(shape) * 0.6  # about half the values clip
    args = (scale, zp, -8, 7, axis, group_size, 1.0)
    with fl.use_backend("reference"):
        y_ref, mask_ref = fq.fake_quantize(x, *args)
    with fl.use_backend("triton"):
        y, mask = fq.fake_quantize(x, *args)
    _same(y, y_ref, "y")
    _same(mask, mask_ref, "packed mask")
    assert mask.shape == ops.mask_shape(shape, axis, group_size)
    keep = ops.unpack_mask(mask, shape, axis, group_size)
    q = torch.round(ops._grouped(x, group_size) * (1.0 / scale.reshape(qshape))) + zp.reshape(qshape)
    assert torch.equal(keep, ((q >= -8) & (q <= 7)).reshape(shape))
    if keep.numel() >= 32:
        assert 0 < int(keep.sum()) < keep.numel()  # both kinds of bit present


def _saved_tensors(fn, *inputs):
    """(dtype, shape) of every tensor autograd saves while ``fn(*inputs)`` runs."""
    saved = []

    def pack(t):
        saved.append((t.dtype, tuple(t.shape)))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn(*inputs)
    return saved


@pytest.mark.parametrize("backend", BACKENDS)
def test_ste_saves_only_the_packed_mask_and_lsq_saves_x(backend):
    x = torch.randn(16, 64, requires_grad=True)
    scale, zp = _random_qparams((16,), -128, 127)
    with fl.use_backend(backend):
        ste = _saved_tensors(lambda t: fl.fake_quantize(t, scale, zp, -128, 127, 0), x)
        assert ste == [(torch.uint8, (16, 8))], ste  # 64 columns, 8 bytes a row: 1/32 of x's bytes
        dyn = _saved_tensors(lambda t: fl.fake_quantize_dynamic(t, group_size=32), x)
        assert dyn == [(torch.uint8, (32, 4))], dyn
        s = scale.clone().requires_grad_()
        lsq = _saved_tensors(lambda t: fl.fake_quantize(t, s, zp, -128, 127, 0), x)
        assert (torch.float32, (16, 64)) in lsq and all(dt != torch.uint8 for dt, _ in lsq), lsq


# ----------------------------------------------------------------------------- layouts, edge cases


@pytest.mark.parametrize("backend", BACKENDS)
def test_non_contiguous_empty_and_scalar_inputs(backend):
    scale, zp = _random_qparams((6,), -128, 127)
    x = (torch.randn(6, 9) * 4).t()  # non-contiguous (9, 6), channels along dim 1
    with fl.use_backend(backend):
        _ste_pair(lambda t: fl.fake_quantize(t, scale, zp, -128, 127, 1),
                  lambda t: torch.fake_quantize_per_channel_affine(t, scale, zp, 1, -128, 127), x, "transposed")
        _ste_pair(lambda t: fl.fake_quantize(t, 0.05, 1, -8, 7),
                  lambda t: torch.fake_quantize_per_tensor_affine(t, 0.05, 1, -8, 7), x[::2], "strided")
        _ste_pair(lambda t: fl.fake_quantize(t, 0.05, 1, -8, 7),
                  lambda t: torch.fake_quantize_per_tensor_affine(t, 0.05, 1, -8, 7), torch.tensor(0.37), "0-d")
        empty = torch.randn(0, 6)
        assert fl.fake_quantize(empty, scale, zp, -128, 127, 1).shape == (0, 6)
        assert fl.fake_quantize_dynamic(torch.randn(0, 6)).shape == (0, 6)
        y, s, _ = fl.fake_quantize_dynamic(torch.randn(3, 0), return_qparams=True)
        assert y.shape == (3, 0) and s.shape == (3, 0)


def test_input_not_modified_and_autocast_leaves_dtype():
    x = torch.randn(4, 8)
    x_copy = x.clone()
    scale = torch.rand(8) * 0.1 + 0.01
    zp = torch.zeros(8, dtype=torch.int32)
    expected = fl.fake_quantize(x, scale, zp, -128, 127, 1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = fl.fake_quantize(x, scale, zp, -128, 127, 1)
        y_dyn = fl.fake_quantize_dynamic(x)
    assert y.dtype == torch.float32 and y_dyn.dtype == torch.float32
    _same(y, expected, "autocast")
    _same(x, x_copy, "input untouched")


# ----------------------------------------------------------------------------- gradcheck, opcheck, compile


def test_gradcheck_lsq_scale_where_defined():
    """Outside the range the fake-quantized value is (q_min/max - z) * scale, so LSQ's scale gradient is the
    true derivative there: gradcheck it in float64 (per tensor and per channel)."""
    x = torch.tensor([[-30.0, 40.0, -50.0], [35.0, -45.0, 60.0]], dtype=torch.float64)
    zp = torch.tensor([2, -1, 0], dtype=torch.int32)
    scale_c = torch.tensor([0.5, 0.7, 0.3], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: fl.fake_quantize(x, s, zp, -8, 7, 1), (scale_c,))
    scale_t = torch.tensor([0.4], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda s: fl.fake_quantize(x, s, zp[:1], -8, 7), (scale_t,))


def test_gradgradcheck_ste():
    """The STE backward (grad * mask) is linear in grad: double backward checks in float64, with inputs away
    from rounding boundaries (where the forward is locally constant)."""
    k = torch.randint(-12, 12, (3, 5)).double()
    x = ((k + 0.25) * 0.1).requires_grad_()
    scale = torch.full((5,), 0.1, dtype=torch.float64)
    zp = torch.zeros(5, dtype=torch.int32)
    assert torch.autograd.gradgradcheck(lambda t: fl.fake_quantize(t, scale, zp, -8, 7, 1), (x,))
    grad = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    _, mask = fq.fake_quantize(x.detach(), scale, zp, -8, 7, 1, 0, 1.0)
    assert torch.autograd.gradcheck(lambda g: fq.fake_quantize_backward(g, mask, 1, 0), (grad,))


@pytest.mark.parametrize("backend", BACKENDS)
def test_opcheck(backend):
    x = torch.randn(4, 32) * 2
    scale = (torch.rand(32) * 0.1 + 0.01)
    zp_f = torch.rand(32) * 4 - 2
    zp_i = torch.randint(-3, 3, (32,), dtype=torch.int32)
    with fl.use_backend(backend):
        opcheck(fq.fake_quantize.default, (x.requires_grad_(), scale, zp_i, -128, 127, 1, 0, 1.0))
        opcheck(fq.fake_quantize.default, (x, scale.requires_grad_(), zp_f.requires_grad_(), -8, 7, 1, 0, 0.5))
        opcheck(fq.fake_quantize.default, (x, scale[:1], zp_i[:1], -8, 7, None, 0, 1.0))
        opcheck(fq.fake_quantize.default, (x, scale[:16].reshape(4, 4), zp_i[:16].reshape(4, 4), -8, 7, None, 8, 1.0))
        grad = torch.randn(4, 32)
        _, mask = fq.fake_quantize(x.detach(), scale.detach(), zp_i, -8, 7, 1, 0, 1.0)
        opcheck(fq.fake_quantize_backward.default, (grad, mask, 1, 0))
        opcheck(fq.fake_quantize_lsq_backward.default,
                (grad, x.detach(), scale.detach(), zp_f.detach(), -8, 7, 1, 0, 0.5))
        opcheck(fq.fake_quantize_dynamic.default, (x, -128, 127, 32, False))
        opcheck(fq.fake_quantize_dynamic.default, (x.detach().half(), -8, 7, 8, True))


def test_compile_fullgraph_forward_backward():
    def f(x, scale, zp, w):
        y = fl.fake_quantize(x, scale, zp, -8, 7, 1, grad_factor=0.5)
        return (fl.fake_quantize_dynamic(y * w, group_size=8) ** 2).sum()

    compiled = torch.compile(f, fullgraph=True)
    x = torch.randn(6, 16) * 2
    scale = torch.rand(16) * 0.2 + 0.05
    zp = torch.rand(16) * 2
    w = torch.randn(16)
    outs = []
    for fn in (f, compiled):
        args = [t.clone().requires_grad_() for t in (x, scale, zp, w)]
        loss = fn(*args)
        loss.backward()
        outs.append([loss, *(a.grad for a in args)])
    for eager, comp, what in zip(outs[0], outs[1], ["loss", "dx", "dscale", "dzp", "dw"], strict=True):
        torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6, msg=what)


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize("call, error, words", [
    (lambda x: fl.fake_quantize(x.int(), 0.1, 0, -8, 7), TypeError, "input"),
    (lambda x: fl.fake_quantize(x, 0.1, 0, 7, -8), ValueError, "quant_min"),
    (lambda x: fl.fake_quantize(x, 0.1, 0, -8.0, 7), TypeError, "quant_min"),
    (lambda x: fl.fake_quantize(x, 0.1, 0, 0, 2**30), ValueError, "quant_max"),
    (lambda x: fl.fake_quantize(x, 0.0, 0, -8, 7), ValueError, "scale"),
    (lambda x: fl.fake_quantize(x, -0.1, 0, -8, 7), ValueError, "scale"),
    (lambda x: fl.fake_quantize(x, 0.1, 9, -8, 7), ValueError, "zero_point"),
    (lambda x: fl.fake_quantize(x, 0.1, 0.5, -8, 7), TypeError, "zero_point"),
    (lambda x: fl.fake_quantize(x, torch.ones(2), 0, -8, 7), ValueError, "scale"),
    (lambda x: fl.fake_quantize(x, torch.ones(8), torch.zeros(8, dtype=torch.int32), -8, 7, 0), ValueError, "scale"),
    (lambda x: fl.fake_quantize(x, torch.ones(6), torch.zeros(5, dtype=torch.int32), -8, 7, 1), ValueError,
     "zero_point"),
    (lambda x: fl.fake_quantize(x, torch.ones(6), torch.zeros(6, dtype=torch.int32), -8, 7, 2), ValueError, "axis"),
    (lambda x: fl.fake_quantize(x, torch.ones(6, dtype=torch.int32), torch.zeros(6), -8, 7, 1), TypeError, "scale"),
    (lambda x: fl.fake_quantize(x, 0.1, 0, -8, 7, group_size=4), ValueError, "group_size"),
    (lambda x: fl.fake_quantize(x, torch.ones(4, 2), torch.zeros(4, 2), -8, 7, 0, group_size=3), ValueError, "axis"),
    (lambda x: fl.fake_quantize(x, 0.1, 0, -8, 7, grad_factor="lsq"), TypeError, "grad_factor"),
    (lambda x: fl.fake_quantize_dynamic(x, group_size=4), ValueError, "group_size"),
    (lambda x: fl.fake_quantize_dynamic(x, 5, -5), ValueError, "quant_min"),
    (lambda x: fl.fake_quantize_dynamic(x.sum()), ValueError, "input"),
])
def test_errors_name_the_argument(call, error, words):
    x = torch.randn(4, 6)
    with pytest.raises(error, match=words):
        call(x)


def test_qparam_values_checked_once_per_version():
    """Tensor qparams are read once per version (a host sync on GPU): a change in place is still caught, and a
    zero point checked for one range is checked again for another."""
    from fusedlayers import functional

    x = torch.randn(4, 6)
    scale, zp = torch.rand(6) + 0.1, torch.zeros(6, dtype=torch.int32)
    fl.fake_quantize(x, scale, zp, -8, 7, 1)
    assert functional._checked_before(scale, "scale") and functional._checked_before(zp, (-8, 7))
    fl.fake_quantize(x, scale, zp, -8, 7, 1)  # no new check needed
    with torch.no_grad():
        scale[2] = -1.0  # as an optimizer step would, in place
    with pytest.raises(ValueError, match="scale"):
        fl.fake_quantize(x, scale, zp, -8, 7, 1)
    scale.abs_()
    zp[0] = -3
    fl.fake_quantize(x, scale, zp, -8, 7, 1)
    with pytest.raises(ValueError, match="zero_point"):
        fl.fake_quantize(x, scale, zp, 0, 7, 1)
    with pytest.raises(ValueError, match="scale"):
        fl.fake_quantize(x, float("nan"), 0, -8, 7)


# ----------------------------------------------------------------------------- cuda


def _mode_report(x, scale, zp, qmin, qmax, axis, expected):
    """Which rounding mode torch's CUDA kernel matches (for the failure message)."""
    counts = {}
    for mode in (ops.ROUND_AFTER, ops.ROUND_FMA, ops.ROUND_INSIDE):
        y = ops.fake_quantize_reference(x, scale, zp.float(), qmin, qmax, axis, 0, mode)
        counts[mode] = int((y != expected).sum())
    return f"mismatches per mode (0 after, 1 fma, 2 inside): {counts}"


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_bit_exact_with_torch(dtype):
    torch.manual_seed(10)
    shape = (256, 1000)
    for qmin, qmax in [(-128, 127), (0, 15)]:
        scale = float(torch.rand(1) * 0.1 + 0.01)
        zp = int(torch.randint(qmin, qmax + 1, (1,)))
        x = _values(shape, scale, zp, qmin, qmax, dtype).cuda()
        _ste_pair(lambda t: fl.fake_quantize(t, scale, zp, qmin, qmax),  # noqa: B023
                  lambda t: torch.fake_quantize_per_tensor_affine(t, scale, zp, qmin, qmax), x, "cuda per tensor")  # noqa: B023
        for axis in (0, 1):
            s, z = _random_qparams((shape[axis],), qmin, qmax)
            s, z = s.cuda(), z.cuda()
            bshape = (-1, 1) if axis == 0 else (1, -1)
            x = _values(shape, s.cpu().reshape(bshape), z.cpu().reshape(bshape), qmin, qmax, dtype).cuda()
            expected = torch.fake_quantize_per_channel_affine(x, s, z, axis, qmin, qmax)
            got = fl.fake_quantize(x, s, z, qmin, qmax, axis)
            assert torch.equal(got, expected), _mode_report(x, s, z, qmin, qmax, axis, expected)
            _ste_pair(lambda t: fl.fake_quantize(t, s, z, qmin, qmax, axis),  # noqa: B023
                      lambda t: torch.fake_quantize_per_channel_affine(t, s, z, axis, qmin, qmax), x,  # noqa: B023
                      f"cuda per channel axis {axis}")


@pytest.mark.cuda
def test_cuda_learnable_matches_torch():
    torch.manual_seed(11)
    for shape, axis, (qmin, qmax) in [((300, 517), None, (-128, 127)), ((128, 1000), 0, (-8, 7)),
                                      ((96, 700), 1, (-128, 127)), ((8, 6000), 0, (-128, 127)),
                                      ((4, 20000), 0, (-8, 7))]:
        if axis is None:
            scale, zp = torch.rand(1) * 0.1 + 0.01, torch.tensor([2.6])
            stock = lambda t, s, z: torch._fake_quantize_learnable_per_tensor_affine(t, s, z, qmin, qmax, 0.5)  # noqa: E731,B023
            bshape = (1, 1)
        else:
            scale, zp = _random_qparams((shape[axis],), qmin, qmax, integer_zp=False)
            stock = lambda t, s, z: torch._fake_quantize_learnable_per_channel_affine(  # noqa: E731
                t, s, z, axis, qmin, qmax, 0.5)  # noqa: B023
            bshape = (-1, 1) if axis == 0 else (1, -1)
        x = _values(shape, scale.reshape(bshape), torch.round(zp).clamp(qmin, qmax).reshape(bshape), qmin, qmax,
                    torch.float32).cuda()
        _check_lsq(x, scale.cuda(), zp.cuda(), qmin, qmax, axis, 0.5, stock)


@pytest.mark.cuda
def test_cuda_learnable_rounding_decisions_match_torch_per_element():
    _check_lsq_decisions("auto", "cuda")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_group_and_dynamic_kernels_equal_reference(dtype):
    torch.manual_seed(12)
    x = (torch.randn(64, 4096, device="cuda") * 2).to(dtype)
    scale, zp = _random_qparams((64, 128), -8, 7)
    scale, zp = scale.cuda(), zp.cuda()
    y = fl.fake_quantize(x, scale, zp, -8, 7, group_size=32)
    with fl.use_backend("reference"):
        y_ref = fl.fake_quantize(x, scale, zp, -8, 7, group_size=32)
    _same(y, y_ref, "cuda per group")
    for group, symmetric in [(None, False), (128, True), (4096, True)]:
        got = fl.fake_quantize_dynamic(x, -128, 127, group, symmetric, return_qparams=True)
        with fl.use_backend("reference"):
            ref = fl.fake_quantize_dynamic(x, -128, 127, group, symmetric, return_qparams=True)
        for a, b, what in zip(got, ref, ["y", "scale", "zero point"], strict=True):
            _same(a, b, f"cuda dynamic {group} {what}")
    long_rows = torch.randn(4, 40000, device="cuda", dtype=dtype)
    got = fl.fake_quantize_dynamic(long_rows)
    with fl.use_backend("reference"):
        _same(got, fl.fake_quantize_dynamic(long_rows), "cuda dynamic looped")


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", DTYPES)
def test_cuda_packed_masks_equal_reference(dtype):
    torch.manual_seed(13)
    for shape, axis, group in [((256, 1000), 0, 0), ((256, 1003), 1, 0), ((33, 4096), None, 0), ((64, 4096), None, 32)]:
        x = (torch.randn(shape, device="cuda") * 0.3).to(dtype)
        qshape = ops._qparam_shape(shape, axis, group)
        n_q = int(torch.tensor(qshape[:-1] if group else (qshape or [1])).prod())
        scale, zp = (t.cuda() for t in _random_qparams((n_q,), -8, 7))
        if group:
            scale, zp = scale.reshape(qshape[:-1]), zp.reshape(qshape[:-1])
        got = fq.fake_quantize(x, scale, zp, -8, 7, axis, group, 1.0)
        with fl.use_backend("reference"):
            ref = fq.fake_quantize(x, scale, zp, -8, 7, axis, group, 1.0)
        _same(got[1], ref[1], f"cuda packed mask {shape} axis {axis} group {group}")
        dyn = fq.fake_quantize_dynamic(x, -8, 7, shape[-1], False)
        with fl.use_backend("reference"):
            _same(dyn[3], fq.fake_quantize_dynamic(x, -8, 7, shape[-1], False)[3], f"cuda dynamic mask {shape}")


@pytest.mark.cuda
def test_cuda_compile_and_opcheck():
    x = torch.randn(64, 256, device="cuda")
    scale = (torch.rand(256, device="cuda") * 0.1 + 0.01).requires_grad_()
    zp = torch.zeros(256, device="cuda").requires_grad_()
    opcheck(fq.fake_quantize.default, (x, scale, zp, -8, 7, 1, 0, 0.5))
    opcheck(fq.fake_quantize_dynamic.default, (x, -128, 127, 256, False))
    f = lambda t, s, z: fl.fake_quantize_dynamic(fl.fake_quantize(t, s, z, -8, 7, 1), group_size=64).sum()  # noqa: E731
    t = x.clone().requires_grad_()
    loss = torch.compile(f, fullgraph=True)(t, scale, zp)
    loss.backward()
    assert torch.isfinite(t.grad).all() and torch.isfinite(scale.grad).all()
