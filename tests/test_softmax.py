"""fl.softmax and fl.scaled_masked_softmax: parity with torch, gradients, registration, compile, errors.

The reference backend runs on CPU tensors by default; `triton` runs the kernels (under the interpreter
on CPU, compiled on GPU for the `cuda`-marked tests).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch.library import opcheck

import fusedlayers as fl
from fusedlayers.kernels import softmax as kernels
from tests.parity import assert_parity

SHAPES = [(7,), (3, 17), (2, 5, 33), (2, 3, 4, 129), (1, 1000), (5, 2049)]
LOW_PRECISION = {torch.float16, torch.bfloat16}


@pytest.fixture(autouse=True)
def _fresh_launch_plans():
    """The kernels memoize their launch plans; tests here patch the constants the plans are made from."""
    kernels.forget_plans()
    yield
    kernels.forget_plans()


def _check_parity(x: torch.Tensor, fused_fn, stock_fn, reference_fn) -> torch.Tensor:
    """Output and input gradient of ``fused_fn`` vs ``stock_fn`` vs ``reference_fn`` on a float64 copy of x (a random
    upstream gradient); returns the fused input's gradient."""
    fused_in = x.detach().clone().requires_grad_()
    stock_in = x.detach().clone().requires_grad_()
    ref_in = x.detach().double().requires_grad_()
    fused, stock, ref = fused_fn(fused_in), stock_fn(stock_in), reference_fn(ref_in)
    assert_parity(fused, stock, ref, "output")
    grad = torch.randn_like(stock)
    fused.backward(grad)
    stock.backward(grad)
    ref.backward(grad.double())
    assert_parity(fused_in.grad, stock_in.grad, ref_in.grad, "grad input")
    return fused_in.grad


def _check_softmax(x: torch.Tensor, dim: int, dtype=None) -> None:
    """fl.softmax vs torch.softmax vs the float64 reference."""
    grad = _check_parity(x, lambda t: fl.softmax(t, dim, dtype=dtype), lambda t: torch.softmax(t, dim, dtype=dtype),
                         lambda t: torch.softmax(t, dim))
    assert grad.dtype == x.dtype


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", SHAPES)
def test_softmax_reference_every_dim(shape, dtype):
    x = torch.randn(shape, dtype=dtype) * 3
    for dim in range(-len(shape), len(shape)):
        _check_softmax(x, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [(3, 17), (2, 5, 33), (4, 130), (2, 3, 1025)])
def test_softmax_triton_kernel(shape, dtype):
    x = torch.randn(shape, dtype=dtype) * 3
    with fl.use_backend("triton"):
        for dim in range(len(shape)):
            _check_softmax(x, dim)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_softmax_triton_long_rows(dtype):
    """Rows past 64K: the split forward (5 or 9 parts here), the split backward (9 blocks)."""
    x = torch.randn(3, 65536 + 123, dtype=dtype) * 4
    assert kernels.kernel_for(x.shape[-1], False, x.device, x.element_size()) == "split"
    assert kernels.kernel_for(x.shape[-1], backward=True) == "split"
    with fl.use_backend("triton"):
        _check_softmax(x, -1)


def test_kernel_for_row_lengths(monkeypatch):
    assert kernels.kernel_for(kernels.MAX_ONE_PASS_COLS, backward=True) == "one_pass"
    assert kernels.kernel_for(kernels.MAX_ONE_PASS_COLS + 1, backward=True) == "split"
    assert kernels.kernel_for(kernels.SPLIT_BLOCK_N * kernels.MAX_SPLIT, backward=True) == "split"
    assert kernels.kernel_for(kernels.SPLIT_BLOCK_N * kernels.MAX_SPLIT + 1, backward=True) == "looped"
    # forward: looped up to SPLIT_FORWARD_FROM, split up to MAX_SPLIT parts (of the dtype's size), looped beyond
    assert kernels.kernel_for(kernels.MAX_ONE_PASS_FORWARD_COLS, backward=False) == "one_pass"
    assert kernels.kernel_for(kernels.MAX_ONE_PASS_FORWARD_COLS + 1, backward=False) == "looped"
    assert kernels.kernel_for(kernels.SPLIT_FORWARD_FROM - 1, backward=False) == "looped"
    assert kernels.kernel_for(kernels.SPLIT_FORWARD_FROM, backward=False) == "split"
    longest = kernels.SPLIT_FORWARD_PART * kernels.MAX_SPLIT
    assert kernels.kernel_for(longest, False, element_size=2) == "split"
    assert kernels.kernel_for(longest + 1, False, element_size=2) == "looped"
    assert kernels.kernel_for(longest // 2 + 1, False, element_size=4) == "looped"
    assert kernels.kernel_for(kernels.SPLIT_FORWARD_FROM, False, plain=False) == "looped"  # masked / scaled rows
    # past 16K: split on the GPUs listed in SPLIT_FORWARD_FROM_ON, looped elsewhere (and for rows that are not plain)
    cuda = torch.device("cuda")
    for name, long_rows in (("NVIDIA H200", "split"), ("NVIDIA H100 80GB HBM3", "looped"), ("", "looped")):
        monkeypatch.setattr(kernels, "_device_name", lambda device, name=name: name)
        assert kernels.kernel_for(16384, False, cuda) == "one_pass", name
        for n_cols in (16385, 32768, 65536):
            assert kernels.kernel_for(n_cols, False, cuda) == long_rows, (name, n_cols)
            assert kernels.kernel_for(n_cols, False, cuda, plain=False) == "looped", (name, n_cols)


def test_split_counters_bookkeeping():
    """What SplitCounters hands out is zero wherever a launch of that many rows reads, if each launch zeroes the
    other buffer's first n_rows + 1 entries (as the kernels do) and dirties its own."""
    counters = kernels.SplitCounters(torch.device("cpu"))
    for n_rows in (3, 3, 10, 2, 2, 50, 49, 1, 80, 7, 7, 7):
        mine, other = counters.take(n_rows)
        assert mine.data_ptr() != other.data_ptr() and min(mine.numel(), other.numel()) >= n_rows + 1
        assert (mine[: n_rows + 1] == 0).all(), n_rows
        mine[: n_rows + 1] = 1 + torch.arange(n_rows + 1, dtype=torch.int32)  # arrivals and the ticket
        other[: n_rows + 1] = 0


def test_one_pass_config_per_gpu(monkeypatch):
    """Rows per one-pass program: ~2K elements (the backward everywhere, the forward on an H200 or unknown GPU),
    ~1K for the forward on an H100; long rows one per program, with more warps."""
    cuda = torch.device("cuda")
    for name, rows_1024 in (("NVIDIA H100 80GB HBM3", 1), ("NVIDIA H200", 2), ("", 2)):
        monkeypatch.setattr(kernels, "_device_name", lambda device, name=name: name)
        assert kernels._one_pass_config(1024, device=cuda) == (rows_1024, 1024, 4), name
        assert kernels._one_pass_config(1000, device=cuda) == (rows_1024, 1024, 4), name
        assert kernels._one_pass_config(1024, backward=True, device=cuda) == (2, 1024, 4), name
        assert kernels._one_pass_config(16384, device=cuda) == (1, 16384, 32), name
        assert kernels._one_pass_config(16384, backward=True, device=cuda) == (1, 16384, 16), name
    assert kernels._one_pass_config(100) == (16, 128, 4)


def test_row_kernel_plans():
    """Rows of one program each run the 1-D row kernels (the forward's for plain rows only); the widening by bits and
    the recomputed exp only for bf16."""
    cpu, bf16 = torch.device("cpu"), torch.bfloat16
    plain = kernels._forward_plan(4096, bf16, cpu, None, False, False, False, False, True)
    masked = kernels._forward_plan(4096, bf16, cpu, None, True, True, False, True, False)
    short = kernels._forward_plan(1024, bf16, cpu, None, False, False, False, False, True)
    assert plain.kernel is kernels._softmax_fwd_row_kernel
    assert masked.kernel is short.kernel is kernels._softmax_fwd_kernel and short.rows_per_program == 2
    assert kernels._forward_plan(8192, bf16, cpu, None, False, False, False, False, True).meta["RECOMPUTE"]
    assert not kernels._forward_plan(8192, torch.float16, cpu, None, False, False, False, False, True).meta["RECOMPUTE"]
    for dtype, grad_dtype, bits in ((bf16, bf16, True), (torch.float16, torch.float16, False),
                                    (torch.float32, torch.float32, False), (bf16, torch.float32, False)):
        plan = kernels._backward_plan(16384, dtype, grad_dtype, cpu, None, False)
        assert plan.kernel is kernels._softmax_bwd_row_kernel and plan.meta["WIDEN_BITS"] == bits, dtype
    assert kernels._backward_plan(1024, bf16, bf16, cpu, None, False).kernel is kernels._softmax_bwd_kernel


def test_row_kernel_configs_per_gpu(monkeypatch):
    """The row kernels' settings follow the GPU (ROW_FORWARD / ROW_BACKWARD; unknown GPUs take the H200's), the
    flags only for bf16, short and unlisted rows the defaults."""
    cuda, bf16, fp16 = torch.device("cuda"), torch.bfloat16, torch.float16
    for name, bwd_16k_bf16, fwd_16k_bf16 in (("NVIDIA H100 80GB HBM3", (16, False), (16, False)),
                                             ("NVIDIA H200", (16, True), (4, False)), ("", (16, True), (4, False))):
        monkeypatch.setattr(kernels, "_device_name", lambda device, name=name: name)
        assert kernels._row_backward_config(16384, bf16, cuda) == bwd_16k_bf16, name
        assert kernels._row_forward_config(16384, bf16, cuda) == fwd_16k_bf16, name
        assert kernels._row_forward_config(1024, bf16, cuda) == (4, False), name
        assert kernels._row_forward_config(65536, bf16, cuda) == (32, False), name
        for block_n in (2048, 4096, 8192, 16384, 32768):
            for dtype in (fp16, torch.float32, None):
                assert not kernels._row_backward_config(block_n, dtype, cuda)[1], (name, block_n, dtype)
            assert not kernels._row_forward_config(block_n, fp16, cuda)[1], (name, block_n)


@pytest.mark.parametrize("n_cols", [2000, 3000, 5000, 16000])
def test_softmax_row_kernels_bf16(monkeypatch, n_cols):
    """bf16 rows through the row kernels, whose widening by bits and recomputed exp are exact rewrites: the same
    bits with them on as off, and parity with torch (the interpreter's bf16 is wrong in dot products only)."""
    x = torch.randn(3, n_cols, dtype=torch.bfloat16) * 4
    grad = torch.randn_like(x)

    def run():
        kernels.forget_plans()
        with fl.use_backend("triton"):
            t = x.clone().requires_grad_()
            y = fl.softmax(t, -1)
            (dx,) = torch.autograd.grad(y, t, grad)
        return y, dx

    with fl.use_backend("triton"):
        _check_softmax(x, -1)
    y, dx = run()
    forward, backward = kernels._row_forward_config, kernels._row_backward_config
    monkeypatch.setattr(kernels, "_row_forward_config", lambda *args: (forward(*args)[0], False))
    monkeypatch.setattr(kernels, "_row_backward_config", lambda *args: (backward(*args)[0], False))
    y_plain, dx_plain = run()
    assert torch.equal(y, y_plain) and torch.equal(dx, dx_plain)


def small_blocks(monkeypatch, block_n: int) -> None:
    """Split and looped kernels with tiny blocks, so small rows take several blocks or loop trips; persistent
    grids too."""
    monkeypatch.setattr(kernels, "SPLIT_BLOCK_N", block_n)
    monkeypatch.setattr(kernels, "SPLIT_FORWARD_PART", block_n)
    monkeypatch.setattr(kernels, "LOOP_FORWARD", kernels.LOOP_FORWARD._replace(block_n=block_n, programs_per_sm=0))
    monkeypatch.setattr(kernels, "LOOP_BACKWARD", kernels.LOOP_BACKWARD._replace(block_n=block_n, programs_per_sm=1))


def long_rows(monkeypatch, kernel: str, block_n: int) -> None:
    """Make rows over ``block_n`` columns run ``kernel`` ("split" or "looped") in blocks of ``block_n``."""
    small_blocks(monkeypatch, block_n)
    monkeypatch.setattr(kernels, "MAX_ONE_PASS_COLS", block_n)
    monkeypatch.setattr(kernels, "MAX_ONE_PASS_FORWARD_COLS", block_n)
    monkeypatch.setattr(kernels, "MAX_SPLIT", 10**6 if kernel == "split" else 0)
    monkeypatch.setattr(kernels, "SPLIT_FORWARD_FROM", block_n + 1)
    monkeypatch.setattr(kernels, "SPLIT_FORWARD_FROM_ON", {})


@pytest.mark.parametrize("kernel", ["one_pass", "split", "looped"])
def test_softmax_kernels_direct(monkeypatch, kernel):
    """Every kernel shape on odd sizes; several blocks or loop trips for split and looped (small blocks).
    """
    small_blocks(monkeypatch, 16)
    for n in (1, 5, 16, 47, 100):
        x = torch.randn(7, n) * 5
        y = kernels.softmax_forward(x, torch.float32, kernel=kernel)
        torch.testing.assert_close(y, torch.softmax(x, -1), atol=1e-6, rtol=1e-5)
        g = torch.randn(7, n)
        dx = kernels.softmax_backward(g, y, 0.5, torch.float32, kernel=kernel)
        torch.testing.assert_close(dx, 0.5 * y * (g - (g * y).sum(-1, keepdim=True)), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_softmax_non_contiguous(backend):
    base = torch.randn(6, 40, 9)
    views = [base.transpose(0, 1), base[:, ::3], base[..., 1:8], base.permute(2, 0, 1)]
    with fl.use_backend(backend):
        for x in views:
            assert not x.is_contiguous()
            for dim in range(3):
                _check_softmax(x, dim)


def _layouts() -> dict[str, torch.Tensor]:
    """Inputs of every layout: contiguous, transposed, permuted, sliced, narrowed, expanded (stride 0), channels-last,
    size-1 dims with odd strides, strided 1-d, 0-d."""
    base = torch.randn(6, 10, 9) * 3
    return {
        "contiguous": base,
        "transposed": base.transpose(0, 2),
        "last two transposed": base.transpose(1, 2),
        "permuted": base.permute(1, 2, 0),
        "sliced": base[:, ::3],
        "narrowed": base[..., 1:8],
        "expanded": (torch.randn(1, 10, 9) * 3).expand(6, 10, 9),
        "channels last": (torch.randn(2, 3, 4, 5) * 3).to(memory_format=torch.channels_last),
        "size-1 dims": (torch.randn(4, 1, 7) * 3).transpose(0, 1)[:, :, None],
        "strided 1-d": (torch.randn(20) * 3)[::3],
        "0-d": torch.tensor(1.5),
    }


def _softmax_and_grads(fn, x: torch.Tensor, dim: int, grad: torch.Tensor):
    """(output, torch.autograd.grad's input gradient, the leaf's .grad) of ``fn(x, dim)``."""
    leaf = x.detach().clone(memory_format=torch.preserve_format).requires_grad_()
    if x.stride() != leaf.stride():  # clone makes expanded / overlapping inputs dense: view the same layout instead
        leaf = x.detach().requires_grad_()
    y = fn(leaf, dim)
    (g,) = torch.autograd.grad(y, leaf, grad, retain_graph=True)
    y.backward(grad)
    return y, g, leaf.grad


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("layout", list(_layouts()))
def test_softmax_output_and_gradient_layouts_every_dim(backend, layout):
    """For every dim: torch's values and torch's strides, for the output (always contiguous: torch's _softmax allocates
    LEGACY_CONTIGUOUS_MEMORY_FORMAT, whatever the input's layout and dim), the gradient that autograd.grad returns
    (contiguous too), and the leaf's .grad (where autograd lays it out like the input when that is dense), with an
    upstream gradient of its own layout (transposed)."""
    x = _layouts()[layout]
    with fl.use_backend(backend):
        for dim in range(-max(x.dim(), 1), max(x.dim(), 1)):
            grad = torch.randn(tuple(reversed(x.shape))).permute(*reversed(range(x.dim()))) if x.dim() else \
                torch.randn(())
            fused = _softmax_and_grads(fl.softmax, x, dim, grad)
            stock = _softmax_and_grads(torch.softmax, x, dim, grad)
            for name, f, t in zip(("output", "autograd.grad", ".grad"), fused, stock, strict=True):
                torch.testing.assert_close(f, t, atol=1e-6, rtol=1e-5,
                                           msg=lambda m, n=name, d=dim: f"{n}, dim {d}: {m}")
                assert f.stride() == t.stride(), (name, dim, f.stride(), t.stride())
            assert fused[0].is_contiguous() and fused[1].is_contiguous()
            fused[0].view(-1)  # a view of the flat output exists: no transposed result


def test_softmax_other_dims_are_not_copied(monkeypatch):
    """A dim other than the last is reduced in place by the strided kernels, forward and backward: what they read are
    (outer, dim, inner) views of the input, the output and the gradient, never copies, for contiguous inputs (every
    dim) and for any input whose dims after ``dim`` merge (here a transposed one, over its middle dim)."""
    views = []
    real = kernels._as_3d
    monkeypatch.setattr(kernels, "_as_3d", lambda t, dim: views.append((real(t, dim), t)) or views[-1][0])
    x = torch.randn(4, 30, 6)
    with fl.use_backend("triton"):
        for t, dim in ((x, 0), (x, 1), (x.transpose(0, 2), 1), (torch.randn(1, 30, 6).expand(4, 30, 6), 1)):
            leaf = t.detach().requires_grad_()
            fl.softmax(leaf, dim).backward(torch.randn(t.shape))
    assert len(views) == 4 * 5  # the forward's input and output, the backward's gradient, output and result
    for view, t in views:
        assert view.data_ptr() == t.data_ptr() and view._base is not None, (t.shape, t.stride())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kernel", ["one_pass", "looped"])
def test_softmax_strided_kernels(monkeypatch, kernel, dtype):
    """The strided kernels (a dim other than the last) forced into each shape; looped over several column blocks
    (small tiles), on odd sizes, contiguous and strided inputs, outputs of another dtype, special values."""
    monkeypatch.setattr(kernels, "STRIDED_TILE", 64)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-3, rtol=1e-3)
    for shape in ((3, 37, 5), (2, 100, 33), (37, 3), (1, 5, 1, 7)):
        base = (torch.randn(shape) * 4).to(dtype)
        for x in (base, base.transpose(0, -1), base[..., ::2]):
            for dim in range(x.dim() - 1):
                for out_dtype in (dtype, torch.float32):
                    y = kernels.softmax_forward(x, out_dtype, kernel=kernel, dim=dim)
                    assert y.is_contiguous() and y.dtype == out_dtype
                    torch.testing.assert_close(y, torch.softmax(x.float(), dim).to(out_dtype), **tol)
                g = torch.randn(x.shape).to(dtype)
                y = torch.softmax(x.float(), dim)
                dx = kernels.softmax_backward(g, y, 0.5, dtype, kernel=kernel, dim=dim)
                expect = 0.5 * y * (g.float() - (g.float() * y).sum(dim, keepdim=True))
                assert dx.is_contiguous() and dx.dtype == dtype
                torch.testing.assert_close(dx, expect.to(dtype), **tol)
    inf, nan = float("inf"), float("nan")
    special = torch.tensor([[0.0, -inf, 1.0], [-inf] * 3, [1.0, nan, 2.0], [inf, 1.0, 2.0]]).T.contiguous()
    torch.testing.assert_close(kernels.softmax_forward(special, torch.float32, kernel=kernel, dim=0),
                               torch.softmax(special, 0), equal_nan=True)


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_softmax_with_dtype_of_any_input(backend):
    """torch.softmax(x, dim, dtype=...) casts x first, so integer, bool and complex x work with a floating dtype
    (complex loses its imaginary part, with torch's warning; its gradient is complex); without a floating dtype torch
    refuses them and so do we (a TypeError naming the argument), and a non-floating dtype."""
    inputs = [torch.randint(-5, 5, (4, 6)), torch.rand(4, 6) > 0.5, torch.randint(0, 9, (4, 6), dtype=torch.uint8),
              torch.randn(4, 6, dtype=torch.complex64), torch.randn(4, 6, dtype=torch.float64)]
    with fl.use_backend(backend):
        for x in inputs:
            for out_dtype in (torch.float32, torch.float16, torch.float64):
                for dim in (0, 1):
                    with warnings.catch_warnings():
                        warnings.simplefilter("ignore")  # complex -> real
                        expected = torch.softmax(x, dim, dtype=out_dtype)
                        got = fl.softmax(x, dim, dtype=out_dtype)
                    assert got.dtype == expected.dtype and got.stride() == expected.stride()
                    torch.testing.assert_close(got, expected)
            if not x.is_floating_point() and not x.is_complex():
                with pytest.raises(TypeError, match="input"):
                    fl.softmax(x, 0)
        z = torch.randn(3, 5, dtype=torch.complex128, requires_grad=True)
        g = torch.randn(3, 5, dtype=torch.float64)
        with warnings.catch_warnings():  # torch warns once per process that the cast discards the imaginary part
            warnings.simplefilter("ignore")
            (dz,) = torch.autograd.grad(fl.softmax(z, 0, dtype=torch.float64), z, g)
            (expected,) = torch.autograd.grad(torch.softmax(z, 0, dtype=torch.float64), z, g)
        assert dz.dtype == torch.complex128
        torch.testing.assert_close(dz, expected)
        with pytest.raises(TypeError, match="input"):
            fl.softmax(torch.randn(3, dtype=torch.complex64), 0)
        with pytest.raises(TypeError, match="dtype"):
            fl.softmax(torch.randn(3), 0, dtype=torch.complex64)


def test_softmax_fake_and_compiled_strides_match_eager():
    """The fake impls give the real outputs' strides (contiguous) for every dim and layout, and torch.compile's
    outputs and gradients have eager's values and strides."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    torch._dynamo.reset()
    for x in (torch.randn(3, 5, 7), torch.randn(7, 5, 3).transpose(0, 2)):
        for dim in range(3):
            real = fl.softmax(x, dim)
            with FakeTensorMode() as mode:
                fake = fl.softmax(mode.from_tensor(x), dim)
            assert fake.stride() == real.stride() == torch.softmax(x, dim).stride()

            def f(t, d=dim):
                return fl.softmax(t, d) * 2

            leaf = x.detach().requires_grad_()
            out = torch.compile(f, fullgraph=True)(leaf)
            (grad,) = torch.autograd.grad(out, leaf, torch.ones_like(out))
            eager_leaf = x.detach().requires_grad_()
            eager = f(eager_leaf)
            (eager_grad,) = torch.autograd.grad(eager, eager_leaf, torch.ones_like(eager))
            torch.testing.assert_close(out, eager)
            torch.testing.assert_close(grad, eager_grad)
            assert out.stride() == eager.stride() and grad.stride() == eager_grad.stride(), dim


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_softmax_empty_and_scalar(backend):
    with fl.use_backend(backend):
        for shape, dim in [((0, 5), 1), ((4, 0), 1), ((4, 0), 0), ((2, 0, 3), 2)]:
            x = torch.randn(shape, requires_grad=True)
            y = fl.softmax(x, dim)
            assert y.shape == x.shape
            y.sum().backward()
            assert x.grad.shape == x.shape
        s = torch.tensor(3.0)
        assert fl.softmax(s, 0).item() == torch.softmax(s, 0).item() == 1.0


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_softmax_dtype_argument(backend):
    with fl.use_backend(backend):
        for in_dtype, out_dtype in [(torch.float16, torch.float32), (torch.float32, torch.float16),
                                    (torch.float16, torch.float16), (torch.float32, torch.float64)]:
            x = torch.randn(4, 37, dtype=in_dtype)
            y = fl.softmax(x, -1, dtype=out_dtype)
            assert y.dtype == out_dtype
            _check_softmax(x, -1, dtype=out_dtype)
        ints = torch.randint(-5, 5, (3, 8))
        expected = torch.softmax(ints, 1, dtype=torch.float32)
        torch.testing.assert_close(fl.softmax(ints, 1, dtype=torch.float32), expected)


def test_softmax_matches_torch_on_special_values():
    x = torch.tensor([[0.0, float("-inf"), 1.0], [float("-inf")] * 3, [1.0, float("nan"), 2.0]])
    for backend in ("reference", "triton"):
        with fl.use_backend(backend):
            torch.testing.assert_close(fl.softmax(x), torch.softmax(x, -1), equal_nan=True)


def test_softmax_leaves_input_unchanged():
    x = torch.randn(4, 50, requires_grad=True)
    before = x.detach().clone()
    for backend in ("reference", "triton"):
        with fl.use_backend(backend):
            fl.softmax(x).sum().backward()
    assert torch.equal(x.detach(), before)


def test_softmax_saves_output_not_input():
    """Autograd holds the output (shared with the caller's tensor), not the input."""
    x = torch.randn(4, 9, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = fl.softmax(x)
    assert len(saved) == 1 and saved[0].data_ptr() == y.data_ptr()


# ----------------------------------------------------------------------------- scaled masked softmax


def _stock_masked(scores, scale, mask, is_causal):
    """What users write in torch: scale, mask, softmax (in scores' dtype)."""
    z = scores * scale
    if is_causal:
        keep = torch.ones(z.shape[-2], z.shape[-1], dtype=torch.bool, device=z.device).tril()
        z = z.masked_fill(~keep, float("-inf"))
    if mask is not None:
        z = z.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else z + mask
    return z.softmax(-1)


def _check_masked(scores, scale, mask, is_causal):
    """fl.scaled_masked_softmax vs the same in torch ops vs those in float64."""
    ref_mask = mask.double() if mask is not None and mask.is_floating_point() else mask
    _check_parity(scores, lambda t: fl.scaled_masked_softmax(t, scale, mask, is_causal),
                  lambda t: _stock_masked(t, scale, mask, is_causal),
                  lambda t: _stock_masked(t, scale, ref_mask, is_causal))


def _keep_diagonal(mask: torch.Tensor) -> torch.Tensor:
    """A bool mask with every row keeping at least one key (so stock torch gives no NaN)."""
    return mask | torch.eye(mask.shape[-2], mask.shape[-1], dtype=torch.bool, device=mask.device)


MASK_CASES = [  # (scores shape, mask shape or None)
    ((2, 3, 5, 7), None),
    ((2, 3, 9, 9), (9, 9)),
    ((2, 3, 6, 11), (2, 1, 6, 11)),
    ((2, 3, 6, 11), (1, 3, 1, 11)),
    ((4, 10, 33), (10, 33)),
    ((10, 130), (10, 130)),
    ((2, 2, 3, 5, 17), (2, 1, 5, 17)),
]


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", MASK_CASES)
def test_scaled_masked_softmax(backend, dtype, case):
    if backend == "triton" and dtype == torch.bfloat16:
        pytest.skip("the interpreter is exercised in fp32/fp16; bf16 kernels run in the cuda tests")
    shape, mask_shape = case
    scores = torch.randn(shape, dtype=dtype) * 2
    with fl.use_backend(backend):
        for is_causal in (False, True):
            if mask_shape is None:
                _check_masked(scores, 0.37, None, is_causal)
                continue
            bool_mask = _keep_diagonal(torch.rand(mask_shape) > 0.4)
            float_mask = torch.randn(mask_shape, dtype=dtype)
            _check_masked(scores, 0.37, bool_mask, is_causal)
            _check_masked(scores, -1.5, float_mask, is_causal)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kernel", ["split", "looped"])
def test_scaled_masked_softmax_long_rows(backend, kernel, monkeypatch):
    """Masks and causal over several blocks: causal rows whose later blocks are all masked included."""
    long_rows(monkeypatch, kernel, 32)
    # 4 blocks per row; one head (the interpreter runs a program per row and block: rows are what costs here)
    scores = torch.randn(2, 1, 40, 100)
    mask = _keep_diagonal(torch.rand(40, 100) > 0.5)
    with fl.use_backend(backend):
        _check_masked(scores, 0.5, mask, True)
        _check_masked(scores, 0.5, torch.randn(1, 1, 40, 100), False)  # broadcast over the batch


def test_split_forward_general_path(monkeypatch):
    """The split forward on masked, causal and scaled rows, forced (by itself the launcher sends them to the looped
    kernel, whose general path measured faster), and on strided rows."""
    monkeypatch.setattr(kernels, "SPLIT_FORWARD_PART", 64)  # 32 fp32 columns: 4 parts of 100
    scores = torch.randn(2, 1, 40, 100)  # one head: the interpreter's time goes by rows
    bool_mask = _keep_diagonal(torch.rand(40, 100) > 0.5)
    float_mask = torch.randn(1, 1, 40, 100)  # broadcast over the batch
    for scale, mask, causal in ((0.5, bool_mask, True), (-1.5, float_mask, False), (0.25, None, False)):
        expanded = mask.expand_as(scores) if mask is not None else None
        y = kernels.softmax_forward(scores, scores.dtype, scale, expanded, causal, True, kernel="split")
        ref = _stock_masked(scores.double(), scale, mask.double() if mask is not None and mask.is_floating_point()
                            else mask, causal)
        torch.testing.assert_close(y, ref.float(), atol=1e-6, rtol=1e-5)
    strided = torch.randn(100, 30).T  # rows of 100 with column stride 30
    torch.testing.assert_close(kernels.softmax_forward(strided, strided.dtype, kernel="split"),
                               torch.softmax(strided, -1), atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("kernel", ["one_pass", "split", "looped"])
def test_fully_masked_rows_give_zeros(backend, kernel, monkeypatch):
    if kernel != "one_pass":
        long_rows(monkeypatch, kernel, 32)
    scores = torch.randn(2, 6, 20, requires_grad=True)
    mask = torch.rand(6, 20) > 0.5
    mask[1] = False  # row 1 masks every key
    float_mask = torch.zeros(6, 20)
    float_mask[3] = float("-inf")
    with fl.use_backend(backend):
        for m in (mask, float_mask):
            scores.grad = None
            y = fl.scaled_masked_softmax(scores, 1.0, m)
            dead = 1 if m.dtype == torch.bool else 3
            assert not y.isnan().any()
            assert torch.equal(y[:, dead], torch.zeros_like(y[:, dead]))
            live = [r for r in range(6) if r != dead]
            torch.testing.assert_close(y[:, live].sum(-1), torch.ones(2, 5))
            y.backward(torch.randn_like(y))
            assert not scores.grad.isnan().any()
            assert torch.equal(scores.grad[:, dead], torch.zeros_like(scores.grad[:, dead]))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_scaled_masked_softmax_float_mask_gradient(backend):
    scores = torch.randn(2, 3, 5, 8, dtype=torch.float64 if backend == "reference" else torch.float32)
    mask = torch.randn(3, 1, 8, dtype=scores.dtype, requires_grad=True)
    ref_mask = mask.detach().double().requires_grad_()
    with fl.use_backend(backend):
        y = fl.scaled_masked_softmax(scores, 0.7, mask, True)
    ref = _stock_masked(scores.double(), 0.7, ref_mask, True)
    g = torch.randn_like(ref)
    y.backward(g.to(y.dtype))
    ref.backward(g)
    torch.testing.assert_close(mask.grad.double(), ref_mask.grad, atol=1e-5, rtol=1e-5)


def test_scaled_masked_softmax_scale_zero_and_non_contiguous():
    scores = torch.randn(3, 8, 5).transpose(1, 2)
    with fl.use_backend("triton"):
        y = fl.scaled_masked_softmax(scores, 0.0, is_causal=True)
    expected = _stock_masked(scores, 0.0, None, True)
    torch.testing.assert_close(y, expected)


# ----------------------------------------------------------------------------- autograd machinery


def test_gradcheck_and_gradgradcheck():
    x = torch.randn(3, 4, 6, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(4, 6) > 0.3
    fmask = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    for dim in (0, 1, 2):
        f = lambda t, d=dim: fl.softmax(t, d)  # noqa: E731
        assert torch.autograd.gradcheck(f, (x,))
        assert torch.autograd.gradgradcheck(f, (x,))
    g = lambda t, m: fl.scaled_masked_softmax(t, 0.8, m, True)  # noqa: E731
    assert torch.autograd.gradcheck(lambda t: g(t, mask), (x,))
    assert torch.autograd.gradgradcheck(lambda t: g(t, mask), (x,))
    assert torch.autograd.gradcheck(g, (x, fmask))
    assert torch.autograd.gradgradcheck(g, (x, fmask))


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_opcheck(backend):
    ops = torch.ops.fusedlayers
    x = torch.randn(3, 5, 17, requires_grad=True)
    y = torch.softmax(x.detach(), -1)
    mask = torch.rand(5, 17) > 0.3
    samples = [
        (ops.softmax.default, (x, -1, None)),
        (ops.softmax.default, (x, 0, None)),
        (ops.softmax.default, (x.transpose(0, 2), 1, None)),
        (ops.softmax.default, (x.detach().half().requires_grad_(), 1, torch.float32)),
        (ops.scaled_masked_softmax.default, (x, 0.5, mask, True)),
        (ops.scaled_masked_softmax.default, (x, 0.5, torch.randn(3, 1, 17, requires_grad=True), False)),
        (ops.scaled_masked_softmax.default, (x, 1.0, None, False)),
        (ops.softmax_backward.default, (torch.randn(3, 5, 17, requires_grad=True), y.requires_grad_(), -1, 0.5,
                                        torch.float32)),
        (ops.softmax_backward.default, (torch.randn(3, 5, 17, requires_grad=True), torch.softmax(x.detach(), 1),
                                        1, 0.5, torch.float32)),
    ]
    with fl.use_backend(backend):
        for op, args in samples:
            opcheck(op, args)


def test_compile_fullgraph_forward_backward():
    torch._dynamo.reset()

    def f(x, mask):
        return (fl.softmax(x, 1) * fl.scaled_masked_softmax(x, 0.5, mask, is_causal=True)).sum()

    compiled = torch.compile(f, fullgraph=True)
    x = torch.randn(2, 8, 8, requires_grad=True)
    mask = torch.rand(8, 8) > 0.2
    loss = compiled(x, mask)
    (grad,) = torch.autograd.grad(loss, x)
    x2 = x.detach().clone().requires_grad_()
    loss2 = f(x2, mask)
    (grad2,) = torch.autograd.grad(loss2, x2)
    torch.testing.assert_close(loss, loss2)
    torch.testing.assert_close(grad, grad2)


def test_inductor_code_calls_our_ops():
    """The compiled view: Inductor keeps our ops as opaque extern calls (custom_op), forward and backward."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()

    def f(x):
        return fl.softmax(x * 2.0, -1).sum()

    x = torch.randn(4, 16, requires_grad=True)
    _, codes = run_and_get_code(lambda: torch.autograd.grad(torch.compile(f, fullgraph=True)(x), x))
    code = "\n".join(codes)
    assert "torch.ops.fusedlayers.softmax.default(" in code
    assert "torch.ops.fusedlayers.softmax_backward.default(" in code


def test_autocast_cpu_bf16():
    a = torch.randn(4, 16)
    b = torch.randn(16, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        scores = a @ b
        fused = fl.softmax(scores)
        stock = torch.softmax(scores, -1)
        masked = fl.scaled_masked_softmax(scores, 0.5, is_causal=True)
    assert fused.dtype == stock.dtype == masked.dtype == torch.bfloat16
    torch.testing.assert_close(fused, stock)


# ----------------------------------------------------------------------------- errors and the module


@pytest.mark.parametrize(
    "call, error, name",
    [
        (lambda: fl.softmax(torch.randn(2, 3), dim=2), ValueError, "dim"),
        (lambda: fl.softmax(torch.randn(2, 3), dim=-3), ValueError, "dim"),
        (lambda: fl.softmax(torch.randn(2, 3), dim=1.0), TypeError, "dim"),
        (lambda: fl.softmax(torch.arange(6).reshape(2, 3)), TypeError, "input"),
        (lambda: fl.softmax(torch.randn(2, 3), dtype=torch.int32), TypeError, "dtype"),
        (lambda: fl.softmax([1.0, 2.0]), TypeError, "input"),
        (lambda: fl.scaled_masked_softmax(torch.arange(6).reshape(2, 3)), TypeError, "scores"),
        (lambda: fl.scaled_masked_softmax(torch.randn(2, 3), attn_mask=torch.ones(4, 3, dtype=torch.bool)),
         ValueError, "attn_mask"),
        (lambda: fl.scaled_masked_softmax(torch.randn(2, 3), attn_mask=torch.ones(2, 2, 3, dtype=torch.bool)),
         ValueError, "attn_mask"),
        (lambda: fl.scaled_masked_softmax(torch.randn(2, 3), attn_mask=torch.ones(2, 3, dtype=torch.int64)),
         TypeError, "attn_mask"),
        (lambda: fl.scaled_masked_softmax(torch.randn(2, 3), scale=torch.tensor(1.0)), TypeError, "scale"),
        (lambda: fl.scaled_masked_softmax(torch.randn(3), is_causal=True), ValueError, "is_causal"),
    ],
)
def test_bad_input_names_the_argument(call, error, name):
    with pytest.raises(error, match=name):
        call()


def test_softmax_module_is_a_drop_in():
    x = torch.randn(3, 4, 5)
    for dim in (0, 1, 2, -1):
        fused, stock = fl.Softmax(dim), torch.nn.Softmax(dim)
        torch.testing.assert_close(fused(x), stock(x))
        assert fused.state_dict().keys() == stock.state_dict().keys()
        assert repr(fused).endswith(f"(dim={dim})")
    with pytest.warns(UserWarning, match="Implicit dimension"):
        implicit = fl.Softmax()(x)
    with pytest.warns(UserWarning):
        torch.testing.assert_close(implicit, torch.nn.Softmax()(x))


# ----------------------------------------------------------------------------- GPU (the `cuda` tests)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("n_cols", [1, 77, 1024, 2000, 4099, 16384, 16385, 32768, 65536, 100003])
def test_cuda_softmax(dtype, n_cols):
    x = torch.randn(37, n_cols, device="cuda", dtype=dtype) * 4
    _check_softmax(x, -1)
    _check_softmax(x[:, : max(1, n_cols // 2)], -1)  # strided rows
    if n_cols <= 4099:
        _check_softmax(x, 0)  # transposed access


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape, dim", [((37, 4099), 0), ((8, 1000, 64), 1), ((4, 20000, 33), 1), ((3, 5, 7, 2), 2),
                                        ((2, 12, 1024, 1024), 2), ((4096, 3, 2), 0)])
def test_cuda_softmax_other_dims(dtype, shape, dim):
    """The strided kernels (a dim other than the last, one tile and looped), contiguous and transposed input: parity,
    and torch's (contiguous) strides for the output and the gradient."""
    x = torch.randn(shape, device="cuda", dtype=dtype) * 4
    for t in (x, x.transpose(0, -1).contiguous().transpose(0, -1)):
        _check_softmax(t, dim)
        leaf = t.detach().requires_grad_()
        y = fl.softmax(leaf, dim)
        (g,) = torch.autograd.grad(y, leaf, torch.randn_like(y))
        assert y.stride() == torch.softmax(t, dim).stride() and y.is_contiguous() and g.is_contiguous()


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("case", MASK_CASES + [((2, 4, 300, 20000), (300, 20000))])
def test_cuda_scaled_masked_softmax(dtype, case):
    shape, mask_shape = case
    scores = torch.randn(shape, dtype=dtype, device="cuda") * 2
    for is_causal in (False, True):
        mask = None
        if mask_shape is not None:
            mask = _keep_diagonal(torch.rand(mask_shape) > 0.4).cuda()
        _check_masked(scores, 0.125, mask, is_causal)
        if mask_shape is not None:
            _check_masked(scores, 0.125, torch.randn(mask_shape, dtype=dtype, device="cuda"), is_causal)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["split", "looped"])
def test_cuda_long_row_kernels(kernel, monkeypatch):
    """Each long-row kernel forced, forward and backward: split with up to 32 parts per row and thousands of
    programs (the cooperative barrier under load), looped on rows the split kernels would take."""
    monkeypatch.setattr(kernels, "SPLIT_BLOCK_N", 256)
    monkeypatch.setattr(kernels, "SPLIT_FORWARD_PART", 512)  # 256 fp32 columns
    for n_rows, n_cols in ((4096, 256 * 31 + 5), (3, 8100)):
        x = torch.randn(n_rows, n_cols, device="cuda") * 4
        y = kernels.softmax_forward(x, x.dtype, kernel=kernel)
        torch.testing.assert_close(y, torch.softmax(x.double(), -1).float(), atol=1e-6, rtol=1e-4)
        g = torch.randn_like(x)
        dx = kernels.softmax_backward(g, y, 0.5, x.dtype, kernel=kernel)
        expect = 0.5 * y.double() * (g.double() - (g.double() * y.double()).sum(-1, keepdim=True))
        torch.testing.assert_close(dx, expect.float(), atol=1e-6, rtol=1e-4)
    scores = torch.randn(2, 3, 300, 20000, device="cuda")
    y = kernels.softmax_forward(scores, scores.dtype, 0.5, None, True, True, kernel=kernel)
    keep = torch.ones(300, 20000, dtype=torch.bool, device="cuda").tril()
    torch.testing.assert_close(y, torch.softmax((scores.double() * 0.5).masked_fill(~keep, float("-inf")), -1).float(),
                               atol=1e-6, rtol=1e-4)


@pytest.mark.cuda
def test_cuda_split_counters_between_launches(monkeypatch):
    """The split kernels' counters stay correct without a memset per launch: forward and backward launches of
    growing and shrinking row counts take turns, on the default stream and a side stream, and a CUDA graph of a
    split forward replays correctly between eager launches (its counters are its own)."""
    monkeypatch.setattr(kernels, "SPLIT_BLOCK_N", 256)
    monkeypatch.setattr(kernels, "SPLIT_FORWARD_PART", 512)  # 256 fp32 columns: 8 parts per row

    def check(n_rows):
        x = torch.randn(n_rows, 2000, device="cuda") * 4
        y = kernels.softmax_forward(x, x.dtype, kernel="split")
        torch.testing.assert_close(y, torch.softmax(x, -1), atol=1e-6, rtol=1e-4)
        g = torch.randn_like(x)
        dx = kernels.softmax_backward(g, y, 1.0, x.dtype, kernel="split")
        torch.testing.assert_close(dx, y * (g - (g * y).sum(-1, keepdim=True)), atol=1e-6, rtol=1e-4)

    side = torch.cuda.Stream()
    for n_rows in (5, 300, 7, 4096, 4096, 1, 2000, 64, 3000):
        check(n_rows)
        with torch.cuda.stream(side):
            check(n_rows + 11)
        torch.cuda.current_stream().wait_stream(side)
    x = torch.randn(700, 2000, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kernels.softmax_forward(x, x.dtype, kernel="split")
    for n_rows in (900, 10, 700):
        x.copy_(torch.randn_like(x) * 3)
        graph.replay()
        torch.testing.assert_close(y, torch.softmax(x, -1), atol=1e-6, rtol=1e-4)
        check(n_rows)


@pytest.mark.cuda
def test_cuda_fully_masked_rows_and_autocast():
    scores = torch.randn(2, 6, 20, device="cuda", requires_grad=True)
    mask = torch.rand(6, 20, device="cuda") > 0.5
    mask[2] = False
    y = fl.scaled_masked_softmax(scores, 1.0, mask)
    y.backward(torch.randn_like(y))
    assert not y.isnan().any() and (y[:, 2] == 0).all() and (scores.grad[:, 2] == 0).all()
    a = torch.randn(8, 64, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        s = a @ a.T
        assert fl.softmax(s).dtype == torch.softmax(s, -1).dtype == torch.float32
        assert fl.scaled_masked_softmax(s, 0.5, is_causal=True).dtype == torch.float32


@pytest.mark.cuda
def test_cuda_compile_and_opcheck():
    torch._dynamo.reset()
    x = torch.randn(4, 64, 300, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    f = lambda t: fl.scaled_masked_softmax(fl.softmax(t, 1), 2.0, is_causal=True).float().square().sum()  # noqa: E731
    (g1,) = torch.autograd.grad(torch.compile(f, fullgraph=True)(x), x)
    (g2,) = torch.autograd.grad(f(x), x)
    torch.testing.assert_close(g1, g2)
    opcheck(torch.ops.fusedlayers.softmax.default, (x, -1, torch.float32))
    opcheck(torch.ops.fusedlayers.softmax.default, (x, 1, torch.float32))
    opcheck(torch.ops.fusedlayers.scaled_masked_softmax.default, (x, 0.5, None, True))
